package rnbd

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// DefaultReconnectTimeout is how long IO to a device waits for its session to come back
// before it fails with EIO.
const DefaultReconnectTimeout = 30 * time.Second

// ClientOptions configure a block client.
type ClientOptions struct {
	// Session is the template for the RTRS sessions the client opens: provider, connections,
	// policy, reconnect attempts, timings. Name, paths, port and the link-event callback are
	// set per session.
	Session transport.ClientOptions
	// ReconnectTimeout bounds how long IO waits for a session that lost all its paths.
	ReconnectTimeout time.Duration
}

// Client maps remote devices (the rnbd-client module): sessions by name, devices per session.
type Client struct {
	opts  ClientOptions
	log   *log.Entry
	hooks atomic.Pointer[[]*func()] // AfterCompletions hooks, copied on change
	hmu   sync.Mutex

	mu       sync.Mutex
	sessions map[string]*cltSess // open sessions only: what every reader lists
	// opening reserves the names of sessions being opened. The open runs without mu, so a
	// server that does not answer holds up only requests for that same name.
	opening map[string]*pendingOpen
	closed  bool
}

// pendingOpen is the reservation of a session name while its session opens.
type pendingOpen struct {
	done   chan struct{}      // closed once the open ended, whatever its outcome
	cancel context.CancelFunc // Close aborts the open with it
}

// NewClient returns a client with no sessions.
func NewClient(opts ClientOptions) *Client {
	if opts.ReconnectTimeout <= 0 {
		opts.ReconnectTimeout = DefaultReconnectTimeout
	}
	return &Client{opts: opts, sessions: map[string]*cltSess{}, opening: map[string]*pendingOpen{},
		log: log.G(context.Background()).WithField("component", "rnbd-clt")}
}

// cltSess is an RNBD client session (rnbd_clt_session) over one RTRS session.
type cltSess struct {
	c    *Client
	name string
	rtrs *transport.Session
	ver  uint8

	mu       sync.Mutex
	devs     []*Device
	pinned   bool // opened on its own (OpenSession): stays without devices
	remap    bool // a remap goroutine is running
	again    bool // and must run once more
	closing  bool
	remapped sync.WaitGroup
}

// MapOptions say what to map (the map_device tokens).
type MapOptions struct {
	SessName   string
	Paths      []transport.PathAddrs
	Port       uint16
	DevicePath string
	AccessMode AccessMode
}

// Map opens DevicePath on the server of session SessName. An existing session of that name
// is reused and Paths are ignored (as RNBD does); a new one needs at least one path, and all
// of them must connect.
func (c *Client) Map(ctx context.Context, o MapOptions) (*Device, error) {
	if o.DevicePath == "" || len(o.DevicePath) >= NameMax {
		return nil, fmt.Errorf("rnbd: device path of %d bytes: %w", len(o.DevicePath), syscall.EINVAL)
	}
	if err := transport.CheckText(o.DevicePath); err != nil {
		return nil, fmt.Errorf("rnbd: device path: %w", err)
	}
	if o.AccessMode > AccessMigration {
		return nil, fmt.Errorf("rnbd: access mode %d: %w", o.AccessMode, syscall.EINVAL)
	}
	var s *cltSess
	for {
		var err error
		if s, err = c.sessionWith(ctx, o, nil, false); err != nil {
			return nil, err
		}
		s.mu.Lock()
		if !s.closing {
			break
		}
		// Its last device went away since we found it: find or open the session again.
		s.mu.Unlock()
	}
	d := &Device{sess: s, path: o.DevicePath, mode: o.AccessMode, changed: make(chan struct{})}
	for _, e := range s.devs {
		if e.path == o.DevicePath {
			s.mu.Unlock()
			c.putSessIfIdle(s)
			return nil, fmt.Errorf("rnbd: %q is mapped in session %q already: %w", o.DevicePath, s.name, syscall.EEXIST)
		}
	}
	s.devs = append(s.devs, d) // claims the name while the open is on the wire
	s.mu.Unlock()
	if err := d.open(ctx); err != nil {
		s.remove(d)
		c.putSessIfIdle(s)
		return nil, err
	}
	return d, nil
}

// AfterCompletions registers fn to run after every batch of IO completions of the client's
// sessions, and after every ReadAsync/WriteAsync callback that ran elsewhere: a caller that
// gathers what its callbacks produce (replies to send) sends it from fn. fn must not block.
// The returned function unregisters it.
func (c *Client) AfterCompletions(fn func()) (remove func()) {
	p := &fn
	c.hmu.Lock()
	defer c.hmu.Unlock()
	var cur []*func()
	if h := c.hooks.Load(); h != nil {
		cur = *h
	}
	next := append(append([]*func(){}, cur...), p)
	c.hooks.Store(&next)
	return func() {
		c.hmu.Lock()
		defer c.hmu.Unlock()
		var keep []*func()
		for _, q := range *c.hooks.Load() {
			if q != p {
				keep = append(keep, q)
			}
		}
		c.hooks.Store(&keep)
	}
}

