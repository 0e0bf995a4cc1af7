package rnbd

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rtrs-go/rtrs/internal/lib/errno"
	"github.com/rtrs-go/rtrs/internal/lib/names"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// SessNamePlaceholder in a search path is replaced by the client's session name, as
// RNBD's dev_search_path does.
const SessNamePlaceholder = "%SESSNAME%"

// ServerOptions configure the block server.
type ServerOptions struct {
	// SearchPath is the directory exports are opened under (dev_search_path); it may contain
	// %SESSNAME%.
	SearchPath string
	// MaxIOSize is the largest IO the server announces (bytes); the transport's chunk size
	// bounds it too.
	MaxIOSize int
	// ZeroCopyReadMin: READs of at least this many bytes from a tmpfs or ramfs export go
	// from the page cache to the client without passing through the chunk
	// (transport.SrvRequest.RespondFile). 0 takes DefaultZeroCopyReadMin; a negative value
	// turns it off. Not for a client on this host (transport.SrvPath.PeerOnHost) unless
	// ZeroCopyLocal: over a loopback socket the page cache's pages are copied all the same,
	// by the client's receive, which costs it more than the server saves
	// (docs/benchmarks.md).
	ZeroCopyReadMin int
	// ZeroCopyLocal lets READs of a client on this host go from the page cache too.
	ZeroCopyLocal bool
	// ACL says who may open which export in which mode (nil: everyone ro or rw, nobody
	// migration). SetACL replaces it.
	ACL *ACL
	// ExportIO says how READs and WRITEs reach a block device export: ExportIODirect (the
	// zero value) or ExportIOBuffered. Regular files always go through the page cache.
	ExportIO ExportIO
}

// ExportIO is how a block device export's READs and WRITEs reach the device.
type ExportIO int

const (
	// ExportIODirect: O_DIRECT, through a Linux AIO context per open device, as the kernel's
	// server sends bios. The data passes through no page cache, a WRITE has reached the device
	// (its volatile cache, or the medium with FUA) when it is answered, and no thread waits
	// per IO.
	ExportIODirect ExportIO = iota
	// ExportIOBuffered: through the device's page cache. READs the cache holds are served at
	// once; the others, and WRITEs that would wait, on a goroutine each.
	ExportIOBuffered
)

// String is the name rtrs-serverd's -export-io takes.
func (e ExportIO) String() string {
	if e == ExportIOBuffered {
		return "buffered"
	}
	return "direct"
}

// ParseExportIO parses "direct" or "buffered".
func ParseExportIO(v string) (ExportIO, error) {
	switch v {
	case "direct":
		return ExportIODirect, nil
	case "buffered":
		return ExportIOBuffered, nil
	}
	return 0, fmt.Errorf("export IO %q: direct or buffered: %w", v, syscall.EINVAL)
}

// DefaultZeroCopyReadMin is the default ServerOptions.ZeroCopyReadMin. Below it a READ is
// cheaper copied into the chunk: its response then leaves in one vectored write with the
// others of its burst, where a file-sourced one takes a system call of its own.
const DefaultZeroCopyReadMin = 64 << 10

// ServerStats count what the server did to its exports, across sessions. They are counted
// per CPU (stats.Sharded, the chunk as the hint where the CPU number is dear), so the
// connections of a path do not pass cache lines between CPUs per IO. ZeroCopyReads are the
// Reads sent straight from the page cache. Preflushes count the requests with RNBD_F_PREFLUSH
// (a flush before the operation), NoUnmapZeroes the WRITE_ZEROES with RNBD_F_NOUNMAP.
type ServerStats struct {
	Reads, ZeroCopyReads, Writes, FUAWrites, Flushes, Discards, WriteZeroes, Errors stats.Sharded
	Preflushes, NoUnmapZeroes                                                       stats.Sharded
}

// Server serves RNBD requests from RTRS: it is the transport server's Handler.
type Server struct {
	opts  ServerOptions
	log   *log.Entry
	Stats ServerStats

	mu       sync.Mutex
	sessions map[*transport.SrvSess]*srvSess
	devs     map[devKey]*srvDev // open devices by identity, for the access-mode rule
	nextID   uint32
	closed   bool
	wg       sync.WaitGroup // IO and control requests on goroutines of their own
	blk      *blockers      // runs those goroutines
	// loops counts the devices open with direct IO, each with a reaper goroutine, an AIO
	// context and two descriptors, per session and open device: past maxLoops, opens use
	// the page cache.
	loops int
	// ioDevs indexes every session's devices for IO, which looks them up without s.mu: a
	// copy rebuilt under s.mu whenever a device opens or closes.
	ioDevs   atomic.Pointer[map[ioKey]*sessDev]
	shutdown atomic.Bool
	// openRefused counts the OPENs answered with an error, by errno (under mu).
	openRefused map[syscall.Errno]uint64
	// unknownRefusals limits the refusals logged for sessions the server keeps no state for
	// (no SESS_INFO or OPEN yet, or gone): a peer must not write the log at line rate.
	unknownRefusals log.Limiter
	exportErrs      log.Limiter // the exports' EIO, once a minute per session
}

