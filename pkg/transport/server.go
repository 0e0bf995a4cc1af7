package transport

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// ServerOptions configure a server. Use DefaultServerOptions and change what differs.
type ServerOptions struct {
	Provider rdma.Provider
	// Addr is the listen address; "[::]:1234" takes IPv4 and IPv6.
	Addr netip.AddrPort
	// QueueDepth is sess_queue_depth: chunks (and so client permits) per session.
	QueueDepth int
	// ChunkSize is max_chunk_size: a power of two ≥ 8 KiB.
	ChunkSize int
	// AlwaysInvalidate invalidates a chunk before handing it up and re-keys it afterwards.
	AlwaysInvalidate bool
	Handler          Handler
	Timings          Timings
	// Limits bound what clients can make the server hold; zero fields take the defaults.
	Limits ServerLimits
	// Allow, when not empty, are the client networks that may connect (ParseAllow);
	// AllowSubjects, when not empty, the certificate subjects (with an authenticating
	// provider). A client must pass both. A session is bound to the identity that created it
	// (Identity.Key): paths from another are refused.
	Allow         []AllowEntry
	AllowSubjects []string
	// NamesFile keeps which identity owns which session name across restarts ("": memory
	// only). A name owned by another identity is refused with EPERM.
	NamesFile string
}

// ServerLimits bound the resources clients can make a server hold. The kernel trusts its
// fabric and has none of these; a server on a routable network needs them.
type ServerLimits struct {
	// MaxSessions bounds the sessions, established or not (default 256).
	MaxSessions int
	// MaxChunkMemory bounds the chunk memory of all sessions in bytes (queue depth × chunk
	// size each, allocated when a session's first path sends INFO_REQ; default
	// DefaultServerChunkMemory). A session past it is refused.
	MaxChunkMemory int64
	// MaxChunkMemoryPerClient bounds the chunk memory of one client's sessions (a client as
	// MaxSessionsPerClient counts it; default a quarter of MaxChunkMemory, and at least one
	// session's), so that one client cannot take the memory every other client needs.
	MaxChunkMemoryPerClient int64
	// MaxConnsPerPath bounds a path's connections, its cid_num (default 257: the kernel
	// client opens one per CPU and one more).
	MaxConnsPerPath int
	// MaxConnecting bounds the connections of paths not yet established (default 2048), and
	// MaxConnectingPerAddr those from one client address (default 514: two paths of the
	// largest cid_num). Timings.ZombieTimeout bounds how long one may stay so.
	MaxConnecting        int
	MaxConnectingPerAddr int
	// MaxNewSessionsPerAddr bounds the sessions one client address has made that have not
	// sent INFO_REQ yet (default 16), so one host cannot take every session.
	MaxNewSessionsPerAddr int
	// MaxConns bounds the connections of all paths, established or not (default 8192).
	MaxConns int
	// MaxSessionsPerClient bounds the sessions of one client (default 64), so that one
	// tenant cannot take every session: a client is its identity when that names it (a
	// certificate subject, an allowlist entry), else its address.
	MaxSessionsPerClient int
}

// DefaultServerChunkMemory is ServerLimits.MaxChunkMemory's default: the chunks of sixteen
// sessions at the kernel server's defaults (512 of 128 KiB). rtrs-serverd and rtrs-bench set
// half the memory the process may use instead (daemon.DefaultChunkMemory).
const DefaultServerChunkMemory = 16 * DefaultQueueDepth * DefaultChunkSize

// withDefaults fills in the zero fields.
func (l ServerLimits) withDefaults() ServerLimits {
	if l.MaxSessions <= 0 {
		l.MaxSessions = 256
	}
	if l.MaxChunkMemory <= 0 {
		l.MaxChunkMemory = DefaultServerChunkMemory
	}
	if l.MaxConnsPerPath <= 0 {
		l.MaxConnsPerPath = 257
	}
	l.MaxConnsPerPath = min(l.MaxConnsPerPath, MaxConnsPerPath)
	if l.MaxConnecting <= 0 {
		l.MaxConnecting = 2048
	}
	if l.MaxConnectingPerAddr <= 0 {
		l.MaxConnectingPerAddr = 514
	}
	if l.MaxNewSessionsPerAddr <= 0 {
		l.MaxNewSessionsPerAddr = 16
	}
	if l.MaxSessionsPerClient <= 0 {
		l.MaxSessionsPerClient = 64
	}
	if l.MaxConns <= 0 {
		l.MaxConns = 8192
	}
	return l
}