func (c *Client) runHooks() {
	if h := c.hooks.Load(); h != nil {
		for _, f := range *h {
			(*f)()
		}
	}
}

// Plug gathers the device's next requests and sends them together at Unplug
// (transport.Session.Plug); the caller must not wait for their completions in between.
func (d *Device) Plug() { d.sess.rtrs.Plug() }

// Unplug sends what Plug gathered.
func (d *Device) Unplug() { d.sess.rtrs.Unplug() }

// AfterCompletions registers fn with the device's client (see Client.AfterCompletions).
func (d *Device) AfterCompletions(fn func()) (remove func()) { return d.sess.c.AfterCompletions(fn) }

// OpenSession opens a session without mapping anything (the daemon's ctl/open_session); it
// stays until CloseSession, devices or not. mod, if not nil, adjusts the session's options
// (policy, reconnect attempts). An existing session of that name is EEXIST; while another
// request opens a session of that name, OpenSession waits for it (see sessionWith).
func (c *Client) OpenSession(ctx context.Context, o MapOptions, mod func(*transport.ClientOptions)) error {
	_, err := c.sessionWith(ctx, o, mod, true)
	return err
}

// CloseSession closes a session that has no device mapped (EBUSY otherwise).
func (c *Client) CloseSession(name string) error {
	c.mu.Lock()
	s, opening := c.sessions[name], c.opening[name] != nil
	c.mu.Unlock()
	if s == nil && opening {
		return fmt.Errorf("rnbd: session %q is still being opened: %w", name, syscall.EBUSY)
	}
	if s == nil {
		return fmt.Errorf("rnbd: no session %q: %w", name, syscall.ENOENT)
	}
	s.mu.Lock()
	if len(s.devs) > 0 {
		n := len(s.devs)
		s.mu.Unlock()
		return fmt.Errorf("rnbd: session %q has %d devices mapped: %w", name, n, syscall.EBUSY)
	}
	s.pinned = false
	s.mu.Unlock()
	c.putSessIfIdle(s)
	return nil
}