// OpenRefused is how many OPENs were answered with an error since the server started, by
// errno (the errnos come from the server's own checks, a fixed set).
func (s *Server) OpenRefused() map[syscall.Errno]uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.openRefused)
}

type ioKey struct {
	sess *transport.SrvSess
	id   uint32
}

type devKey struct {
	blk      bool
	dev, ino uint64
}

// srvDev is one exported device open in at least one session (rnbd_srv_dev).
type srvDev struct {
	name    string
	readers int
	writers int
	// dir is the device's name in the rnbd-server tree (unique among open devices), link
	// what its block_dev points to (Export).
	dir, link string
}

// srvSess is an RNBD server session (rnbd_srv_session): its open devices by id.
type srvSess struct {
	name string
	ver  uint8
	devs map[uint32]*sessDev
	// forced are the devices closed by ForceClose whose ids the client still holds: IO to
	// them is refused with ENOTCONN (not ENODEV, which makes a client remap), and a CLOSE
	// of one is answered 0 and forgets it (the kernel's keep_id).
	forced map[uint32]*sessDev
	// refusals limits the log lines of the session's refused OPENs per cause: one client
	// asking again and again does not hide another's refusals, and goes with its session.
	refusals log.Limiter
}

// sessDev is a device opened by a session (rnbd_srv_sess_dev).
type sessDev struct {
	id   uint32
	name string
	mode AccessMode
	key  devKey

	mu     sync.RWMutex // IO holds it shared; close takes it to retire the descriptor
	b      *backing
	closed bool
	forced bool // closed by ForceClose
	direct bool // holds one of the server's direct IO loops (under the server's mu)
}

// NewServer returns a handler that exports files and block devices under opts.SearchPath.
func NewServer(opts ServerOptions) (*Server, error) {
	if opts.SearchPath == "" {
		return nil, fmt.Errorf("rnbd: no search path: %w", syscall.EINVAL)
	}
	if opts.MaxIOSize <= 0 {
		opts.MaxIOSize = 128 << 10
	}
	if opts.ZeroCopyReadMin == 0 {
		opts.ZeroCopyReadMin = DefaultZeroCopyReadMin
	}
	s := &Server{
		opts:     opts,
		log:      log.G(context.Background()).WithField("component", "rnbd-srv"),
		sessions: map[*transport.SrvSess]*srvSess{},
		devs:     map[devKey]*srvDev{},
		blk:      newBlockers(),
		// Ids are never reused within a server's life, and a restarted server starts
		// elsewhere, so a client's stale id names no device rather than another one.
		nextID: rand.Uint32(),
	}
	s.noteSearchPath(opts.SearchPath)
	return s, nil
}

// noteSearchPath warns of a search path with text after %SESSNAME%: it is kept here (the
// directory is <before><session><after>), where the kernel's server drops it.
func (s *Server) noteSearchPath(p string) {
	if _, after, ok := strings.Cut(p, SessNamePlaceholder); ok && after != "" && after != "/" {
		s.log.Warnf("dev_search_path %q: %q after %s is kept here; the kernel's server would drop it", p, after, SessNamePlaceholder)
	}
}

// DeviceInfo describes an open device of a server session.
type DeviceInfo struct {
	Session    string
	ID         uint32
	Path       string
	AccessMode AccessMode
}