// DefaultServerOptions are the kernel module's defaults.
func DefaultServerOptions() ServerOptions {
	return ServerOptions{
		Addr:             netip.AddrPortFrom(netip.IPv6Unspecified(), DefaultPort),
		QueueDepth:       DefaultQueueDepth,
		ChunkSize:        DefaultChunkSize,
		AlwaysInvalidate: true,
	}
}

// Handler receives a server's requests and session events.
type Handler interface {
	// Request is called for every IO request, on the goroutine that received it: it must not
	// block. The request is answered later, from any goroutine, with SrvRequest.Respond.
	Request(r *SrvRequest)
	// LinkEvent reports a session's first path connecting (Connected) and its last path
	// going (Disconnected).
	LinkEvent(s *SrvSess, ev LinkEvent)
}

// Server is an RTRS server: it accepts client paths and hands their requests to the handler.
type Server struct {
	opts ServerOptions
	ln   rdma.Listener
	log  *log.Entry

	mu       sync.Mutex
	sessions map[sessKey]*SrvSess
	closed   bool
	// Connections of paths not yet established, in all and per client address, and the
	// chunk memory of all sessions (ServerLimits).
	connecting     int
	connectingFrom map[netip.Addr]int
	newSessFrom    map[netip.Addr]int // sessions without INFO_REQ yet, per client address
	conns          int                // connections of all paths
	chunkMemory    int64
	clientMemory   map[string]int64 // chunk memory per client (clientKey), entries above zero

	// letGo is closed, and replaced, whenever a session's last live path goes and with it
	// the session's hold on its name (waitName); under mu.
	letGo chan struct{}

	refusals log.Limiter
	names    *nameStore
	// Rejected connection requests by errno, and refusals (a reject, or a path closed for
	// what its client did) by cause: both sets are fixed in server*.go, so the counts are
	// bounded whatever peers send.
	countsMu sync.Mutex
	rejected map[syscall.Errno]uint64
	refused  map[string]uint64

	// A pending return of freed memory to the system (returnMem), under mu; memWG counts
	// its run so that Close can wait for it.
	memReturn *time.Timer
	memWG     sync.WaitGroup

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// NewServer validates opts and starts listening.
func NewServer(opts ServerOptions) (*Server, error) {
	if opts.Provider == nil || opts.Handler == nil {
		return nil, errors.New("rtrs: server needs a provider and a handler")
	}
	if opts.QueueDepth < 1 || opts.QueueDepth > MaxSessQueueDepth {
		return nil, fmt.Errorf("rtrs: queue depth %d not in 1..%d: %w", opts.QueueDepth, MaxSessQueueDepth, syscall.EINVAL)
	}
	if opts.ChunkSize < MinChunkSize || opts.ChunkSize&(opts.ChunkSize-1) != 0 {
		return nil, fmt.Errorf("rtrs: chunk size %d is not a power of two ≥ %d: %w", opts.ChunkSize, MinChunkSize, syscall.EINVAL)
	}
	if err := CheckImmBits(opts.QueueDepth, opts.ChunkSize); err != nil {
		return nil, fmt.Errorf("%w: %w", err, syscall.EINVAL)
	}
	opts.Timings = opts.Timings.withDefaults()
	opts.Limits = opts.Limits.withDefaults()
	if opts.Limits.MaxChunkMemoryPerClient <= 0 {
		one := int64(opts.QueueDepth) * int64(opts.ChunkSize)
		opts.Limits.MaxChunkMemoryPerClient = min(max(opts.Limits.MaxChunkMemory/4, one), opts.Limits.MaxChunkMemory)
	}
	names, err := loadNames(opts.NamesFile)
	if err != nil {
		return nil, err
	}
	ln, err := opts.Provider.Listen(opts.Addr, 64)
	if err != nil {
		return nil, err
	}
	s := &Server{opts: opts, ln: ln, names: names, sessions: map[sessKey]*SrvSess{}, letGo: make(chan struct{}), connectingFrom: map[netip.Addr]int{}, newSessFrom: map[netip.Addr]int{}, clientMemory: map[string]int64{},
		log: log.L.WithFields(log.Fields{"component": "rtrs-srv", "listen": ln.Addr().String()})}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() netip.AddrPort { return s.ln.Addr() }

// Options returns the server's options (with defaults filled in).
func (s *Server) Options() ServerOptions { return s.opts }

// Close closes every path and stops listening.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	s.closed = true
	var paths []*SrvPath
	for _, ss := range s.sessions {
		paths = append(paths, ss.pathList()...)
	}
	s.mu.Unlock()
	s.cancel()
	err := s.ln.Close()
	// All at once: each close waits for its peer's disconnect and its requests, and one
	// after another that added up to half a minute with a few hundred connections.
	for _, p := range paths {
		go p.Close()
	}
	for _, p := range paths {
		<-p.closed
	}
	s.wg.Wait()
	s.mu.Lock()
	if s.memReturn != nil && s.memReturn.Stop() {
		s.memWG.Done()
	}
	s.memReturn = nil
	s.mu.Unlock()
	s.memWG.Wait()
	return err
}

// Sessions lists the sessions that have a name (a path finished its INFO_REQ), by name.
func (s *Server) Sessions() []*SrvSess {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*SrvSess
	for _, ss := range s.sessions {
		if ss.Name() != "" {
			out = append(out, ss)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		req, err := s.ln.Accept(s.ctx)
		if err != nil {
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.connect(req)
		}()
	}
}

// reject answers a connection request with errno in conn_rsp.
func (s *Server) reject(req *rdma.ConnRequest, errno syscall.Errno) {
	s.countsMu.Lock()
	if s.rejected == nil {
		s.rejected = map[syscall.Errno]uint64{}
	}
	s.rejected[errno]++
	s.countsMu.Unlock()
	rsp := MsgConnRsp{Errno: -int16(errno)}
	_ = req.ID.Reject(rsp.Marshal())
	_ = req.ID.Destroy()
}

// connect handles one connection request (rtrs_rdma_connect).
func (s *Server) connect(req *rdma.ConnRequest) {
	peer := req.ID.RemoteAddr()
	var m MsgConnReq
	if err := m.Unmarshal(req.PrivateData); err != nil {
		s.refuse(peer, "malformed connection request", err.Error())
		s.reject(req, syscall.ECONNRESET)
		return
	}
	if m.CidNum == 0 || int(m.CidNum) > s.opts.Limits.MaxConnsPerPath || m.Cid >= m.CidNum {
		s.refuse(peer, "connections per path", fmt.Sprintf("connection %d of %d (at most %d per path)", m.Cid, m.CidNum, s.opts.Limits.MaxConnsPerPath))
		s.reject(req, syscall.ECONNRESET)
		return
	}
	ident, ok := s.identify(req.ID)
	if !ok {
		s.refuse(peer, "not allowed", fmt.Sprintf("%v is not in the allowlist", ident))
		s.reject(req, syscall.EPERM)
		return
	}
	p, errno := s.findPath(&m, req.ID, ident)
	if errno != 0 {
		s.reject(req, errno)
		return
	}
	if err := p.addCon(req, int(m.Cid)); err != nil {
		p.refuse("connection failed", fmt.Sprintf("connection %d: %v", m.Cid, err))
		p.Close()
		return
	}
}

// findPath finds or creates the session and path a request belongs to, applying the kernel's
// reject rules; it reserves the request's connection slot.
func (s *Server) findPath(m *MsgConnReq, id rdma.ConnID, ident Identity) (*SrvPath, syscall.Errno) {
	s.mu.Lock()
	defer s.mu.Unlock()
	peer := id.RemoteAddr()
	from := rdma.AddrGroup(peer.Addr())
	if errno := s.roomLocked(peer, from); errno != 0 {
		return nil, errno
	}
	ss, errno := s.sessionLocked(m, peer, from, ident)
	if errno != 0 {
		return nil, errno
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if p := ss.paths[m.SessUUID]; p != nil {
		if errno := s.reserveConLocked(p, m, peer); errno != 0 {
			return nil, errno
		}
		return p, 0
	}
	src, dst := addrOf(id.RemoteAddr()), addrOf(id.LocalAddr())
	if errno := s.pathRoomLocked(ss, src, dst, peer); errno != 0 {
		return nil, errno
	}
	return s.newPathLocked(ss, m, id, src, dst, from), 0
}

// roomLocked refuses a connection request from peer (of address group from) when the server
// is closing or at one of its bounds on connections; s.mu is held.
func (s *Server) roomLocked(peer netip.AddrPort, from netip.Addr) syscall.Errno {
	if s.closed {
		s.refuse(peer, "server closing", "the server is shutting down")
		return syscall.ECONNRESET
	}
	lim := s.opts.Limits
	if s.conns >= lim.MaxConns {
		s.refuse(peer, "connections", fmt.Sprintf("%d connections (the server's bound)", lim.MaxConns))
		return syscall.ECONNRESET
	}
	if s.connecting >= lim.MaxConnecting {
		s.refuse(peer, "unfinished connections", fmt.Sprintf("%d connections of paths not yet established (the server's bound)", lim.MaxConnecting))
		return syscall.ECONNRESET
	}
	if s.connectingFrom[from] >= lim.MaxConnectingPerAddr {
		s.refuse(peer, "unfinished connections per address", fmt.Sprintf("%d connections of paths not yet established from this address (the bound per address)", lim.MaxConnectingPerAddr))
		return syscall.ECONNRESET
	}
	return 0
}

// sessionLocked finds the session the request names, or creates it for the request's first
// connection of a new session, within the bounds on sessions; a session of another identity
// is refused. s.mu is held.
func (s *Server) sessionLocked(m *MsgConnReq, peer netip.AddrPort, from netip.Addr, ident Identity) (*SrvSess, syscall.Errno) {
	lim := s.opts.Limits
	key := sessKey{ident.Key(), m.PathsUUID}
	ss := s.sessions[key]
	if ss == nil {
		if !m.FirstConn {
			for k, o := range s.sessions {
				if k.uuid == m.PathsUUID {
					s.refuse(peer, "session of another identity", fmt.Sprintf("%v asked to join a session of %v", ident, o.owner))
					return nil, syscall.EPERM
				}
			}
			s.refuse(peer, "unknown session", fmt.Sprintf("a path of session %v, which the server does not hold (it restarted, or closed the session)", m.PathsUUID))
			return nil, syscall.ENXIO
		}
		if len(s.sessions) >= lim.MaxSessions {
			s.refuse(peer, "sessions", fmt.Sprintf("%d sessions (the server's bound)", lim.MaxSessions))
			return nil, syscall.ECONNRESET
		}
		if s.newSessFrom[from] >= lim.MaxNewSessionsPerAddr {
			s.refuse(peer, "new sessions per address", fmt.Sprintf("%d sessions from this address have not sent INFO_REQ (the bound per address)", lim.MaxNewSessionsPerAddr))
			return nil, syscall.ECONNRESET
		}
		// Sessions winding down (no path left that is not closing) do not count: a client
		// host that restarts opens new sessions while its old ones go.
		client := clientKey(ident, from)
		n := 0
		for _, o := range s.sessions {
			if o.client == client && o.holdsName() {
				n++
			}
		}
		if n >= lim.MaxSessionsPerClient {
			s.refuse(peer, "sessions per client", fmt.Sprintf("%v holds %d sessions (the bound per client)", ident, n))
			return nil, syscall.ECONNRESET
		}
		ss = &SrvSess{srv: s, uuid: m.PathsUUID, paths: map[uuid.UUID]*SrvPath{}, owner: ident, client: client, newFrom: from, isNew: true}
		s.newSessFrom[from]++
		s.sessions[key] = ss
	}
	return ss, 0
}

// sessKey is what a session is found by: its client's identity and its paths_uuid. The
// paths_uuid is in every connection request a session makes, so knowing it is no proof of
// being its client: another identity that sends it joins nothing, and one that sends it
// first (after a restart) holds no session the real client then needs.
type sessKey struct {
	owner string
	uuid  uuid.UUID
}

// reserveConLocked reserves the request's connection slot in p, a path still connecting
// whose connection count the request agrees with; a request out of place is refused, and
// closes p if p is a zombie. s.mu and p's session's mu are held.
func (s *Server) reserveConLocked(p *SrvPath, m *MsgConnReq, peer netip.AddrPort) syscall.Errno {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state != srvConnecting || len(p.cons) != int(m.CidNum) || p.cons[m.Cid] != nil {
		if p.zombieLocked(s.opts.Timings.ZombieTimeout) {
			go p.Close()
		}
		s.refuse(peer, "connection out of place", fmt.Sprintf("connection %d of %d of path %s, which is past connecting or has %d connections, or that one", m.Cid, m.CidNum, p.name, len(p.cons)))
		return syscall.ECONNRESET
	}
	p.cons[m.Cid] = &con{cid: int(m.Cid)} // reserved
	// Each connection that starts restarts the path's zombie clock (kernel 7.2), within the
	// cap from its first.
	p.connStart = time.Now()
	p.zombie.Reset(p.zombieWaitLocked(s.opts.Timings.ZombieTimeout))
	s.pendLocked(p, 1)
	p.nCons++
	s.conns++
	return 0
}

// pathRoomLocked refuses a new path from src to dst in ss when ss has its most paths or
// already has one between the same addresses (a zombie of those is closed). s.mu and ss.mu
// are held.
func (s *Server) pathRoomLocked(ss *SrvSess, src, dst Addr, peer netip.AddrPort) syscall.Errno {
	if len(ss.paths) >= MaxPathsNum {
		s.refuse(peer, "paths per session", fmt.Sprintf("the session has %d paths (at most %d)", len(ss.paths), MaxPathsNum))
		return syscall.ECONNRESET
	}
	for _, o := range ss.paths {
		if o.src.IP == src.IP && o.dst.IP == dst.IP {
			o.mu.Lock()
			st := o.state
			zombie := o.zombieLocked(s.opts.Timings.ZombieTimeout)
			o.mu.Unlock()
			if st >= srvClosing {
				// Its client removed it and adds it again (`rnbd client path readd`): the
				// old one is only winding down.
				continue
			}
			if zombie {
				go o.Close()
			}
			s.refuse(peer, "path exists", fmt.Sprintf("the session already has path %s", o.name))
			return syscall.EEXIST
		}
	}
	return 0
}

// newPathLocked creates the path of the request's connection in ss, with that connection's
// slot reserved and its zombie clock started. s.mu and ss.mu are held.
func (s *Server) newPathLocked(ss *SrvSess, m *MsgConnReq, id rdma.ConnID, src, dst Addr, from netip.Addr) *SrvPath {
	now := time.Now()
	p := &SrvPath{sess: ss, uuid: m.SessUUID, src: src, dst: dst, peer: from, onHost: onHost(src, dst), created: now, connStart: now, nCons: 1,
		cons: make([]*con, m.CidNum), closed: make(chan struct{}), hcaName: id.Device().Name(), hcaPort: id.Port()}
	p.name = PathName(src, dst)
	p.logp.Store(s.log.WithField("path", p.name))
	p.cons[m.Cid] = &con{cid: int(m.Cid)}
	p.opsIdle = sync.NewCond(&p.mu)
	// A path that has not finished connecting (INFO_REQ) when the timer fires is a zombie.
	p.zombie = time.AfterFunc(s.opts.Timings.ZombieTimeout, func() {
		p.mu.Lock()
		stuck := p.zombieLocked(s.opts.Timings.ZombieTimeout)
		p.mu.Unlock()
		if stuck {
			p.refuse("path not established in time", "path did not finish connecting, closing it")
			p.Close()
		}
	})
	ss.paths[m.SessUUID] = p
	ss.live++
	s.pendLocked(p, 1)
	s.conns++
	return p
}

// nameFree says whether no other live session holds name (the kernel's rule).
func (s *Server) nameFree(ss *SrvSess, name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nameFreeLocked(ss, name)
}

func (s *Server) nameFreeLocked(ss *SrvSess, name string) bool {
	return s.nameHolderLocked(ss, name) == nil
}

// nameHolder is the other live session that holds name, nil if none.
func (s *Server) nameHolder(ss *SrvSess, name string) *SrvSess {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nameHolderLocked(ss, name)
}

func (s *Server) nameHolderLocked(ss *SrvSess, name string) *SrvSess {
	for _, o := range s.sessions {
		if o != ss && o.Name() == name && o.holdsName() {
			return o
		}
	}
	return nil
}

// liveNames are the names live sessions hold.
func (s *Server) liveNames() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]bool{}
	for _, o := range s.sessions {
		if o.holdsName() {
			out[o.Name()] = true
		}
	}
	return out
}

// nameLetGo wakes the paths waiting for a session name (waitName).
func (s *Server) nameLetGo() {
	s.mu.Lock()
	close(s.letGo)
	s.letGo = make(chan struct{})
	s.mu.Unlock()
}

// waitName waits until no other live session holds name, for up to d, while ss has a live
// path and the server runs, and reports whether the name is free. (The last path of ss
// going wakes it too: that lets ss's hold go.)
func (s *Server) waitName(ss *SrvSess, name string, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		s.mu.Lock()
		free, letGo := s.nameFreeLocked(ss, name), s.letGo
		s.mu.Unlock()
		if free {
			return true
		}
		if !ss.holdsName() {
			return false
		}
		select {
		case <-letGo:
		case <-t.C:
			return false
		case <-s.ctx.Done():
			return false
		}
	}
}