// SessionNames lists the open sessions, sorted; sessions still being opened are not listed.
func (c *Client) SessionNames() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, 0, len(c.sessions))
	for n := range c.sessions {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// sessionWith finds the session o.SessName or opens it (RTRS open, then SESS_INFO). With
// fresh (OpenSession) an existing session is EEXIST and a new one is pinned before anyone
// can see it. The name is reserved in c.opening while the open runs without c.mu, and the
// session is published in c.sessions only once it is usable. A request for a name being
// opened waits for that open, bounded by its ctx, as the kernel's rnbd waits for the RTRS
// connection of a session it found: if the open succeeded the session is used (or EEXIST),
// if it failed the request opens its own. So a name never gets two sessions.
func (c *Client) sessionWith(ctx context.Context, o MapOptions, mod func(*transport.ClientOptions), fresh bool) (*cltSess, error) {
	c.mu.Lock()
	for {
		if c.closed {
			c.mu.Unlock()
			return nil, transport.ErrClosed
		}
		if s := c.sessions[o.SessName]; s != nil {
			c.mu.Unlock()
			if fresh {
				return nil, fmt.Errorf("rnbd: session %q exists: %w", o.SessName, syscall.EEXIST)
			}
			return s, nil
		}
		p := c.opening[o.SessName]
		if p == nil {
			break
		}
		c.mu.Unlock()
		select {
		case <-p.done:
		case <-ctx.Done():
			return nil, fmt.Errorf("rnbd: waiting for session %q, which another request is opening: %w", o.SessName, ctx.Err())
		}
		c.mu.Lock()
	}
	if len(o.Paths) == 0 {
		c.mu.Unlock()
		// As in the kernel, unmapping a session's last device closes the session, so a short
		// map_device after that names a session that is gone.
		return nil, fmt.Errorf("rnbd: no session %q is open (unmapping its last device closes it) and the request names no path=: add path=... or open the session first: %w", o.SessName, syscall.ENXIO)
	}
	octx, cancel := context.WithCancel(ctx)
	defer cancel()
	p := &pendingOpen{done: make(chan struct{}), cancel: cancel}
	c.opening[o.SessName] = p
	c.mu.Unlock()
	defer close(p.done) // last: Close waits for it, so the session is closed or published by then

	s, err := c.open(octx, o, mod, fresh)
	c.mu.Lock()
	delete(c.opening, o.SessName)
	closed := c.closed
	if err == nil && !closed {
		c.sessions[o.SessName] = s
	}
	c.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if closed {
		// As putSessIfIdle: a remap a link event started meanwhile ends first.
		s.mu.Lock()
		s.closing = true
		s.mu.Unlock()
		s.remapped.Wait()
		_ = s.rtrs.Close()
		return nil, transport.ErrClosed
	}
	return s, nil
}

// open opens a session's RTRS session and exchanges SESS_INFO on it; c.mu is not held.
// A pinned session is pinned from the start: no failed Map can close it once published.
func (c *Client) open(ctx context.Context, o MapOptions, mod func(*transport.ClientOptions), pinned bool) (*cltSess, error) {
	s := &cltSess{c: c, name: o.SessName, pinned: pinned}
	so := c.opts.Session
	if mod != nil {
		mod(&so)
	}
	so.SessName, so.Paths, so.Port = o.SessName, o.Paths, o.Port
	so.OnLinkEvent = s.linkEvent
	prev := so.AfterCompletions
	so.AfterCompletions = func() {
		if prev != nil {
			prev()
		}
		c.runHooks()
	}
	rs, err := transport.Open(ctx, so)
	if err != nil {
		return nil, err
	}
	s.rtrs = rs
	if err := s.sessInfo(ctx); err != nil {
		rs.Close()
		return nil, err
	}
	return s, nil
}

func (s *cltSess) sessInfo(ctx context.Context) error {
	var usr [SessInfoSize]byte
	MsgSessInfo{Ver: ProtoVerMajor}.Put(usr[:], MsgTypeSessInfo)
	var rsp [SessInfoRspSize]byte
	if err := s.rtrs.DoAdmin(ctx, transport.Read, usr[:], rsp[:]); err != nil {
		return fmt.Errorf("rnbd: SESS_INFO: %w", err)
	}
	var m MsgSessInfo
	if err := m.Unmarshal(rsp[:], MsgTypeSessInfoRsp); err != nil {
		return err
	}
	s.ver = min(m.Ver, ProtoVerMajor)
	return nil
}

// linkEvent runs on a transport goroutine: mark devices down, or remap them.
func (s *cltSess) linkEvent(ev transport.LinkEvent) {
	switch ev {
	case transport.LinkDisconnected:
		s.mu.Lock()
		devs := append([]*Device(nil), s.devs...)
		s.mu.Unlock()
		for _, d := range devs {
			d.setDown()
		}
	case transport.LinkReconnected:
		s.kickRemap()
	}
}

// errRemapDevice marks a remap error of one device; the others are still tried.
var errRemapDevice = errors.New("rnbd: remap")

// kickRemap starts (or repeats) the remap: SESS_INFO, then OPEN of every device (RNBD's
// reconnect path). The server answers an OPEN of a device it still has open with its id.
func (s *cltSess) kickRemap() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return
	}
	if s.remap {
		s.again = true
		return
	}
	s.remap = true
	s.remapped.Add(1)
	go s.remapLoop()
}

func (s *cltSess) remapLoop() {
	defer s.remapped.Done()
	backoff := 10 * time.Millisecond
	for {
		s.mu.Lock()
		s.again = false
		devs := append([]*Device(nil), s.devs...)
		closing := s.closing
		s.mu.Unlock()
		ok := !closing
		if ok {
			ctx, cancel := context.WithTimeout(context.Background(), s.c.opts.ReconnectTimeout)
			err := s.sessInfo(ctx)
			for _, d := range devs {
				if err != nil && !errors.Is(err, errRemapDevice) {
					break
				}
				if st := d.State(); st == StateUnmapped || st == StateClosedByServer {
					continue // a device the server closed stays closed until unmapped
				}
				if e := d.open(ctx); e != nil {
					err = fmt.Errorf("%w: %w", errRemapDevice, e)
				}
			}
			cancel()
			if err != nil {
				s.c.log.WithField("session", s.name).Warnf("remap: %v", err)
				ok = false
			}
		}
		s.mu.Lock()
		if s.closing || (ok && !s.again) {
			s.remap = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		if !ok {
			// Wait for a path before trying again; the link event kicks us too.
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			if !s.anyConnected() {
				s.mu.Lock()
				s.remap = false
				s.mu.Unlock()
				return // LinkReconnected will start it again
			}
		}
	}
}

func (s *cltSess) anyConnected() bool {
	for _, p := range s.rtrs.Paths() {
		if p.State() == transport.StateConnected {
			return true
		}
	}
	return false
}

func (s *cltSess) remove(d *Device) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, e := range s.devs {
		if e == d {
			s.devs = append(s.devs[:i], s.devs[i+1:]...)
			return
		}
	}
}