// Devices lists every session's open devices, by session name and id.
func (s *Server) Devices() []DeviceInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []DeviceInfo
	for _, ss := range s.sessions {
		for _, d := range ss.devs {
			out = append(out, DeviceInfo{Session: ss.name, ID: d.id, Path: d.name, AccessMode: d.mode})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Session != out[j].Session {
			return out[i].Session < out[j].Session
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// Close closes every device and waits for the IO in progress.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	s.shutdown.Store(true)
	var all []*transport.SrvSess
	for ts := range s.sessions {
		all = append(all, ts)
	}
	s.mu.Unlock()
	for _, ts := range all {
		s.destroySess(ts)
	}
	s.wg.Wait()
}

// Request implements transport.Handler. The transport's goroutine must not block: IO that
// cannot block runs right here, the rest on a goroutine of its own.
func (s *Server) Request(r *transport.SrvRequest) {
	if s.shutdown.Load() {
		r.Respond(-int(syscall.ESHUTDOWN))
		return
	}
	// Reads and writes the page cache can take at once are served here, in the transport's
	// receive burst (their responses then leave in one batch), touching nothing the other
	// connections write per IO; the rest block and go to a goroutine of their own.
	if typ, _ := PeekType(r.Usr); typ == MsgTypeIO {
		if err := s.processIO(r, true); err != errWouldBlock {
			if err != errResponded {
				if err != nil {
					s.failed(r, err)
				}
				r.Respond(errno.Neg(err))
			}
			return
		}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		r.Respond(-int(syscall.ESHUTDOWN))
		return
	}
	s.wg.Add(1)
	s.mu.Unlock()
	group, limit, counted := s.blockGroup(r)
	s.blk.run(group, r.Session(), limit, counted, func() {
		defer s.wg.Done()
		if rc, answered := s.process(r); !answered {
			r.Respond(rc)
		}
	})
}

// ctlGroup is a session's group of control requests among the blockers.
type ctlGroup struct{ sess *transport.SrvSess }

// blockGroup is the group a request that may block waits in (blockers), the group's limit
// and whether it counts against the overall bound: an IO's export, so that one which stops
// answering holds only its own share, or the session's control requests, one at a time.
func (s *Server) blockGroup(r *transport.SrvRequest) (group any, limit int, counted bool) {
	if typ, _ := PeekType(r.Usr); typ == MsgTypeIO {
		var m MsgIO
		if idx := s.ioDevs.Load(); idx != nil && m.Unmarshal(r.Usr) == nil {
			if d := (*idx)[ioKey{r.Session(), m.DeviceID}]; d != nil {
				return d.key, maxBlockingPerExport, true
			}
		}
	}
	return ctlGroup{r.Session()}, 1, false
}

// maxLoops is how many devices are open with direct IO at once (ExportIODirect), over all
// sessions. A variable for the tests.
var maxLoops = 512

// ioDone answers a READ or WRITE the device's direct IO has finished.
func (s *Server) ioDone(r *transport.SrvRequest, err error) {
	if err != nil {
		err = backingErr(err)
		s.failed(r, err)
	}
	r.Respond(errno.Neg(err))
}

// failed counts a request that failed. One the peer should not have sent (out of range, a
// write to an ro mapping, an unknown device, flags or sizes the protocol does not allow) is
// logged as a refusal, with the peer, rate-limited per session and cause; the device's own
// errors only at debug level.
func (s *Server) failed(r *transport.SrvRequest, err error) {
	s.Stats.Errors.Inc(r.ID())
	lg := s.log.WithField("session", r.Session().Name())
	switch en := errno.Of(err); en {
	case syscall.EINVAL, syscall.EPERM, syscall.ENODEV, syscall.EBADMSG, syscall.EOPNOTSUPP:
		s.refusals(r).Warn(lg, "request refused: "+en.Error(), r.Path().SrcAddr().IP.String(), err.Error())
	case syscall.EIO:
		// The export's own failure (a file truncated under a mapping, a failing disk):
		// the operator's to know, though the peer did nothing wrong.
		s.exportErrs.Note(lg, "export error", r.Session().Name(), fmt.Sprintf("IO failed with EIO: %v", err))
	default:
		lg.Debugf("%v", err)
	}
}

// refusals is the limiter of r's session's refusals: its own, or for a session the server
// keeps no state for, the one they share.
func (s *Server) refusals(r *transport.SrvRequest) *log.Limiter {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss := s.sessions[r.Session()]; ss != nil { // not made again for a session that went
		return &ss.refusals
	}
	return &s.unknownRefusals
}

// LinkEvent implements transport.Handler: a session whose last path went closes its devices
// (the client re-opens them when it comes back).
func (s *Server) LinkEvent(ts *transport.SrvSess, ev transport.LinkEvent) {
	if ev == transport.LinkDisconnected {
		s.destroySess(ts)
	}
}

func (s *Server) destroySess(ts *transport.SrvSess) {
	s.mu.Lock()
	ss := s.sessions[ts]
	delete(s.sessions, ts)
	var devs []*sessDev
	if ss != nil {
		for _, d := range ss.devs {
			devs = append(devs, d)
		}
		ss.forced = nil // closed already
	}
	s.publishLocked()
	s.mu.Unlock()
	for _, d := range devs {
		s.release(d, d.close())
	}
}

// release stops d's access mode counting once the session's IO has left the device: at once,
// or, for a device that still holds it after dioDrainTimeout, when that IO has ended, so that
// no other session opens it rw and writes beside writes still on their way (the kernel's
// server waits for them without a bound). Its place among the direct IO devices is given back
// once the device is let go.
func (s *Server) release(d *sessDev, c closing) {
	put := func() {
		s.mu.Lock()
		s.putDevLocked(d)
		s.mu.Unlock()
	}
	unloop := func() {
		s.mu.Lock()
		if d.direct {
			d.direct = false
			s.loops--
		}
		s.mu.Unlock()
	}
	select {
	case <-c.io:
		put()
	default:
		s.log.Warnf("%q (device %d): IO still at the device after %v; it stays open for it and counts against rw opens until that IO ends", d.name, d.id, dioDrainTimeout)
		go func() {
			<-c.io
			put()
			s.log.Infof("%q (device %d): its last IO ended, the device is closed", d.name, d.id)
		}()
	}
	select {
	case <-c.gone:
		unloop()
	default:
		if chanClosed(c.io) {
			s.log.Infof("%q (device %d): closed; the read of its first block at open is still at the device, whose descriptors are let go when it ends", d.name, d.id)
		}
		go func() {
			<-c.gone
			unloop()
		}()
	}
}

// process handles one request and returns the errno for the response, or answered when
// the request has been answered already.
func (s *Server) process(r *transport.SrvRequest) (rc int, answered bool) {
	typ, ok := PeekType(r.Usr)
	if !ok {
		err := fmt.Errorf("rnbd: user header of %d bytes: %w", len(r.Usr), syscall.EBADMSG)
		s.failed(r, err)
		return errno.Neg(err), false
	}
	var err error
	switch typ {
	case MsgTypeIO:
		err = s.processIO(r, false)
	case MsgTypeSessInfo:
		err = s.processSessInfo(r)
	case MsgTypeOpen:
		if err = s.processOpen(r); err != nil && err != errResponded {
			// The client sees only the errno: the operator reads why here (rate-limited per
			// session and cause, since the peer chooses how often to ask).
			en := errno.Of(err)
			s.mu.Lock()
			if s.openRefused == nil {
				s.openRefused = map[syscall.Errno]uint64{}
			}
			s.openRefused[en]++
			s.mu.Unlock()
			lg := s.log.WithField("session", r.Session().Name())
			s.refusals(r).Warn(lg, "open refused: "+en.Error(), r.Path().SrcAddr().IP.String(), err.Error())
		}
	case MsgTypeClose:
		err = s.processClose(r)
	default:
		err = fmt.Errorf("rnbd: message type %d: %w", typ, syscall.EINVAL)
	}
	if err == errResponded {
		return 0, true
	}
	switch {
	case err != nil && typ == MsgTypeOpen:
		s.Stats.Errors.Inc(r.ID()) // logged above
	case err != nil:
		s.failed(r, err)
	}
	return errno.Neg(err), false
}

func (s *Server) sess(ts *transport.SrvSess) *srvSess {
	ss := s.sessions[ts]
	if ss == nil {
		ss = &srvSess{name: ts.Name(), devs: map[uint32]*sessDev{}}
		s.sessions[ts] = ss
	}
	return ss
}

func (s *Server) processSessInfo(r *transport.SrvRequest) error {
	var m MsgSessInfo
	if err := m.Unmarshal(r.Usr, MsgTypeSessInfo); err != nil {
		return err
	}
	if r.Dir != transport.Read || len(r.Data) < SessInfoRspSize {
		return fmt.Errorf("rnbd: SESS_INFO needs a %d-byte READ buffer: %w", SessInfoRspSize, syscall.EINVAL)
	}
	s.mu.Lock()
	if r.Path().State() == "connected" {
		// Not made again for a session whose last path went (queued behind a slow CLOSE):
		// its LinkDisconnected has let it go, and nothing would again.
		s.sess(r.Session()).ver = min(m.Ver, ProtoVerMajor)
	}
	s.mu.Unlock()
	// As the kernel's server: the lower of the two versions.
	MsgSessInfo{Ver: min(m.Ver, ProtoVerMajor)}.Put(r.Data, MsgTypeSessInfoRsp)
	return nil
}

func (s *Server) searchRoot(sessName string) string {
	s.mu.Lock()
	sp := s.opts.SearchPath
	s.mu.Unlock()
	return strings.ReplaceAll(sp, SessNamePlaceholder, sessName)
}

// SetSearchPath changes where later OPENs look (a reloaded config); devices open stay open.
// SetACL replaces the export ACL (nil: the default); opens from then on follow it.
func (s *Server) SetACL(a *ACL) {
	s.mu.Lock()
	s.opts.ACL = a
	s.mu.Unlock()
}

func (s *Server) SetSearchPath(p string) error {
	if p == "" {
		return fmt.Errorf("rnbd: empty search path: %w", syscall.EINVAL)
	}
	s.mu.Lock()
	s.opts.SearchPath = p
	s.mu.Unlock()
	s.noteSearchPath(p)
	return nil
}

func (s *Server) processOpen(r *transport.SrvRequest) error {
	var m MsgOpen
	if err := m.Unmarshal(r.Usr); err != nil {
		return err
	}
	if r.Dir != transport.Read || len(r.Data) < OpenRspSize {
		return fmt.Errorf("rnbd: OPEN needs a %d-byte READ buffer: %w", OpenRspSize, syscall.EINVAL)
	}
	if err := names.Text(m.DevName); err != nil {
		return fmt.Errorf("rnbd: device path: %w", err)
	}
	ts := r.Session()
	s.mu.Lock()
	acl := s.opts.ACL
	s.mu.Unlock()
	// The address rules are checked against the path the OPEN came on: a session's paths may
	// come from several addresses of its allowlist entry.
	who := ts.Owner()
	who.Addr = r.Path().SrcAddr().IP
	if !acl.allows(m.DevName, who, m.AccessMode) {
		return fmt.Errorf("rnbd: %q %v not allowed for %v: %w", m.DevName, m.AccessMode, who, syscall.EACCES)
	}
	// A device the session has open already in the same mode is answered again (a client
	// remapping after a reconnect the server did not notice); in another mode it is refused,
	// so an ro open never returns a handle that writes.
	s.mu.Lock()
	var open map[uint32]*sessDev
	if ss := s.sessions[ts]; ss != nil { // looked up, not made: admitLocked below makes it
		open = ss.devs
	}
	for _, d := range open {
		if d.name == m.DevName {
			s.mu.Unlock()
			if d.mode != m.AccessMode {
				return fmt.Errorf("rnbd: %q is open %v in this session, not %v: %w", m.DevName, d.mode, m.AccessMode, syscall.EEXIST)
			}
			return s.openRsp(r.Data, d)
		}
	}
	s.mu.Unlock()
	root, err := os.Open(s.searchRoot(ts.Name()))
	if err != nil {
		return fmt.Errorf("rnbd: search path: %w", err)
	}
	defer root.Close()
	b, err := openBeneath(root, m.DevName, m.AccessMode != AccessRO)
	if err != nil {
		return err
	}
	d := &sessDev{name: m.DevName, mode: m.AccessMode, key: b.key(), b: b}
	dir, link := exportName(b)
	// The access mode is taken before direct IO's probe reads the device: an open refused
	// for it touches nothing, and does not wait behind IO another session has there.
	s.mu.Lock()
	if err := s.admitLocked(r.Path(), d); err != nil {
		s.mu.Unlock()
		b.close()
		return err
	}
	if err := s.getDevLocked(d, dir, link); err != nil {
		s.mu.Unlock()
		b.close()
		return err
	}
	if b.bdev && s.opts.ExportIO == ExportIODirect {
		d.direct = s.loops < maxLoops
		if d.direct {
			s.loops++
		}
	}
	s.mu.Unlock()
	if d.direct {
		if err := b.openDirect(s.ioDone); err != nil {
			s.log.WithField("session", ts.Name()).WithError(err).Warnf("%q: direct IO refused, IO goes through the page cache", m.DevName)
			s.mu.Lock()
			d.direct = false
			s.loops--
			s.mu.Unlock()
		} else if b.dio.late {
			s.log.WithField("session", ts.Name()).Warnf("%q did not answer a read of its first block in %v: opened, its IO waits at the device", m.DevName, dioProbeTimeout)
		}
	} else if b.bdev && s.opts.ExportIO == ExportIODirect {
		s.log.WithField("session", ts.Name()).Warnf("%q: %d devices open with direct IO already, this one goes through the page cache", m.DevName, maxLoops)
	}
	s.mu.Lock()
	// Again: the server may have closed, or another OPEN of the session taken the device,
	// meanwhile.
	if err := s.admitLocked(r.Path(), d); err != nil {
		s.mu.Unlock()
		s.release(d, b.close())
		return err
	}
	ss := s.sess(ts)
	// Ids are never reused while the server runs, but a counter of 32 bits wraps: past a
	// wrap, one the session still holds (open, or force-closed and not yet closed by the
	// client) is skipped.
	for {
		d.id = s.nextID
		s.nextID++
		if ss.devs[d.id] == nil && ss.forced[d.id] == nil {
			break
		}
	}
	ss.devs[d.id] = d
	s.publishLocked()
	s.mu.Unlock()
	s.log.WithField("session", ss.name).Infof("opened %q (%v) as device %d", d.name, d.mode, d.id)
	return s.openRsp(r.Data, d)
}

// getDevLocked applies the access-mode rule: any number of ro, one rw, a second rw only
// as migration.
func (s *Server) getDevLocked(d *sessDev, dir, link string) error {
	sd := s.devs[d.key]
	if sd == nil {
		sd = &srvDev{name: d.name, dir: s.uniqueDirLocked(dir), link: link}
	}
	switch d.mode {
	case AccessRO:
		sd.readers++
	case AccessRW:
		if sd.writers > 0 {
			return fmt.Errorf("rnbd: %q is open rw by another session: %w", d.name, syscall.EPERM)
		}
		sd.writers++
	case AccessMigration:
		if sd.writers > 1 {
			return fmt.Errorf("rnbd: %q is open rw twice already: %w", d.name, syscall.EPERM)
		}
		sd.writers++
	}
	s.devs[d.key] = sd
	return nil
}

func (s *Server) putDevLocked(d *sessDev) {
	sd := s.devs[d.key]
	if sd == nil {
		return
	}
	if d.mode == AccessRO {
		sd.readers--
	} else {
		sd.writers--
	}
	if sd.readers == 0 && sd.writers == 0 {
		delete(s.devs, d.key)
	}
}

func (s *Server) openRsp(buf []byte, d *sessDev) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return syscall.ENODEV
	}
	b := d.b
	maxSect := uint32(s.opts.MaxIOSize / SectorSize)
	rsp := MsgOpenRsp{
		DeviceID: d.id,
		// Read now, as the kernel's server reads its device's: a remap's OPEN answered
		// from a device the session still has open must carry a size grown since.
		NSectors:          uint64(b.sizeNow() / SectorSize),
		MaxHWSectors:      maxSect,
		PhysicalBlockSize: uint16(b.pbs),
		LogicalBlockSize:  uint16(b.lbs),
		MaxSegments:       128,
		// Always a volatile cache with FUA, whatever the device's queue says (the kernel's
		// server reports the device's, writing to it directly): writes may go through the
		// page cache here (buffered export IO, a direct IO refused or past its bound), and
		// only a client that sends flushes and FUA gets them made durable.
		CachePolicy: CacheFUA | CacheWriteback,
	}
	// A client of 6.12 or later sends WRITE_ZEROES only when max_write_zeroes_sectors is not 0,
	// and every kernel's client sends DISCARD only when max_discard_sectors is not 0. Zeroes
	// can always be written (the kernel writes zero pages for a device that cannot do
	// better); a block device discards only as far as its queue says, as the kernel's server
	// announces it.
	if d.mode != AccessRO {
		rsp.MaxDiscardSectors, rsp.MaxWriteZeroesSectors = maxRangeSectors, maxRangeSectors
		rsp.DiscardGranularity = uint32(b.pbs)
		if b.bdev && b.discardMax >= 0 {
			rsp.MaxDiscardSectors = uint32(min(b.discardMax/SectorSize, maxRangeSectors))
			if b.discardGran > 0 {
				rsp.DiscardGranularity = uint32(b.discardGran)
			}
			if b.discardAlign > 0 && b.discardAlign < int64(rsp.DiscardGranularity) {
				rsp.DiscardAlignment = uint32(b.discardAlign)
			}
		}
	}
	rsp.Put(buf)
	return nil
}

