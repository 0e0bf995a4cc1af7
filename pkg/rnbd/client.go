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

	"github.com/rtrs-go/rtrs/internal/lib/names"

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

	mu     sync.Mutex
	devs   []*Device
	pinned bool // opened on its own (OpenSession): stays without devices
	remap  bool // a remap goroutine is running
	again  bool // and must run once more
	// remapKick wakes a remap waiting to try again: a link event asks for it at once.
	remapKick chan struct{}
	closing   bool
	remapped  sync.WaitGroup
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
	if err := names.Text(o.DevicePath); err != nil {
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
	s := &cltSess{c: c, name: o.SessName, pinned: pinned, remapKick: make(chan struct{}, 1)}
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
		select {
		case s.remapKick <- struct{}{}:
		default:
		}
		return
	}
	s.remap = true
	s.remapped.Add(1)
	go s.remapLoop()
}

// remapBackoff bounds the wait between tries of a remap that failed with a path up (an
// export the server refuses to open again): a link event tries again at once.
const remapBackoff = 30 * time.Second

func (s *cltSess) remapLoop() {
	defer s.remapped.Done()
	backoff := 10 * time.Millisecond
	var warned time.Time // the last warning; those within a minute of it are only counted
	suppressed := 0
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
			cancel()
			for _, d := range devs {
				if err != nil && !errors.Is(err, errRemapDevice) {
					break
				}
				if st := d.State(); st == StateUnmapped || st == StateClosedByServer {
					continue // a device the server closed stays closed until unmapped
				}
				// Each OPEN has its own deadline: one for them all ran out behind a few slow
				// ones, and the remap started over from the first device, for ever.
				octx, ocancel := context.WithTimeout(context.Background(), s.c.opts.ReconnectTimeout)
				if e := d.open(octx); e != nil && !errors.Is(e, errUnmappedMeanwhile) && !errors.Is(e, errClosedAtRemap) {
					err = fmt.Errorf("%w: %w", errRemapDevice, e)
				}
				ocancel()
			}
			if err != nil {
				if time.Since(warned) >= time.Minute {
					s.c.log.WithFields(log.Fields{"session": s.name, "failed_since_last_report": suppressed}).WithError(err).Warn("remap failed; trying again")
					warned, suppressed = time.Now(), 0
				} else {
					suppressed++
				}
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
			// Wait before trying again: a link event ends the wait.
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
				backoff = min(2*backoff, remapBackoff)
			case <-s.remapKick:
				t.Stop()
				backoff = 10 * time.Millisecond
			}
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