// putSessIfIdle closes a session that has no devices left (the kernel frees an RNBD session
// with its last device).
func (c *Client) putSessIfIdle(s *cltSess) {
	c.mu.Lock()
	s.mu.Lock()
	idle := len(s.devs) == 0 && !s.closing && !s.pinned
	if idle {
		s.closing = true
		if c.sessions[s.name] == s {
			delete(c.sessions, s.name)
		}
	}
	s.mu.Unlock()
	c.mu.Unlock()
	if idle {
		s.remapped.Wait()
		s.rtrs.Close()
	}
}

// Session returns the RTRS session of that name, if the client has it.
func (c *Client) Session(name string) *transport.Session {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.sessions[name]; s != nil {
		return s.rtrs
	}
	return nil
}

// Devices lists the mapped devices by session and path.
func (c *Client) Devices() []*Device {
	c.mu.Lock()
	var out []*Device
	for _, s := range c.sessions {
		s.mu.Lock()
		out = append(out, s.devs...)
		s.mu.Unlock()
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].sess.name != out[j].sess.name {
			return out[i].sess.name < out[j].sess.name
		}
		return out[i].path < out[j].path
	})
	return out
}

// Close aborts the sessions being opened, unmaps every device and closes the sessions.
func (c *Client) Close(ctx context.Context) {
	c.mu.Lock()
	c.closed = true
	var pending []*pendingOpen
	for _, p := range c.opening {
		p.cancel()
		pending = append(pending, p)
	}
	c.mu.Unlock()
	// An aborted open returns soon; waiting for it means no session outlives Close.
	for _, p := range pending {
		select {
		case <-p.done:
		case <-ctx.Done():
		}
	}
	for _, d := range c.Devices() {
		_ = d.Unmap(ctx)
	}
	for _, n := range c.SessionNames() {
		_ = c.CloseSession(n)
	}
}

// DeviceState is a mapped device's state.
type DeviceState int

// Device states: mapped and usable; disconnected (its session has no path; IO waits up to
// the reconnect timeout); unmapped; closed by the server (its force_close: IO fails with
// EIO at once, the device stays until unmapped and is not remapped on a reconnect).
const (
	StateMapped DeviceState = iota
	StateDisconnected
	StateUnmapped
	StateClosedByServer
)

func (st DeviceState) String() string {
	return [...]string{"open", "disconnected", "closed", "closed-by-server"}[st]
}

// Device is a mapped remote device: an io.ReaderAt and io.WriterAt of its size, plus Flush,
// Discard and WriteZeroes.
type Device struct {
	sess *cltSess
	path string
	mode AccessMode

	mu        sync.Mutex
	state     DeviceState
	id        uint32
	geo       MsgOpenRsp
	downSince time.Time
	changed   chan struct{} // closed and replaced on every state change

	// noUnmapRefused: the server answered a WRITE_ZEROES with RNBD_F_NOUNMAP EOPNOTSUPP (ours
	// before protocol 2.2 announced WRITE_ZEROES but refused flags it did not know). Zeroes
	// that must stay allocated are then written as data, until the next open.
	noUnmapRefused atomic.Bool
}

// open sends OPEN and takes the answer: id and geometry. A remapped device must keep its size.
func (d *Device) open(ctx context.Context) error {
	var usr [OpenSize]byte
	if err := (MsgOpen{AccessMode: d.mode, DevName: d.path}).Put(usr[:]); err != nil {
		return err
	}
	var buf [OpenRspSize]byte
	if err := d.sess.rtrs.DoAdmin(ctx, transport.Read, usr[:], buf[:]); err != nil {
		return fmt.Errorf("rnbd: open %q: %w", d.path, err)
	}
	var rsp MsgOpenRsp
	if err := rsp.Unmarshal(buf[:]); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state == StateUnmapped {
		return nil
	}
	if d.geo.LogicalBlockSize != 0 && (rsp.NSectors != d.geo.NSectors || rsp.LogicalBlockSize != d.geo.LogicalBlockSize) {
		d.setStateLocked(StateDisconnected)
		return fmt.Errorf("rnbd: %q changed geometry on remap (%d → %d sectors): %w", d.path, d.geo.NSectors, rsp.NSectors, syscall.EIO)
	}
	d.id, d.geo = rsp.DeviceID, rsp
	d.noUnmapRefused.Store(false) // the server may have been upgraded under a remap
	d.setStateLocked(StateMapped)
	return nil
}