// maxRangeSectors is the largest DISCARD and WRITE_ZEROES the server announces and takes.
const maxRangeSectors = 1 << 22

func (s *Server) processClose(r *transport.SrvRequest) error {
	var m MsgClose
	if err := m.Unmarshal(r.Usr); err != nil {
		return err
	}
	s.mu.Lock()
	ss := s.sessions[r.Session()]
	var d *sessDev
	if ss != nil {
		d = ss.devs[m.DeviceID]
	}
	if d == nil {
		if fd := ss.forcedDev(m.DeviceID); fd != nil {
			// The client unmaps a device force_close took away: as the kernel, that is fine.
			delete(ss.forced, m.DeviceID)
			s.publishLocked()
			s.mu.Unlock()
			s.log.WithField("session", ss.name).Infof("client closed %q (device %d), force-closed before", fd.name, fd.id)
			return nil
		}
		s.mu.Unlock()
		// Answered 0, as the kernel answers it: the client's unmap must not fail because
		// the server lost the device with the session (or never had it).
		s.log.WithField("session", r.Session().Name()).Debugf("close of device %d, which the session does not have open", m.DeviceID)
		return nil
	}
	delete(ss.devs, m.DeviceID)
	s.publishLocked()
	s.mu.Unlock()
	s.release(d, d.close()) // only once its IO has ended does its access mode stop counting
	s.log.WithField("session", ss.name).Infof("closed %q (device %d)", d.name, d.id)
	return nil
}

