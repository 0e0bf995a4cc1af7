package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/stats"
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
	// size each, allocated when a session's first path sends INFO_REQ; default half the
	// machine's memory). A session past it is refused.
	MaxChunkMemory int64
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
}

// withDefaults fills in the zero fields.
func (l ServerLimits) withDefaults() ServerLimits {
	if l.MaxSessions <= 0 {
		l.MaxSessions = 256
	}
	if l.MaxChunkMemory <= 0 {
		l.MaxChunkMemory = physMemory() / 2
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
	if l.MaxConns <= 0 {
		l.MaxConns = 8192
	}
	return l
}

// physMemory is the memory the process may use in bytes: the machine's, or its cgroup's
// memory.max where that is lower (a unit with MemoryMax=, a container); 1 GiB if neither can
// be read.
func physMemory() int64 {
	var si unix.Sysinfo_t
	total := int64(1 << 30)
	if err := unix.Sysinfo(&si); err == nil && si.Totalram != 0 {
		total = int64(si.Totalram) * int64(si.Unit)
	}
	if lim, ok := cgroupMemoryMax(); ok && lim < total {
		total = lim
	}
	return total
}

// cgroupMemoryMax reads the memory limit of the process's cgroup: memory.max (v2) or
// memory.limit_in_bytes (v1).
func cgroupMemoryMax() (int64, bool) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		var file string
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			file = filepath.Join("/sys/fs/cgroup", rest, "memory.max")
		} else if _, rest, ok := strings.Cut(line, ":memory:"); ok {
			file = filepath.Join("/sys/fs/cgroup/memory", rest, "memory.limit_in_bytes")
		} else {
			continue
		}
		v, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		// "max" (v2) does not parse, and v1's "no limit" is a huge number: no limit either way.
		if n, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64); err == nil && n > 0 {
			return n, true
		}
	}
	return 0, false
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
	sessions map[uuid.UUID]*SrvSess
	closed   bool
	// Connections of paths not yet established, in all and per client address, and the
	// chunk memory of all sessions (ServerLimits).
	connecting     int
	connectingFrom map[netip.Addr]int
	newSessFrom    map[netip.Addr]int // sessions without INFO_REQ yet, per client address
	conns          int                // connections of all paths
	chunkMemory    int64

	refusals log.Limiter
	names    *nameStore
	// Rejected connection requests by errno, and refusals (a reject, or a path closed for
	// what its client did) by cause: both sets are fixed in this file, so the counts are
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

// memReturnDelay gathers the sessions that go together (clients that exited at once) into
// one return of memory to the system.
const memReturnDelay = time.Second

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
	names, err := loadNames(opts.NamesFile)
	if err != nil {
		return nil, err
	}
	ln, err := opts.Provider.Listen(opts.Addr, 64)
	if err != nil {
		return nil, err
	}
	s := &Server{opts: opts, ln: ln, names: names, sessions: map[uuid.UUID]*SrvSess{}, connectingFrom: map[netip.Addr]int{}, newSessFrom: map[netip.Addr]int{},
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
	if s.closed {
		s.refuse(peer, "server closing", "the server is shutting down")
		return nil, syscall.ECONNRESET
	}
	from := rdma.AddrGroup(peer.Addr())
	lim := s.opts.Limits
	if s.conns >= lim.MaxConns {
		s.refuse(peer, "connections", fmt.Sprintf("%d connections (the server's bound)", lim.MaxConns))
		return nil, syscall.ECONNRESET
	}
	if s.connecting >= lim.MaxConnecting {
		s.refuse(peer, "unfinished connections", fmt.Sprintf("%d connections of paths not yet established (the server's bound)", lim.MaxConnecting))
		return nil, syscall.ECONNRESET
	}
	if s.connectingFrom[from] >= lim.MaxConnectingPerAddr {
		s.refuse(peer, "unfinished connections per address", fmt.Sprintf("%d connections of paths not yet established from this address (the bound per address)", lim.MaxConnectingPerAddr))
		return nil, syscall.ECONNRESET
	}
	ss := s.sessions[m.PathsUUID]
	if ss == nil {
		if !m.FirstConn {
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
		ss = &SrvSess{srv: s, uuid: m.PathsUUID, paths: map[uuid.UUID]*SrvPath{}, owner: ident, newFrom: from, isNew: true}
		s.newSessFrom[from]++
		s.sessions[m.PathsUUID] = ss
	} else if ss.owner.Key() != ident.Key() {
		// The session's paths_uuid is in every connection request it makes: knowing it is
		// no proof of being its client.
		s.refuse(peer, "session of another identity", fmt.Sprintf("%v asked to join a session of %v", ident, ss.owner))
		return nil, syscall.EPERM
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if p := ss.paths[m.SessUUID]; p != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.state != srvConnecting || len(p.cons) != int(m.CidNum) || p.cons[m.Cid] != nil {
			if p.zombieLocked(s.opts.Timings.ZombieTimeout) {
				go p.Close()
			}
			s.refuse(peer, "connection out of place", fmt.Sprintf("connection %d of %d of path %s, which is past connecting or has %d connections, or that one", m.Cid, m.CidNum, p.name, len(p.cons)))
			return nil, syscall.ECONNRESET
		}
		p.cons[m.Cid] = &con{cid: int(m.Cid)} // reserved
		// Each connection that starts restarts the path's zombie clock (kernel 7.2).
		p.connStart = time.Now()
		p.zombie.Reset(s.opts.Timings.ZombieTimeout)
		s.pendLocked(p, 1)
		p.nCons++
		s.conns++
		return p, 0
	}
	if len(ss.paths) >= MaxPathsNum {
		s.refuse(peer, "paths per session", fmt.Sprintf("the session has %d paths (at most %d)", len(ss.paths), MaxPathsNum))
		return nil, syscall.ECONNRESET
	}
	src, dst := addrOf(id.RemoteAddr()), addrOf(id.LocalAddr())
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
			return nil, syscall.EEXIST
		}
	}
	now := time.Now()
	p := &SrvPath{sess: ss, uuid: m.SessUUID, src: src, dst: dst, peer: from, created: now, connStart: now, nCons: 1,
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
	return p, 0
}