func (d *Device) setStateLocked(st DeviceState) {
	if st == StateDisconnected && d.state != StateDisconnected {
		d.downSince = time.Now()
	}
	d.state = st
	close(d.changed)
	d.changed = make(chan struct{})
}

func (d *Device) setDown() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state == StateMapped {
		d.setStateLocked(StateDisconnected)
	}
}

// Opened says whether the first OPEN has been answered (the device has its size); a
// device is listed from the start of Map, so that a second Map of it is EEXIST.
func (d *Device) Opened() bool { d.mu.Lock(); defer d.mu.Unlock(); return d.geo.LogicalBlockSize != 0 }

// Session is the device's session name; Path its path on the server.
func (d *Device) Session() string { return d.sess.name }

// Path is the device path the server opened.
func (d *Device) Path() string { return d.path }

// AccessMode is the mode the device was mapped with.
func (d *Device) AccessMode() AccessMode { return d.mode }

// State is the device's state.
func (d *Device) State() DeviceState { d.mu.Lock(); defer d.mu.Unlock(); return d.state }

// ID is the server's id for the device (it changes when the device is remapped).
func (d *Device) ID() uint32 { d.mu.Lock(); defer d.mu.Unlock(); return d.id }

// Size is the device's size in bytes.
func (d *Device) Size() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int64(d.geo.NSectors) * SectorSize
}

// Geometry is the server's OPEN_RSP for the device.
func (d *Device) Geometry() MsgOpenRsp { d.mu.Lock(); defer d.mu.Unlock(); return d.geo }

// BlockSize is the logical block size: offsets and lengths of IO must be multiples of it.
func (d *Device) BlockSize() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int(d.geo.LogicalBlockSize)
}

// Unmap sends CLOSE and forgets the device; the session goes with its last device. IO still
// waiting fails.
func (d *Device) Unmap(ctx context.Context) error {
	d.mu.Lock()
	if d.state == StateUnmapped {
		d.mu.Unlock()
		return fmt.Errorf("rnbd: %q is not mapped: %w", d.path, syscall.ENOENT)
	}
	// A device the server closed is closed too: the server still holds its id for us.
	wasMapped, id := d.state == StateMapped || d.state == StateClosedByServer, d.id
	d.setStateLocked(StateUnmapped)
	d.mu.Unlock()
	var err error
	if wasMapped {
		var usr [CloseSize]byte
		MsgClose{DeviceID: id}.Put(usr[:])
		if err = d.sess.rtrs.DoAdmin(ctx, transport.Write, usr[:], nil); err != nil {
			err = fmt.Errorf("rnbd: close %q: %w", d.path, err)
		}
	}
	d.sess.remove(d)
	d.sess.c.putSessIfIdle(d.sess)
	return err
}

// usable waits until the device is mapped and returns its id, or fails: EIO once the
// session has been gone for longer than the reconnect timeout, ENODEV when unmapped.
func (d *Device) usable(ctx context.Context) (uint32, error) {
	for {
		d.mu.Lock()
		st, id, ch := d.state, d.id, d.changed
		deadline := d.downSince.Add(d.sess.c.opts.ReconnectTimeout)
		d.mu.Unlock()
		switch st {
		case StateMapped:
			return id, nil
		case StateUnmapped:
			return 0, fmt.Errorf("rnbd: %q is unmapped: %w", d.path, syscall.ENODEV)
		case StateClosedByServer:
			return 0, d.errClosedByServer()
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			return 0, fmt.Errorf("rnbd: session %q gone for longer than %v: %w", d.sess.name, d.sess.c.opts.ReconnectTimeout, syscall.EIO)
		}
		t := time.NewTimer(wait)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		}
		t.Stop()
	}
}

// retryable says whether an IO error means "the session or the device id went away":
// no path took the request, or the server does not know the id (it lost the session).
func retryable(err error) bool {
	return errors.Is(err, transport.ErrNoPath) || errors.Is(err, syscall.ENOTCONN) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.ENODEV)
}

// submit sends one IO of at most the max IO size, and waits and resends it while the
// session is away (within the reconnect timeout).
func (d *Device) submit(ctx context.Context, op Op, flags uint32, off int64, n int, data []byte) error {
	var usr [IOSize]byte
	dir := transport.Write
	if op == OpRead {
		dir = transport.Read
	}
	for {
		id, err := d.usable(ctx)
		if err != nil {
			return err
		}
		MsgIO{DeviceID: id, Sector: uint64(off / SectorSize), RW: uint32(op) | flags, BiSize: uint32(n)}.Put(usr[:])
		err = d.sess.rtrs.Do(ctx, dir, usr[:], data)
		if serverClosed(err) {
			if d.closedByServer(id) {
				return d.errClosedByServer()
			}
			continue // the device was remapped under the request: resend with the new id
		}
		if err == nil || !retryable(err) || ctx.Err() != nil {
			return err
		}
		// The link event may not have come yet; mark the device down so that we wait for
		// the remap, and ask for one in case the session is up and only the id is stale.
		d.markStale(id)
	}
}