// admitLocked refuses d for the session of the OPEN that came on path p when the server has
// closed, p has (an OPEN that waited while its session went would bring the session back,
// with a device nothing would close), or the session has the same device open under another
// name; s.mu is held. While p is connected the session's devices are not closed: that comes
// after p's close, which waits for this OPEN.
func (s *Server) admitLocked(p *transport.SrvPath, d *sessDev) error {
	if s.closed {
		return syscall.ESHUTDOWN
	}
	if p.State() != "connected" {
		return fmt.Errorf("rnbd: %q: the path of the OPEN is gone: %w", d.name, syscall.ENOTCONN)
	}
	ts := p.Session()
	devs := s.sess(ts).devs // the path is connected: the session is live
	for _, o := range devs {
		if o.key == d.key {
			return fmt.Errorf("rnbd: %q is %q, open in this session already: %w", d.name, o.name, syscall.EEXIST)
		}
	}
	if len(devs) >= maxSessDevices {
		return fmt.Errorf("rnbd: %q: the session has %d devices open, the most one may: %w", d.name, len(devs), syscall.EMFILE)
	}
	return nil
}

// maxSessDevices bounds the devices one session holds open (a descriptor each, and more with
// direct IO): a client could otherwise open every file under the search path in each of its
// sessions. The kernel's server has no bound. A variable for the tests.
var maxSessDevices = 1024