// nameFree says whether no other live session holds name (the kernel's rule).
func (s *Server) nameFree(ss *SrvSess, name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nameFreeLocked(ss, name)
}

func (s *Server) nameFreeLocked(ss *SrvSess, name string) bool {
	for _, o := range s.sessions {
		if o != ss && o.Name() == name && o.holdsName() {
			return false
		}
	}
	return true
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

// refuse logs that the path's client was refused for cause, once per cause and interval.
func (p *SrvPath) refuse(cause, detail string) {
	p.sess.srv.countRefusal(cause)
	p.sess.srv.refusals.Warn(p.lg(), cause, p.src.IP.String(), detail)
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

// CurLatency is the path's last heartbeat round trip (0 before the first was answered).
func (p *SrvPath) CurLatency() time.Duration { return time.Duration(p.hb.latency.Load()) }

// SrvSess is a server session: the chunks its paths share, keyed by the client's session uuid.
type SrvSess struct {
	srv   *Server
	uuid  uuid.UUID
	owner Identity
	// Counted in Server.newSessFrom[newFrom] until its first INFO_REQ (Server.mu).
	newFrom netip.Addr
	isNew   bool

	mu          sync.Mutex
	mem         []byte // the chunks, from the first INFO_REQ on
	memCleanup  runtime.Cleanup
	stuck       bool // a path closed with requests still handed up: the chunks may be in use
	gone        bool // the last path closed: no chunks are allocated any more
	name        string
	paths       map[uuid.UUID]*SrvPath
	established int
	live        int // paths not closing: a session without any does not hold its name
}

// Owner is the identity of the client that created the session.
func (ss *SrvSess) Owner() Identity { return ss.owner }

// Name is the client's session name (empty until a path has sent INFO_REQ).
func (ss *SrvSess) Name() string {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.name
}

// Paths lists the session's connected paths by name.
func (ss *SrvSess) Paths() []*SrvPath {
	var out []*SrvPath
	for _, p := range ss.pathList() {
		if p.State() == "connected" {
			out = append(out, p)
		}
	}
	return out
}

// ListedPaths lists the paths that have connected and are not yet gone, closing ones
// included: the kernel creates a path's sysfs directory at INFO_REQ and removes it when
// the close has finished.
func (ss *SrvSess) ListedPaths() []*SrvPath {
	var out []*SrvPath
	for _, p := range ss.pathList() {
		p.mu.Lock()
		listed := p.listed
		p.mu.Unlock()
		if listed {
			out = append(out, p)
		}
	}
	return out
}

// holdsName says whether the session still claims its name: a client that closed its session
// and opens a new one of the same name must not be refused while the old one winds down.
func (ss *SrvSess) holdsName() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.live > 0
}

func (ss *SrvSess) pathList() []*SrvPath {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	out := make([]*SrvPath, 0, len(ss.paths))
	for _, p := range ss.paths {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out
}

// chunk returns chunk id's memory; the path's chunks are registered (regChunks).
func (p *SrvPath) chunk(id int) []byte {
	cs := p.sess.srv.opts.ChunkSize
	return p.mem[id*cs : (id+1)*cs : (id+1)*cs]
}

// chunkMem returns the session's chunks, allocating them the first time within the server's
// MaxChunkMemory.
func (ss *SrvSess) chunkMem() ([]byte, error) {
	ss.mu.Lock()
	mem, gone := ss.mem, ss.gone
	ss.mu.Unlock()
	if mem != nil {
		return mem, nil
	}
	if gone {
		return nil, fmt.Errorf("rtrs: session closed: %w", syscall.ECONNRESET)
	}
	// The server's lock is never taken under a session's (the other order is everywhere):
	// the charge first, then the session, and the loser of a race gives its copy back.
	srv := ss.srv
	n := int64(srv.opts.QueueDepth) * int64(srv.opts.ChunkSize)
	srv.mu.Lock()
	if srv.chunkMemory+n > srv.opts.Limits.MaxChunkMemory {
		used := srv.chunkMemory
		srv.mu.Unlock()
		return nil, fmt.Errorf("rtrs: chunk memory of %d bytes for the session: %d of %d in use: %w", n, used, srv.opts.Limits.MaxChunkMemory, syscall.ENOMEM)
	}
	srv.chunkMemory += n
	srv.mu.Unlock()
	mem, err := rdma.Alloc(int(n))
	if err != nil {
		srv.unchargeMem(n)
		return nil, fmt.Errorf("rtrs: chunk memory for the session: %w", err)
	}
	ss.mu.Lock()
	if ss.mem != nil || ss.gone {
		have, gone := ss.mem, ss.gone
		ss.mu.Unlock()
		_ = rdma.Free(mem)
		srv.unchargeMem(n)
		if gone {
			return nil, fmt.Errorf("rtrs: session closed: %w", syscall.ECONNRESET)
		}
		return have, nil
	}
	ss.mem = mem
	// Normally freed when the last path has closed (freeMem); if a handler still held a
	// request then, only once nothing can reach the session any more.
	ss.memCleanup = runtime.AddCleanup(ss, func(mem []byte) {
		_ = rdma.Free(mem)
		srv.unchargeMem(int64(len(mem)))
	}, mem)
	ss.mu.Unlock()
	return mem, nil
}

// freeMem returns the chunks to the system when the session has gone and no handler holds a
// request of it; called once, after the last path closed.
func (ss *SrvSess) freeMem() {
	ss.mu.Lock()
	mem, stuck := ss.mem, ss.stuck
	if mem != nil && !stuck {
		ss.memCleanup.Stop()
		ss.mem = nil
	}
	ss.mu.Unlock()
	if mem == nil || stuck {
		return
	}
	_ = rdma.Free(mem)
	ss.srv.unchargeMem(int64(len(mem)))
	ss.srv.returnMem()
}

// returnMem hands the Go heap that sessions leave behind back to the system, memReturnDelay
// after a session has gone (one run for all that go meanwhile). Their chunks are unmapped
// already; what is left are their connections' buffers, goroutine stacks and request state.
// The collector would keep that resident: a server that goes idle allocates nothing, so no
// collection comes for two minutes, and the scavenger keeps what lies under the last heap
// goal, twice the live heap of the busy server.
func (s *Server) returnMem() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.memReturn != nil || s.closed {
		return
	}
	s.memWG.Add(1)
	s.memReturn = time.AfterFunc(memReturnDelay, func() {
		defer s.memWG.Done()
		s.mu.Lock()
		s.memReturn = nil
		s.mu.Unlock()
		debug.FreeOSMemory()
	})
}

// unchargeMem takes n bytes of chunk memory off the server's account.
func (s *Server) unchargeMem(n int64) {
	s.mu.Lock()
	s.chunkMemory -= n
	s.mu.Unlock()
}

// ChunkMemory is the chunk memory the server's sessions hold, in bytes.
func (s *Server) ChunkMemory() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chunkMemory
}