// maxIO is the largest IO one request carries: the session's and the device's limit, in
// whole blocks.
func (d *Device) maxIO() int {
	d.mu.Lock()
	lbs, hw := int(d.geo.LogicalBlockSize), int(d.geo.MaxHWSectors)*SectorSize
	d.mu.Unlock()
	m := d.sess.rtrs.MaxIOSize()
	if hw > 0 {
		m = min(m, hw)
	}
	return m - m%lbs
}

// check validates a range against the device: whole blocks, inside the device.
func (d *Device) check(off int64, n int64) error {
	d.mu.Lock()
	lbs, size := int64(d.geo.LogicalBlockSize), int64(d.geo.NSectors)*SectorSize
	d.mu.Unlock()
	if off < 0 || n < 0 || off%lbs != 0 || n%lbs != 0 || off+n > size {
		return fmt.Errorf("rnbd: %d bytes at %d on a %d-byte device with %d-byte blocks: %w", n, off, size, lbs, syscall.EINVAL)
	}
	return nil
}

// split runs fn on consecutive pieces of [off, off+n) of at most max bytes, in parallel,
// and returns the first error.
func split(off, n int64, max int, fn func(off int64, n int) error) error {
	if n <= int64(max) {
		return fn(off, int(n))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for n > 0 {
		k := int(min(n, int64(max)))
		wg.Add(1)
		go func(off int64, k int) {
			defer wg.Done()
			if err := fn(off, k); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}(off, k)
		off, n = off+int64(k), n-int64(k)
	}
	wg.Wait()
	return first
}

// ReadAtContext reads len(p) bytes at off (whole blocks).
func (d *Device) ReadAtContext(ctx context.Context, p []byte, off int64) error {
	if err := d.check(off, int64(len(p))); err != nil {
		return err
	}
	return split(off, int64(len(p)), d.maxIO(), func(o int64, n int) error {
		b := p[o-off : o-off+int64(n)]
		return d.submit(ctx, OpRead, 0, o, n, b)
	})
}

// WriteAtContext writes p at off (whole blocks); fua makes it durable before it completes.
func (d *Device) WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error {
	if err := d.check(off, int64(len(p))); err != nil {
		return err
	}
	if d.mode == AccessRO {
		return fmt.Errorf("rnbd: %q is mapped ro: %w", d.path, syscall.EPERM)
	}
	flags := uint32(0)
	if fua {
		flags = FlagFUA | FlagSync
	}
	return split(off, int64(len(p)), d.maxIO(), func(o int64, n int) error {
		return d.submit(ctx, OpWrite, flags, o, n, p[o-off:o-off+int64(n)])
	})
}

// Flush makes every completed write durable (fdatasync on the server).
func (d *Device) Flush(ctx context.Context) error {
	return d.submit(ctx, OpFlush, FlagSync, 0, 0, nil)
}

// Discard deallocates whole blocks; they read back as zeroes from a file export.
func (d *Device) Discard(ctx context.Context, off, n int64) error {
	return d.rangeOp(ctx, OpDiscard, 0, off, n, d.Geometry().MaxDiscardSectors)
}

// WriteZeroes makes whole blocks read back as zeroes without sending them; noUnmap asks the
// server to keep them allocated (RNBD_F_NOUNMAP: a 2.2 server does, a kernel one of 2.0 ignores
// it and may deallocate them). A server that announces no write-zeroes limit (Linux 6.1's) gets
// none: EOPNOTSUPP, as its op 5 was WRITE_SAME, which it cannot serve. A server that refuses
// NOUNMAP, or cannot zero the range at all, gets the zeroes as data: allocated either way.
func (d *Device) WriteZeroes(ctx context.Context, off, n int64, noUnmap bool) error {
	max := d.Geometry().MaxWriteZeroesSectors
	if !noUnmap || max == 0 {
		return d.rangeOp(ctx, OpWriteZeroes, 0, off, n, max)
	}
	if !d.noUnmapRefused.Load() {
		err := d.rangeOp(ctx, OpWriteZeroes, FlagNoUnmap, off, n, max)
		if !errors.Is(err, syscall.EOPNOTSUPP) {
			return err
		}
		if !d.noUnmapRefused.Swap(true) {
			d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).
				Warn("server refused WRITE_ZEROES with NOUNMAP; zeroes that must stay allocated are written as data")
		}
	}
	// Idempotent: a range partly zeroed before the refusal is written whole.
	if err := d.check(off, n); err != nil {
		return err
	}
	zero := make([]byte, min(n, int64(d.maxIO())))
	// At most zeroWindow requests at once, however long the range (NBD's may be 4 GiB).
	for n > 0 {
		w := min(n, int64(len(zero))*zeroWindow)
		if err := split(off, w, len(zero), func(o int64, k int) error {
			return d.submit(ctx, OpWrite, 0, o, k, zero[:k])
		}); err != nil {
			return err
		}
		off, n = off+w, n-w
	}
	return nil
}