// publishLocked rebuilds the IO index of the devices; s.mu is held.
func (s *Server) publishLocked() {
	idx := map[ioKey]*sessDev{}
	for ts, ss := range s.sessions {
		for id, d := range ss.devs {
			idx[ioKey{ts, id}] = d
		}
		for id, d := range ss.forced {
			idx[ioKey{ts, id}] = d
		}
	}
	s.ioDevs.Store(&idx)
}

// close closes the device for its session once the IO running on it has returned
// (backing.close).
func (d *sessDev) close() closing {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return closed
	}
	d.closed = true
	d.mu.Unlock()
	// Outside the lock: IO to the device, refused from now on, must not wait behind the
	// drain of direct IO (up to dioDrainTimeout) on the transport's goroutine.
	return d.b.close()
}

// chanClosed reports whether c is closed.
func chanClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// closedChan is a channel closed from the start.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// processIO checks an IO against the device and runs it on the backing file. With nowait
// only a READ or a WRITE without FUA is tried, without waiting: errWouldBlock otherwise.
func (s *Server) processIO(r *transport.SrvRequest, nowait bool) error {
	var m MsgIO
	if err := m.Unmarshal(r.Usr); err != nil {
		return err
	}
	var d *sessDev
	if idx := s.ioDevs.Load(); idx != nil {
		d = (*idx)[ioKey{r.Session(), m.DeviceID}]
	}
	if d == nil {
		return fmt.Errorf("rnbd: IO to unknown device %d: %w", m.DeviceID, syscall.ENODEV)
	}
	// On the transport's goroutine the lock is only tried: a CLOSE waiting for it behind a
	// slow IO (an fdatasync, a long zeroing) makes new readers wait too, and the whole
	// connection, heartbeats included, would wait with them.
	if nowait {
		if !d.mu.TryRLock() {
			return errWouldBlock
		}
	} else {
		d.mu.RLock()
	}
	defer d.mu.RUnlock()
	if d.closed {
		if d.forced {
			// As the kernel answers IO to an id it closed with force_close.
			return fmt.Errorf("rnbd: IO to device %d (%q), closed by force_close: %w", m.DeviceID, d.name, syscall.ENOTCONN)
		}
		return syscall.ENODEV
	}
	b := d.b
	op := m.Op()
	// A FLUSH carries no data: the kernel's block layer lets it through to a read-only
	// device, and its client sends one for an fsync of a read-only mapping.
	if op != OpRead && op != OpFlush && d.mode == AccessRO {
		return fmt.Errorf("rnbd: %v on %q mapped ro: %w", op, d.name, syscall.EPERM)
	}
	if op == OpFlush {
		return s.flushIO(r, &m, b, nowait)
	}
	if err := checkData(r, &m, op); err != nil {
		return err
	}
	lbs := uint64(b.lbs)
	off, n := m.Sector*SectorSize, uint64(m.BiSize)
	if m.Sector > maxSectors || off%lbs != 0 || n%lbs != 0 || !b.within(off, n) {
		return fmt.Errorf("rnbd: %v of %d bytes at sector %d on a %d-byte device with %d-byte blocks: %w",
			op, n, m.Sector, b.end.Load(), lbs, syscall.EINVAL)
	}
	fua, preflush := m.RW&FlagFUA != 0, m.RW&FlagPreflush != 0
	// Direct IO never blocks the caller, a FUA write included.
	if nowait && (fua && b.dio == nil || preflush || (op != OpRead && op != OpWrite)) {
		return errWouldBlock
	}
	if preflush {
		// What came before must be durable before this runs (REQ_PREFLUSH).
		s.Stats.Preflushes.Inc(r.ID())
		if err := b.flush(); err != nil {
			return backingErr(err)
		}
	}
	return s.runIO(r, &m, op, b, int64(off), int64(n), nowait)
}