// sessNamedLocked stops counting ss as a new session of its address; s.mu is held.
func (s *Server) sessNamedLocked(ss *SrvSess) {
	if ss.isNew {
		ss.isNew = false
		if s.newSessFrom[ss.newFrom]--; s.newSessFrom[ss.newFrom] <= 0 {
			delete(s.newSessFrom, ss.newFrom)
		}
	}
}

// pendLocked counts n more (or, negative, fewer) unfinished connections of path p, in all and
// for its client's address; s.mu is held.
func (s *Server) pendLocked(p *SrvPath, n int) {
	p.pending += n
	s.connecting += n
	a := p.peer
	if s.connectingFrom[a] += n; s.connectingFrom[a] <= 0 {
		delete(s.connectingFrom, a)
	}
}

// established stops counting p's connections as unfinished (INFO_REQ came, or p closes).
func (s *Server) established(p *SrvPath) {
	s.mu.Lock()
	s.pendLocked(p, -p.pending)
	s.mu.Unlock()
}

// refuse logs a refusal of peer for cause, once per cause and interval.
func (s *Server) refuse(peer netip.AddrPort, cause, detail string) {
	s.countRefusal(cause)
	s.refusals.Warn(s.log, cause, peer.String(), detail)
}

func (s *Server) countRefusal(cause string) {
	s.countsMu.Lock()
	if s.refused == nil {
		s.refused = map[string]uint64{}
	}
	s.refused[cause]++
	s.countsMu.Unlock()
}

// Rejected counts the connection requests answered with a reject since the server started,
// by the errno the reject carried.
func (s *Server) Rejected() map[syscall.Errno]uint64 {
	s.countsMu.Lock()
	defer s.countsMu.Unlock()
	return maps.Clone(s.rejected)
}

// Refused counts refusals since the server started by their cause, the words the log's
// warning starts with ("not allowed", "sessions", "malformed request", …): connection
// requests rejected and paths closed for what their client did.
func (s *Server) Refused() map[string]uint64 {
	s.countsMu.Lock()
	defer s.countsMu.Unlock()
	return maps.Clone(s.refused)
}