// zeroWindow is how many writes of zeroes WriteZeroes's fallback has in flight at most.
const zeroWindow = 32

// CanDiscard says whether the server takes DISCARD on this device (its open response
// announced a discard limit; not on an ro mapping).
func (d *Device) CanDiscard() bool { return d.Geometry().MaxDiscardSectors != 0 }

// CanWriteZeroes says whether the server takes WRITE_ZEROES on this device: a server of
// Linux 6.12 or later, or ours, on a writable mapping.
func (d *Device) CanWriteZeroes() bool { return d.Geometry().MaxWriteZeroesSectors != 0 }

func (d *Device) rangeOp(ctx context.Context, op Op, flags uint32, off, n int64, maxSect uint32) error {
	if maxSect == 0 {
		return fmt.Errorf("rnbd: %v not supported on %q: %w", op, d.path, syscall.EOPNOTSUPP)
	}
	if err := d.check(off, n); err != nil {
		return err
	}
	lbs := d.BlockSize()
	max := int(min(int64(maxSect)*SectorSize, 1<<30))
	max -= max % lbs
	return split(off, n, max, func(o int64, k int) error {
		return d.submit(ctx, op, flags, o, k, nil)
	})
}

// ReadAt implements io.ReaderAt: whole blocks, no deadline beyond the reconnect timeout.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	if err := d.ReadAtContext(context.Background(), p, off); err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteAt implements io.WriterAt (whole blocks).
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := d.WriteAtContext(context.Background(), p, off, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// ioHdr is the user header of an asynchronous request: it must live until the completion.
// asyncReq is one request of the asynchronous path with its RNBD header, pooled with its
// completion callback bound once, so that the path allocates nothing per IO.
type asyncReq struct {
	hdr   [IOSize]byte
	d     *Device
	ctx   context.Context
	op    Op
	flags uint32
	off   int64
	p     []byte
	id    uint32
	done  func(error)
	cb    func(error)
}

var asyncPool sync.Pool

func init() {
	// Set here: the callback puts the request back into the pool it comes from.
	asyncPool.New = func() any {
		r := new(asyncReq)
		r.cb = r.complete
		return r
	}
}

// complete is the transport's callback: the request goes back to the pool before done runs.
func (r *asyncReq) complete(err error) {
	d, ctx, op, flags, off, p, id, done := r.d, r.ctx, r.op, r.flags, r.off, r.p, r.id, r.done
	r.d, r.ctx, r.p, r.done = nil, nil, nil, nil
	asyncPool.Put(r)
	if err != nil {
		d.asyncFailed(ctx, op, flags, off, p, id, done, err)
		return
	}
	done(nil)
}

// ReadAsync reads len(p) bytes at off and calls done once, from a transport goroutine or
// its own, followed by the AfterCompletions hooks; done must not block. An IO that fits one request and finds the device mapped
// goes out from the caller's goroutine with no hand-off; anything else (splitting, waiting
// for a reconnect, resending) runs on a goroutine of its own.
func (d *Device) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.async(ctx, OpRead, 0, off, p, done)
}

// WriteAsync is ReadAsync for writes; fua makes the write durable before done.
func (d *Device) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	if d.mode == AccessRO {
		done(fmt.Errorf("rnbd: %q is mapped ro: %w", d.path, syscall.EPERM))
		d.sess.c.runHooks()
		return
	}
	flags := uint32(0)
	if fua {
		flags = FlagFUA | FlagSync
	}
	d.async(ctx, OpWrite, flags, off, p, done)
}