// flushIO serves a FLUSH: no data, and one fdatasync, which is a 7.2 client's PREFLUSH on it
// (0x702) too.
func (s *Server) flushIO(r *transport.SrvRequest, m *MsgIO, b *backing, nowait bool) error {
	if m.BiSize != 0 || len(r.Data) != 0 {
		return fmt.Errorf("rnbd: FLUSH with %d bytes: %w", m.BiSize, syscall.EINVAL)
	}
	if nowait {
		return errWouldBlock
	}
	if m.RW&FlagPreflush != 0 {
		s.Stats.Preflushes.Inc(r.ID())
	}
	s.Stats.Flushes.Inc(r.ID())
	return backingErr(b.flush())
}

// checkData checks where an IO other than FLUSH has its data: READ and WRITE bi_size bytes
// of it, in the RTRS direction the data goes; DISCARD and WRITE_ZEROES none, a range in
// bi_size.
func checkData(r *transport.SrvRequest, m *MsgIO, op Op) error {
	want := transport.Write
	switch op {
	case OpRead:
		want = transport.Read
		if len(r.Data) != int(m.BiSize) {
			return fmt.Errorf("rnbd: READ of %d bytes into %d: %w", m.BiSize, len(r.Data), syscall.EINVAL)
		}
	case OpWrite:
		if len(r.Data) != int(m.BiSize) {
			return fmt.Errorf("rnbd: WRITE of %d bytes with %d: %w", m.BiSize, len(r.Data), syscall.EINVAL)
		}
	case OpSecureErase:
		return fmt.Errorf("rnbd: SECURE_ERASE: %w", syscall.EOPNOTSUPP)
	default: // DISCARD, WRITE_ZEROES: a range in bi_size, no data
		if len(r.Data) != 0 {
			return fmt.Errorf("rnbd: %v with data: %w", op, syscall.EINVAL)
		}
		if m.BiSize > maxRangeSectors*SectorSize {
			return fmt.Errorf("rnbd: %v of %d bytes, above the announced %d sectors: %w", op, m.BiSize, maxRangeSectors, syscall.EINVAL)
		}
	}
	if r.Dir != want {
		return fmt.Errorf("rnbd: %v as an RTRS %v: %w", op, r.Dir, syscall.EINVAL)
	}
	return nil
}