type srvPathState int

const (
	srvConnecting srvPathState = iota
	srvConnected
	srvClosing
	srvClosed
)

// SrvPath is one client path of a server session.
type SrvPath struct {
	sess    *SrvSess
	uuid    uuid.UUID
	src     Addr       // client
	dst     Addr       // server
	peer    netip.Addr // the client address as the per-address bounds count it (rdma.AddrGroup)
	created time.Time
	// connStart is when the path's latest connection request came (p.mu): a path still
	// connecting longer than Timings.ZombieTimeout after it is a zombie.
	connStart time.Time
	pending   int // connections reserved while the path is being established; Server.mu
	nCons     int // connections reserved, established or not; Server.mu
	hcaName   string
	hcaPort   int
	name      string
	logp      atomic.Pointer[log.Entry]

	mu      sync.Mutex
	state   srvPathState
	listed  bool // connected once: shown until the close has finished
	cons    []*con
	opsIdle *sync.Cond // signalled, under mu, when the last request of a closing path is answered
	// live mirrors state == srvConnected for the IO path, which counts its requests in
	// Stats.Inflight and checks live without taking mu: a lock per request shared by every
	// connection of the path was a cache line passed between CPUs twice per IO.
	live atomic.Bool

	pd        rdma.PD
	syncLocal bool                    // the device's LOCAL_INV takes effect when posted
	mem       []byte                  // the session's chunks, set with chunkMR at INFO_REQ
	chunkMR   []rdma.MR               // one per chunk with always_invalidate, else one for all
	localMR   rdma.MR                 // all chunks, local access: the source of READ data
	ctlMR     rdma.MR                 // info request/response and rkey response buffers
	fileMRs   map[*FileSource]rdma.MR // file regions registered for RespondFile
	reqs      []srvReq                // per chunk
	hb        heartbeat
	zombie    *time.Timer
	closing   sync.Once
	closed    chan struct{}

	// Stats are the path's counters (its stats/ directory).
	Stats stats.ServerPath
}

func (p *SrvPath) lg() *log.Entry { return p.logp.Load() }

// Name is "<client addr>@<server addr>".
func (p *SrvPath) Name() string { return p.name }

// SrcAddr is the client's address, DstAddr the server's.
func (p *SrvPath) SrcAddr() Addr { return p.src }

// DstAddr is the server's (local) address.
func (p *SrvPath) DstAddr() Addr { return p.dst }

// HCA returns the device name and port of connection 0.
func (p *SrvPath) HCA() (string, int) { return p.hcaName, p.hcaPort }

// Session is the path's session.
func (p *SrvPath) Session() *SrvSess { return p.sess }

// State is "connected" or "disconnected", as sysfs would say it.
func (p *SrvPath) State() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state == srvConnected {
		return "connected"
	}
	return "disconnected"
}

// Inflight is the number of requests handed up and not yet answered.
func (p *SrvPath) Inflight() int { return int(p.Stats.Inflight.Load()) }

// opDone ends a request handed up. The count is taken before live is read (dispatch) and
// Close clears live before it reads the count, so one of the two sees the other: a request
// is never handed up after Close found none outstanding, and the last one of a closing
// path always wakes Close.
func (p *SrvPath) opDone() {
	if p.Stats.Inflight.Add(-1) == 0 && !p.live.Load() {
		p.mu.Lock()
		p.opsIdle.Broadcast()
		p.mu.Unlock()
	}
}

// ctl buffer layout: [info request 272][info response][rkey responses qd*8].
func (p *SrvPath) ctlInfoRsp() int { return infoReqSize }
func (p *SrvPath) ctlRkey(id int) int {
	return infoReqSize + InfoRspSize(p.nChunkMR()) + rkeyRspSize*id
}