func (d *Device) async(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	if err := d.check(off, int64(len(p))); err != nil {
		done(err)
		d.sess.c.runHooks()
		return
	}
	max := d.maxIO()
	if len(p) <= max {
		d.asyncOne(ctx, op, flags, off, p, done)
		return
	}
	// Split at the max IO size; the last piece to complete reports the first error.
	var left atomic.Int32
	var first atomic.Pointer[error]
	left.Store(int32((len(p) + max - 1) / max))
	piece := func(err error) {
		if err != nil {
			first.CompareAndSwap(nil, &err)
		}
		if left.Add(-1) == 0 {
			if e := first.Load(); e != nil {
				done(*e)
			} else {
				done(nil)
			}
		}
	}
	for o := 0; o < len(p); o += max {
		d.asyncOne(ctx, op, flags, off+int64(o), p[o:min(o+max, len(p))], piece)
	}
}

// asyncOne sends one request; when the device is not mapped, or the session or the id went
// away under the request, it continues on a goroutine with the waiting, resending submit.
func (d *Device) asyncOne(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	d.mu.Lock()
	st, id := d.state, d.id
	d.mu.Unlock()
	if st == StateClosedByServer {
		done(d.errClosedByServer())
		d.sess.c.runHooks()
		return
	}
	if st != StateMapped {
		d.asyncSlow(ctx, op, flags, off, p, done)
		return
	}
	r := asyncPool.Get().(*asyncReq)
	r.d, r.ctx, r.op, r.flags, r.off, r.p, r.id, r.done = d, ctx, op, flags, off, p, id, done
	MsgIO{DeviceID: id, Sector: uint64(off / SectorSize), RW: uint32(op) | flags, BiSize: uint32(len(p))}.Put(r.hdr[:])
	dir := transport.Write
	if op == OpRead {
		dir = transport.Read
	}
	if err := d.sess.rtrs.Request(ctx, dir, r.hdr[:], p, r.cb); err != nil {
		r.d, r.ctx, r.p, r.done = nil, nil, nil, nil
		asyncPool.Put(r)
		d.asyncFailed(ctx, op, flags, off, p, id, done, err)
		d.sess.c.runHooks()
	}
}

// asyncFailed ends a request that failed: one the device can get back from (a session or
// id gone: a remap follows) goes on waiting and resending, the others fail.
func (d *Device) asyncFailed(ctx context.Context, op Op, flags uint32, off int64, p []byte, id uint32, done func(error), err error) {
	if serverClosed(err) {
		if d.closedByServer(id) {
			done(d.errClosedByServer())
			return
		}
		d.asyncSlow(ctx, op, flags, off, p, done) // remapped meanwhile: resend
		return
	}
	if retryable(err) && ctx.Err() == nil {
		d.markStale(id)
		d.asyncSlow(ctx, op, flags, off, p, done)
		return
	}
	done(err)
}

// asyncSlow finishes a request with submit on a goroutine of its own; outside the transport's
// completion goroutine, the hooks run after done there.
func (d *Device) asyncSlow(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	go func() {
		done(d.submit(ctx, op, flags, off, len(p), p))
		d.sess.c.runHooks()
	}()
}

// markStale records that IO with id found no session or an unknown id: the device waits
// for a remap, which is asked for if the session has a path.
func (d *Device) markStale(id uint32) {
	d.mu.Lock()
	if d.state == StateMapped && d.id == id {
		d.setStateLocked(StateDisconnected)
	}
	d.mu.Unlock()
	if d.sess.anyConnected() {
		d.sess.kickRemap()
	}
}

// serverClosed says whether an IO error is the server's answer that it does not serve the
// device id any more although the session is up: ENOTCONN from the wire, as the kernel's
// server (and ours after force_close) answers IO to a device it closed. The transport's own
// ENOTCONN (a path not connected, ErrNotConn) is not that.
func serverClosed(err error) bool {
	var en syscall.Errno
	return errors.As(err, &en) && en == syscall.ENOTCONN && !errors.Is(err, transport.ErrNotConn)
}

// closedByServer turns the device closed-by-server if id is still its id (says false when a
// remap gave it another id meanwhile) and logs it once.
func (d *Device) closedByServer(id uint32) bool {
	d.mu.Lock()
	switch {
	case d.state == StateClosedByServer:
		d.mu.Unlock()
		return true
	case d.id != id || d.state == StateUnmapped:
		d.mu.Unlock()
		return false
	}
	d.setStateLocked(StateClosedByServer)
	d.mu.Unlock()
	d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path, "device_id": id}).
		Warn("the server closed the device (force_close on the server): its IO fails with EIO until it is unmapped and mapped again")
	return true
}

func (d *Device) errClosedByServer() error {
	return fmt.Errorf("rnbd: %q of session %q was closed by the server (force_close): %w", d.path, d.sess.name, syscall.EIO)
}