// runIO runs a checked READ, WRITE, DISCARD or WRITE_ZEROES of n bytes at off on b, and
// makes it durable when it asked for FUA.
func (s *Server) runIO(r *transport.SrvRequest, m *MsgIO, op Op, b *backing, off, n int64, nowait bool) error {
	fua := m.RW&FlagFUA != 0
	var err error
	switch op {
	case OpRead:
		if b.src != nil && s.opts.ZeroCopyReadMin > 0 && n >= int64(s.opts.ZeroCopyReadMin) && (s.opts.ZeroCopyLocal || !r.Path().PeerOnHost()) {
			if err = b.respondFile(r, off); err == errResponded {
				s.Stats.Reads.Inc(r.ID())
				s.Stats.ZeroCopyReads.Inc(r.ID())
				return err
			}
			if err != errFallback {
				return backingErr(err)
			}
		}
		if b.dio != nil && b.dio.submit(r, false, false, r.Data, off, nowait) {
			s.Stats.Reads.Inc(r.ID())
			return errResponded
		}
		if err = b.readAt(r.Data, off, nowait); err != errWouldBlock {
			s.Stats.Reads.Inc(r.ID())
		}
	case OpWrite:
		if b.dio != nil && b.dio.submit(r, true, fua, r.Data, off, nowait) {
			s.Stats.Writes.Inc(r.ID())
			if fua {
				s.Stats.FUAWrites.Inc(r.ID())
			}
			return errResponded
		}
		if fua && nowait {
			// Direct IO refused it: RWF_DSYNC would wait for the device's flush even with
			// RWF_NOWAIT, and this is the transport's goroutine.
			return errWouldBlock
		}
		if err = b.writeAt(r.Data, off, fua, nowait); err != errWouldBlock {
			s.Stats.Writes.Inc(r.ID())
			if fua {
				s.Stats.FUAWrites.Inc(r.ID())
			}
		}
	case OpDiscard:
		s.Stats.Discards.Inc(r.ID())
		err = b.discard(off, n)
	case OpWriteZeroes:
		s.Stats.WriteZeroes.Inc(r.ID())
		noUnmap := m.RW&FlagNoUnmap != 0
		if noUnmap {
			s.Stats.NoUnmapZeroes.Inc(r.ID())
		}
		err = b.writeZeroes(off, n, noUnmap)
	}
	if err == nil && fua && op != OpWrite && op != OpRead {
		err = b.flush()
	}
	return backingErr(err)
}

// backingErr keeps an export's own failure from saying what the protocol says with the same
// errno: ENOTCONN answers IO to a device force_close took (the client then gives the device
// up), ENODEV IO to an unknown one. A file system failing with either (a FUSE or network
// file system whose server went) is EIO to the client, as a failing disk's error is.
func backingErr(err error) error {
	if errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ENODEV) {
		return fmt.Errorf("rnbd: export: %v: %w", err, syscall.EIO)
	}
	return err
}