// nChunkMR is how many regions the chunks are registered as: one per chunk with
// always_invalidate, else one for all.
func (p *SrvPath) nChunkMR() int {
	if o := p.sess.srv.opts; o.AlwaysInvalidate {
		return o.QueueDepth
	}
	return 1
}

// addCon creates the QP of connection cid and accepts it.
func (p *SrvPath) addCon(req *rdma.ConnRequest, cid int) error {
	srv := p.sess.srv
	o := srv.opts
	if err := p.setupPath(req.ID.Device()); err != nil {
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	c := &con{cid: cid, id: req.ID, sigInterval: min(o.QueueDepth, ServiceConQD)}
	c.recvWR[0].ID = wrRecv
	// Five per request in both modes, as the kernel sizes it: a response is up to four work
	// requests (data, SEND_WITH_INV, REG_MR, the response) plus the LOCAL_INV taking the
	// chunk back, and only every signal interval's response is signaled, so up to that many
	// responses' work requests wait for one completion. (Three per request filled the queue
	// under the kernel's client at QD32 with always_invalidate off.)
	sendWR, recvWR := 5*o.QueueDepth+1, o.QueueDepth+1
	if cid == 0 {
		// Connection 0 also carries the chunks' registrations in front of INFO_RSP.
		sendWR, recvWR = max(sendWR, 1026, o.QueueDepth+ServiceConQD+2), max(recvWR, 1026)
	}
	sendWR, recvWR = min(sendWR, 16384), min(recvWR, 16384)
	var err error
	if c.cq, err = req.ID.Device().CreateCQ(sendWR + recvWR); err != nil {
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	if c.qp, err = req.ID.CreateQP(p.pd, rdma.QPInitAttr{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: sendWR, MaxRecvWR: recvWR, MaxSendSGE: 1, MaxRecvSGE: 1}); err != nil {
		c.destroy()
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	// Connection 0 waits for INFO_REQ; IO connections for requests.
	if cid == 0 {
		_, err = c.qp.PostRecv([]rdma.RecvWR{{ID: wrInfo, SGList: []rdma.SGE{rdma.SGEOf(p.ctlMR, 0, infoReqSize)}}})
	} else {
		err = postEmptyRecvs(c.qp, o.QueueDepth)
	}
	if err != nil {
		c.destroy()
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	var wc [16]rdma.WC
	c.cq.SetHandler(func() { p.onCompletions(c, wc[:]) })
	rsp := MsgConnRsp{QueueDepth: uint16(o.QueueDepth), MaxIOSize: uint32(o.ChunkSize - MaxHdrSize), MaxHdrSize: MaxHdrSize}
	if o.AlwaysInvalidate {
		rsp.Flags = MsgNewRkeyF
	}
	ctx, cancel := context.WithTimeout(srv.ctx, o.Timings.ConnectTimeout)
	defer cancel()
	p.mu.Lock()
	p.cons[cid] = c
	p.mu.Unlock()
	if err := req.ID.Accept(ctx, rdma.ConnParam{PrivateData: rsp.Marshal(), RNRRetryCount: 7}); err != nil {
		return err
	}
	go p.watch(c)
	return nil
}

// postEmptyRecvs posts n receives without buffers (for WRITE_WITH_IMM).
func postEmptyRecvs(qp rdma.QP, n int) error {
	wrs := make([]rdma.RecvWR, n)
	for i := range wrs {
		wrs[i].ID = wrRecv
	}
	_, err := qp.PostRecv(wrs)
	return err
}

// setupPath allocates the path's protection domain and control buffer, once. The chunks
// come at INFO_REQ (regChunks): a connection request costs no chunk memory.
func (p *SrvPath) setupPath(dev rdma.Device) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd != nil {
		if p.pd.Device().Name() != dev.Name() {
			return fmt.Errorf("rtrs: connection on %s, path on %s", dev.Name(), p.pd.Device().Name())
		}
		return nil
	}
	o := p.sess.srv.opts
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	ctl, err := pd.AllocMR(infoReqSize+InfoRspSize(p.nChunkMR())+rkeyRspSize*o.QueueDepth, rdma.AccessLocalWrite)
	if err != nil {
		return err
	}
	p.pd, p.ctlMR = pd, ctl
	p.syncLocal = dev.Query().SyncLocalOps
	p.reqs = make([]srvReq, o.QueueDepth)
	for i := range p.reqs {
		p.reqs[i].r.path, p.reqs[i].r.slot, p.reqs[i].id = p, &p.reqs[i], i
	}
	return nil
}

// regChunks registers the session's chunks for this path (at its INFO_REQ), allocating them
// if the session has none yet.
func (p *SrvPath) regChunks() error {
	ss := p.sess
	mem, err := ss.chunkMem()
	if err != nil {
		return err
	}
	o := ss.srv.opts
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state != srvConnecting {
		// Closing: its close may have let the session and its memory go already.
		return fmt.Errorf("rtrs: path closing: %w", syscall.ECONNRESET)
	}
	pd := p.pd
	local, err := pd.RegMR(mem, rdma.AccessLocalWrite)
	if err != nil {
		return err
	}
	var mrs []rdma.MR
	if o.AlwaysInvalidate {
		// One fast-registration region per chunk, so each can be invalidated and re-keyed on
		// its own; INFO_RSP registers them (map_cont_bufs). The client may fill a chunk through
		// any connection of the path: the keys serve the whole PD.
		for i := 0; i < o.QueueDepth; i++ {
			m, err := pd.AllocFastRegMR(o.ChunkSize, 0)
			if err == nil {
				mrs = append(mrs, m)
				err = m.Map(mem[i*o.ChunkSize:(i+1)*o.ChunkSize], local.Addr()+uint64(i*o.ChunkSize))
			}
			if err != nil {
				for _, m := range mrs {
					_ = m.Dereg()
				}
				_ = local.Dereg()
				return err
			}
		}
	} else {
		m, err := pd.RegMR(mem, rdma.AccessLocalWrite|rdma.AccessRemoteWrite)
		if err != nil {
			_ = local.Dereg()
			return err
		}
		mrs = append(mrs, m)
	}
	p.chunkMR, p.localMR, p.mem = mrs, local, mem
	return nil
}

// watch waits for the connection to go and closes the path.
func (p *SrvPath) watch(c *con) {
	select {
	case <-c.id.Events():
		p.lg().Infof("connection %d disconnected", c.cid)
		p.Close()
	case <-p.closed:
	}
}

// zombieLocked tells whether the path is still connecting more than z after its latest
// connection request (rtrs_srv_check_close_path); p.mu held.
func (p *SrvPath) zombieLocked(z time.Duration) bool {
	return p.state == srvConnecting && time.Since(p.connStart) > z
}

// onCompletions is connection c's completion handler.
func (p *SrvPath) onCompletions(c *con, wc []rdma.WC) {
	p.Stats.HandlerCall(c.drain(wc, func(w rdma.WC) {
		if w.Status != rdma.WCSuccess {
			if w.Status != rdma.WCFlushErr {
				p.refuse("completion error", fmt.Sprintf("connection %d: %v completion: %v", c.cid, w.Opcode, w.Status))
			}
			go p.Close()
			return
		}
		switch {
		case w.ID == wrInfo:
			p.infoReq(c, w)
		case w.ID&wrKindMask == wrLocalInv:
			p.dispatch(c, int(w.ID&^wrKindMask))
		case w.Opcode == rdma.WCRecvRDMAWithImm:
			p.recvImm(c, w.Imm)
		}
	}))
}

// recvImm handles an RDMA_WRITE_WITH_IMM from the client.
func (p *SrvPath) recvImm(c *con, imm uint32) {
	p.hb.missed.Store(0)
	if _, err := c.qp.PostRecv(c.recvWR[:]); err != nil {
		p.lg().WithError(err).Warnf("connection %d: receive not posted, closing the path", c.cid)
		go p.Close()
		return
	}
	typ, payload := ImmFields(imm)
	switch typ {
	case ImmHBMsg:
		_ = c.hbAck()
		return
	case ImmHBAck:
		p.hb.acked()
		return
	case ImmIOReq:
	default:
		p.refuse("malformed request", fmt.Sprintf("unknown immediate %#x", imm))
		go p.Close()
		return
	}
	if !p.live.Load() {
		// Before INFO_RSP there are no chunks to name; while closing, requests are dropped.
		p.mu.Lock()
		early := p.state == srvConnecting
		p.mu.Unlock()
		if early {
			p.refuse("malformed request", "IO request before INFO_REQ, closing the path")
			go p.Close()
		}
		return
	}
	o := p.sess.srv.opts
	id, off := IOReqFields(payload, MemBits(o.QueueDepth))
	if int(id) >= o.QueueDepth || int(off) >= o.ChunkSize {
		p.refuse("malformed request", fmt.Sprintf("request for chunk %d offset %d out of range", id, off))
		go p.Close()
		return
	}
	r := &p.reqs[id]
	r.off, r.con = int(off), c
	if !o.AlwaysInvalidate {
		p.dispatch(c, int(id))
		return
	}
	// Take the chunk from the client first: dispatch when its key is dead.
	// What dispatch waits for is a dead key. A device whose local operations take effect when
	// posted has it at once, and the completion (ordered behind the acknowledgements of earlier
	// responses) is not asked for; otherwise dispatch waits for the completion, as the kernel.
	mr := p.chunkMR[id]
	r.wrs[0] = rdma.SendWR{ID: wrLocalInv | uint64(id), Opcode: rdma.OpLocalInv, InvRKey: mr.RKey()}
	if !p.syncLocal {
		r.wrs[0].Flags = rdma.SendSignaled
	}
	if _, err := c.qp.PostSend(r.wrs[:1]); err != nil {
		p.lg().WithError(err).Warnf("connection %d: LOCAL_INV of chunk %d not posted, closing the path", c.cid, id)
		go p.Close()
		return
	}
	if p.syncLocal {
		if mr.Valid() {
			p.lg().Warn("chunk key still valid after a synchronous LOCAL_INV")
			go p.Close()
			return
		}
		p.dispatch(c, int(id))
	}
}

// srvReq is the per-chunk request state of a path.
type srvReq struct {
	r       SrvRequest
	id      int
	off     int
	con     *con
	needInv bool
	cliKey  uint32
	desc    SgDesc
	hasData bool
	wrs     [4]rdma.SendWR // response chain, reused: posting copies it
	sge     [2]rdma.SGE
	rd      MsgRdmaRead
	rdDesc  [1]SgDesc
}

// SrvRequest is one IO request handed to the handler.
//
// Data and Usr live in the session's chunk for the request. As in the kernel, a client that
// fails a request over resends it into the same chunk through another path, possibly while
// the dead path's copy is still being served: a handler that needs the user header or WRITE
// data after Request returns should take them out of the chunk first (the resent copy carries
// the same bytes), and READ data written later lands in the data area, which a resent
// request's header does not touch.
type SrvRequest struct {
	Dir  Dir
	Usr  []byte // the user header
	Data []byte // WRITE: the data; READ: where the data to return goes
	path *SrvPath
	slot *srvReq
	done atomic.Bool
}

// Session is the request's session.
func (r *SrvRequest) Session() *SrvSess { return r.path.sess }

// Path is the path the request came on.
func (r *SrvRequest) Path() *SrvPath { return r.path }

// ID is the request's chunk (the kernel's buf_id): requests in flight at once have distinct
// IDs, and a client keeps a chunk to one connection of a path.
func (r *SrvRequest) ID() int { return r.slot.id }

// dispatch parses the RTRS header at the request's offset and hands the request up.
func (p *SrvPath) dispatch(c *con, id int) {
	// Counted before the chunk is touched: Close clears live and then waits for the count,
	// and the session's memory goes only after every path's close, so a request that got
	// here either is waited for or sees live false and touches nothing.
	p.Stats.Inflight.Add(1)
	if !p.live.Load() {
		p.opDone()
		return // dropped, as the kernel does
	}
	r := &p.reqs[id]
	chunk := p.chunk(id)
	hdr := chunk[r.off:]
	if len(hdr) < writeHdrSize {
		p.badRequest(id, "header beyond the chunk")
		return
	}
	typ := binary.LittleEndian.Uint16(hdr)
	usrLen := int(binary.LittleEndian.Uint16(hdr[2:]))
	if usrLen > r.off || usrLen > MaxHdrSize {
		p.badRequest(id, fmt.Sprintf("user header of %d bytes at offset %d", usrLen, r.off))
		return
	}
	dataLen := r.off - usrLen
	r.needInv, r.hasData = false, false
	switch uint16(typ) {
	case MsgTypeWrite:
		r.r.Dir = Write
	case MsgTypeRead:
		m := &r.rd
		m.Desc = r.rdDesc[:0]
		if err := m.Unmarshal(hdr); err != nil {
			p.badRequest(id, err.Error())
			return
		}
		r.r.Dir = Read
		if len(m.Desc) == 1 {
			r.hasData, r.desc = true, m.Desc[0]
			if int(r.desc.Len) > dataLen {
				p.badRequest(id, fmt.Sprintf("read of %d bytes into %d", r.desc.Len, dataLen))
				return
			}
			r.needInv, r.cliKey = m.Flags&MsgNeedInvalF != 0, r.desc.Key
		}
	default:
		p.badRequest(id, fmt.Sprintf("type %d", typ))
		return
	}
	p.Stats.Request(r.r.Dir == Read, uint64(r.off), id)
	r.r.Data, r.r.Usr = chunk[:dataLen:dataLen], chunk[dataLen:r.off:r.off]
	r.r.done.Store(false)
	p.sess.srv.opts.Handler.Request(&r.r)
}

// badRequest ends a request dispatch refused (it is not handed up) and closes the path.
func (p *SrvPath) badRequest(id int, why string) {
	p.opDone()
	p.refuse("malformed request", fmt.Sprintf("malformed request in chunk %d: %s", id, why))
	go p.Close()
}

// Respond answers the request with errno (0 for success; a negative or positive errno value
// otherwise). For a successful READ the data is first written to the client. It may be called
// once, from any goroutine.
func (r *SrvRequest) Respond(errno int) {
	if r.done.Swap(true) {
		return
	}
	r.respond(errno, nil, 0)
}

// RespondFile answers a READ with success, its data taken from src at file offset off
// instead of from Data: the RDMA WRITE to the client is sourced from the file region the
// path registered for src, so the bytes never pass through the chunk (over the soft provider
// they go from the page cache to the socket by sendfile). It returns an error, and leaves
// the request unanswered, when it cannot: not a READ with data, the range beyond the source,
// the source closed, or the registration refused.
func (r *SrvRequest) RespondFile(src *FileSource, off int64) error {
	sr := r.slot
	if r.Dir != Read || !sr.hasData || sr.desc.Len == 0 {
		return fmt.Errorf("rtrs: RespondFile on a request without READ data: %w", syscall.EINVAL)
	}
	if off < 0 || off > src.size || int64(sr.desc.Len) > src.size-off {
		return fmt.Errorf("rtrs: RespondFile of %d bytes at %d from a source of %d: %w", sr.desc.Len, off, src.size, syscall.EINVAL)
	}
	mr, err := r.path.fileMR(src)
	if err != nil {
		return err
	}
	if r.done.Swap(true) {
		return fmt.Errorf("rtrs: request answered twice: %w", syscall.EINVAL)
	}
	r.respond(0, mr, off)
	return nil
}

// respond posts the response chain; a READ's data comes from file region fmr at off when
// fmr is set, else from the chunk.
func (r *SrvRequest) respond(errno int, fmr rdma.MR, off int64) {
	p := r.path
	defer p.opDone()
	if !p.live.Load() {
		return // dropped
	}
	sr := r.slot
	o := p.sess.srv.opts
	c := sr.con
	wrs := &sr.wrs
	n := 0
	if errno == 0 && sr.hasData && sr.desc.Len > 0 {
		sr.sge[0] = rdma.SGE{Addr: p.localMR.Addr() + uint64(sr.id*o.ChunkSize), Length: sr.desc.Len, LKey: p.localMR.LKey()}
		if fmr != nil {
			sr.sge[0] = rdma.SGE{Addr: fmr.Addr() + uint64(off), Length: sr.desc.Len, LKey: fmr.LKey()}
		}
		wrs[n] = rdma.SendWR{Opcode: rdma.OpRDMAWrite, SGList: sr.sge[0:1], RemoteAddr: sr.desc.Addr, RKey: sr.desc.Key}
		n++
	}
	if sr.needInv {
		wrs[n] = rdma.SendWR{Opcode: rdma.OpSendWithInv, InvRKey: sr.cliKey}
		n++
	}
	imm := IORspImm(uint32(sr.id), errno, sr.needInv)
	if o.AlwaysInvalidate {
		mr := p.chunkMR[sr.id]
		key := rdma.IncKey(mr.RKey())
		wrs[n] = rdma.SendWR{Opcode: rdma.OpRegMR, MR: mr, Key: key, Access: rdma.AccessLocalWrite | rdma.AccessRemoteWrite}
		n++
		off := p.ctlRkey(sr.id)
		rk := MsgRkeyRsp{BufID: uint16(sr.id), Rkey: key}
		rk.Put(p.ctlMR.Bytes()[off:])
		sr.sge[1] = rdma.SGEOf(p.ctlMR, off, rkeyRspSize)
		wrs[n] = rdma.SendWR{Opcode: rdma.OpSendWithImm, Imm: imm, SGList: sr.sge[1:2]}
	} else {
		wrs[n] = rdma.SendWR{Opcode: rdma.OpRDMAWriteWithImm, Imm: imm}
	}
	wrs[n].ID, wrs[n].Flags = wrResp|uint64(sr.id), c.signal()
	n++
	if _, err := c.qp.PostSend(wrs[:n]); err != nil {
		p.lg().WithError(err).Warn("response not sent")
		go p.Close()
	}
}

// infoReq handles INFO_REQ on connection 0 (process_info_req).
func (p *SrvPath) infoReq(c *con, w rdma.WC) {
	var m MsgInfoReq
	if err := m.Unmarshal(p.ctlMR.Bytes()[:w.ByteLen]); err != nil {
		p.refuse("malformed INFO_REQ", err.Error())
		go p.Close()
		return
	}
	if err := validName(m.PathName); err != nil {
		p.refuse("malformed INFO_REQ", err.Error())
		go p.Close()
		return
	}
	srv, ss := p.sess.srv, p.sess
	peer := c.id.RemoteAddr()
	if !srv.nameFree(ss, m.PathName) {
		srv.refuse(peer, "session name in use", fmt.Sprintf("session name %q is used by another client session: %v", m.PathName, syscall.EPERM))
		go p.Close()
		return
	}
	// Memory first: a session refused for want of it does not take a name.
	if err := p.regChunks(); err != nil {
		srv.refuse(peer, "chunk memory", err.Error())
		go p.Close()
		return
	}
	ss.mu.Lock()
	named := ss.name != ""
	ss.mu.Unlock()
	if !named {
		// Outside the server's lock: a new name is written to the names file.
		errno, err := srv.names.claim(m.PathName, ss.owner.Key())
		if err != nil {
			p.lg().WithError(err).Warn("session name not saved")
		}
		switch errno {
		case syscall.EPERM:
			srv.refuse(peer, "session name of another identity", fmt.Sprintf("%v asked for session name %q, which belongs to another client: %v", ss.owner, m.PathName, errno))
		case syscall.ENOSPC:
			srv.refuse(peer, "session names full", fmt.Sprintf("%v asked for a new session name %q with %d names kept: %v", ss.owner, m.PathName, maxNames, errno))
		}
		if errno != 0 {
			go p.Close()
			return
		}
	}
	srv.mu.Lock()
	if !srv.nameFreeLocked(ss, m.PathName) {
		srv.mu.Unlock()
		srv.refuse(peer, "session name in use", fmt.Sprintf("session name %q is used by another client session: %v", m.PathName, syscall.EPERM))
		go p.Close()
		return
	}
	ss.mu.Lock()
	if ss.name == "" {
		ss.name = m.PathName
	}
	ss.mu.Unlock()
	srv.sessNamedLocked(ss)
	srv.mu.Unlock()
	p.logp.Store(p.lg().WithField("session", m.PathName))

	if err := postEmptyRecvs(c.qp, ServiceConQD); err != nil {
		p.lg().WithError(err).Warn("receives not posted, closing the path")
		go p.Close()
		return
	}
	p.mu.Lock()
	if p.state != srvConnecting {
		p.mu.Unlock()
		return
	}
	p.state = srvConnected
	p.live.Store(true)
	p.listed = true
	p.mu.Unlock()
	p.zombie.Stop()
	srv.established(p)
	ss.mu.Lock()
	ss.established++
	first := ss.established == 1
	ss.mu.Unlock()
	if first {
		srv.opts.Handler.LinkEvent(ss, LinkConnected)
	}
	rsp := MsgInfoRsp{}
	cs := srv.opts.ChunkSize
	var wrs []rdma.SendWR
	for _, mr := range p.chunkMR {
		key := mr.RKey()
		if srv.opts.AlwaysInvalidate {
			// Registered in front of the response on the same queue, so no key is named
			// before it works.
			key = rdma.IncKey(mr.RKey())
			wrs = append(wrs, rdma.SendWR{Opcode: rdma.OpRegMR, MR: mr, Key: key, Access: rdma.AccessLocalWrite | rdma.AccessRemoteWrite})
		}
		rsp.Desc = append(rsp.Desc, SgDesc{Addr: mr.Addr(), Key: key, Len: uint32(mr.Len() / cs * cs)})
	}
	b := rsp.Marshal()
	copy(p.ctlMR.Bytes()[p.ctlInfoRsp():], b)
	wrs = append(wrs, rdma.SendWR{ID: wrInfo, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(p.ctlMR, p.ctlInfoRsp(), len(b))}})
	if _, err := c.qp.PostSend(wrs); err != nil {
		p.lg().WithError(err).Warn("INFO_RSP not sent")
		go p.Close()
		return
	}
	t := srv.opts.Timings
	p.hb.run(t.HeartbeatInterval, t.HeartbeatMissed, func() error {
		_, err := c.qp.PostSend(hbWR(ImmHBMsgValue))
		return err
	}, func() {
		p.lg().Warn("heartbeat lost, closing the path")
		go p.Close()
	})
	p.lg().Info("path connected")
}

// Disconnect closes the path asynchronously (the server's sysfs disconnect).
func (p *SrvPath) Disconnect() { go p.Close() }

// Close closes the path (close_path): connections go, requests handed up are waited for,
// the session goes with its last path. It returns when the path is closed.
func (p *SrvPath) Close() {
	p.closing.Do(func() {
		p.mu.Lock()
		wasConnected := p.state == srvConnected
		p.state = srvClosing
		p.live.Store(false)
		cons := append([]*con(nil), p.cons...)
		p.mu.Unlock()
		p.sess.mu.Lock()
		p.sess.live--
		p.sess.mu.Unlock()
		p.zombie.Stop()
		p.hb.halt()
		for _, c := range cons {
			if c != nil && c.qp != nil {
				c.qp.ToError()
			}
		}
		p.hb.wait()
		// Requests already handed up are answered (into the void) before the memory goes.
		p.mu.Lock()
		deadline := time.AfterFunc(p.sess.srv.opts.Timings.ConnectTimeout, func() {
			p.mu.Lock()
			p.opsIdle.Broadcast()
			p.mu.Unlock()
		})
		start := time.Now()
		for p.Stats.Inflight.Load() > 0 && time.Since(start) < p.sess.srv.opts.Timings.ConnectTimeout {
			p.opsIdle.Wait()
		}
		deadline.Stop()
		stuck := p.Stats.Inflight.Load() > 0
		p.mu.Unlock()
		for _, c := range cons {
			if c != nil {
				c.destroy()
			}
		}
		ss, srv := p.sess, p.sess.srv
		srv.mu.Lock()
		srv.pendLocked(p, -p.pending)
		srv.conns -= p.nCons
		p.nCons = 0
		ss.mu.Lock()
		ss.stuck = ss.stuck || stuck
		delete(ss.paths, p.uuid)
		last := false
		if wasConnected {
			ss.established--
			last = ss.established == 0
		}
		gone := len(ss.paths) == 0
		if gone {
			delete(srv.sessions, ss.uuid)
			ss.gone = true
			srv.sessNamedLocked(ss)
		}
		ss.mu.Unlock()
		srv.mu.Unlock()
		if last {
			srv.opts.Handler.LinkEvent(ss, LinkDisconnected)
		}
		p.mu.Lock()
		mrs := append(p.chunkMR, p.localMR, p.ctlMR)
		p.mu.Unlock()
		for _, mr := range mrs {
			if mr != nil {
				_ = mr.Dereg()
			}
		}
		p.dropFileMRs()
		if gone {
			// Every path has deregistered the chunks: nothing but a stuck handler can
			// touch them now.
			ss.freeMem()
		}
		p.mu.Lock()
		p.state = srvClosed
		p.mu.Unlock()
		p.lg().Info("path closed")
		close(p.closed)
	})
	<-p.closed
}

// FileSource is a file that READ responses may carry data from without a copy into the
// chunk (SrvRequest.RespondFile). Each path registers it as a file region of its protection
// domain (rdma.PD.RegFileMR) when a response first names it; Close deregisters it everywhere.
type FileSource struct {
	f    *os.File
	size int64

	mu     sync.Mutex
	closed bool
	paths  map[*SrvPath]struct{}
}

// NewFileSource makes f, of size bytes, a source for RespondFile. The source does not own f:
// the regions hold descriptors of their own, so f may be closed after the source.
func NewFileSource(f *os.File, size int64) *FileSource {
	return &FileSource{f: f, size: size, paths: map[*SrvPath]struct{}{}}
}

// Close deregisters the source from every path; later RespondFile calls fail.
func (fs *FileSource) Close() {
	fs.mu.Lock()
	fs.closed = true
	paths := fs.paths
	fs.paths = nil
	fs.mu.Unlock()
	for p := range paths {
		p.mu.Lock()
		mr := p.fileMRs[fs]
		delete(p.fileMRs, fs)
		p.mu.Unlock()
		if mr != nil {
			_ = mr.Dereg()
		}
	}
}

// fileMR returns the path's region for fs, registering it the first time. Lock order:
// fs.mu before p.mu.
func (p *SrvPath) fileMR(fs *FileSource) (rdma.MR, error) {
	p.mu.Lock()
	mr := p.fileMRs[fs]
	p.mu.Unlock()
	if mr != nil {
		return mr, nil
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.closed {
		return nil, fmt.Errorf("rtrs: file source closed: %w", syscall.ENODEV)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if mr := p.fileMRs[fs]; mr != nil {
		return mr, nil
	}
	if p.pd == nil || p.state != srvConnected {
		return nil, fmt.Errorf("rtrs: file region on a path that is not connected: %w", syscall.ENOTCONN)
	}
	mr, err := p.pd.RegFileMR(fs.f, 0, int(fs.size), 0)
	if err != nil {
		return nil, err
	}
	if p.fileMRs == nil {
		p.fileMRs = map[*FileSource]rdma.MR{}
	}
	p.fileMRs[fs] = mr
	fs.paths[p] = struct{}{}
	return mr, nil
}

// dropFileMRs deregisters the path's file regions (path close).
func (p *SrvPath) dropFileMRs() {
	p.mu.Lock()
	mrs := p.fileMRs
	p.fileMRs = nil
	p.mu.Unlock()
	for fs, mr := range mrs {
		fs.mu.Lock()
		delete(fs.paths, p)
		fs.mu.Unlock()
		_ = mr.Dereg()
	}
}
