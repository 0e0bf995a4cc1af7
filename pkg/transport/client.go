package transport

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/stats"
)

// Policy is a multipath policy (mpath_policy).
type Policy int32

// Policies, with the kernel's numbers.
const (
	RoundRobin  Policy = 0
	MinInflight Policy = 1
	MinLatency  Policy = 2
)

func (p Policy) String() string {
	switch p {
	case RoundRobin:
		return "round-robin"
	case MinInflight:
		return "min-inflight"
	case MinLatency:
		return "min-latency"
	}
	return fmt.Sprintf("Unknown (%d)", int32(p))
}

// PathAddrs are the two ends of a client path; Src may be left zero.
type PathAddrs struct {
	Src, Dst Addr
}

// ClientOptions configure a client session.
type ClientOptions struct {
	Provider rdma.Provider
	SessName string
	Paths    []PathAddrs
	// Port is the server port (RNBD's dest_port, default 1234).
	Port uint16
	// ConPerPath is connections per path including connection 0 (default CPUs + 1).
	ConPerPath int
	Policy     Policy
	// MaxReconnectAttempts: -1 for ever, 0 never reconnect automatically, up to 9999.
	MaxReconnectAttempts int
	Timings              Timings
	// OnLinkEvent gets LinkDisconnected when no path is left and LinkReconnected when the
	// first comes back. It runs on a transport goroutine and must not block.
	OnLinkEvent func(LinkEvent)
	// AfterCompletions, if set, runs after each batch of request callbacks, on the goroutine
	// that ran them: a connection's completion goroutine after the completions it handled,
	// and also one that finished requests outside it (a response that came while its
	// request's post ran, a failover that found no path). A user can gather what those
	// callbacks produced and send it once. It must not block.
	AfterCompletions func()
	// MaxChunkMemory bounds what a server can make the session allocate: a path whose server
	// offers queue depth × (chunk size + a 4 KiB header buffer) above it is refused (default
	// DefaultClientChunkMemory).
	MaxChunkMemory int64
}

// DefaultClientChunkMemory is ClientOptions.MaxChunkMemory's default: four times the
// kernel server's defaults (512 chunks of 128 KiB).
const DefaultClientChunkMemory = 4 * DefaultQueueDepth * DefaultChunkSize

// Session is a client session: a name, paths to one server session, and one pool of permits.
type Session struct {
	opts      ClientOptions
	pathsUUID uuid.UUID
	log       *log.Entry
	// beforePost, if set, runs in post just before PostSend: the tests' way into that window.
	beforePost func(permit, cid int)
	// beforePermitWait, if set, runs in request when it is about to wait for a permit, after
	// what was plugged has been sent: the tests' way into that window.
	beforePermitWait func()

	mu    sync.RWMutex
	paths []*Path
	// removed is when a path to each server address was last removed (under mu): AddPath
	// retries the server's EEXIST only for an address the session has just let go.
	removed map[string]time.Time
	snap    atomic.Pointer[[]*Path] // paths, copied on every change, for the IO path

	queueDepth int
	maxIOSize  int
	chunkSize  int
	memBits    int

	permits *permits
	reqs    []cltReq

	plug plug

	// umu orders the IO buffers' registrations: the buffers, and the path resources that
	// stage data, on which each of them is registered.
	umu    sync.Mutex
	iobufs []*ioBufs
	ures   map[*pathRes]struct{}
	// kept are freed IO buffers a window still held a region of: unmapped once every
	// region is deregistered (releaseKept).
	kept     []*ioBufs
	regFails log.Limiter // IO buffers a path could not register
	// staging: a path of the session has staged data; its IO buffers are registered on
	// every such path as it connects, also when none is connected at the allocation.
	staging bool

	policy       atomic.Int32
	rr           atomic.Uint32
	maxReconnect atomic.Int32
	established  atomic.Int32
	opening      atomic.Bool
	closed       atomic.Bool

	// Requests that failed: no connected path took them (or they had to leave a failed one
	// and none took them), or the server answered them with an errno. Counted off the
	// successful path only.
	failNoPath, failServer stats.Counter
	// Posts whose data went through their path's stage: a copy each way that memory the
	// session registered (AllocIOBuffers) would have saved.
	staged stats.Counter
}

// StagedRequests counts the requests posted since the session opened whose data was copied
// through their path's stage (verbs, data outside the memory AllocIOBuffers registered; a
// request failed over counts on each path it went out on). Over soft it stays 0.
func (s *Session) StagedRequests() uint64 { return s.staged.Total() }

// FailedRequests are the session's requests that failed since it opened: noPath that no
// connected path took (ECONNABORTED), server that the server answered with an error.
func (s *Session) FailedRequests() (noPath, server uint64) {
	return s.failNoPath.Total(), s.failServer.Total()
}

// InflightByPath counts the requests in flight on each path, whatever the policy (the
// path's stats/rdma inflight counts only those min-inflight placed). It reads each
// request's owner, so it costs the IO path nothing.
func (s *Session) InflightByPath() map[*Path]int {
	s.mu.RLock()
	reqs := s.reqs // set under mu when the first path learns the queue depth
	s.mu.RUnlock()
	byCon := map[*con]int{}
	for i := range reqs {
		if c := reqs[i].owner.Load(); c != nil {
			byCon[c]++
		}
	}
	out := map[*Path]int{}
	for _, p := range s.Paths() {
		p.mu.Lock()
		for _, c := range p.cons {
			out[p] += byCon[c]
		}
		p.mu.Unlock()
	}
	return out
}

// Open connects every path, one after the other (rtrs_clt_open); if any fails, the whole
// open fails.
func Open(ctx context.Context, opts ClientOptions) (*Session, error) {
	if opts.Provider == nil {
		return nil, errors.New("rtrs: no provider")
	}
	if err := validName(opts.SessName); err != nil {
		return nil, err
	}
	if len(opts.Paths) < 1 || len(opts.Paths) > MaxPathsNum {
		return nil, fmt.Errorf("rtrs: %d paths (1..%d): %w", len(opts.Paths), MaxPathsNum, syscall.EINVAL)
	}
	if opts.MaxReconnectAttempts < -1 || opts.MaxReconnectAttempts > 9999 {
		return nil, fmt.Errorf("rtrs: max_reconnect_attempts %d: %w", opts.MaxReconnectAttempts, syscall.EINVAL)
	}
	if opts.Port == 0 {
		opts.Port = DefaultPort
	}
	if opts.ConPerPath <= 0 {
		opts.ConPerPath = runtime.NumCPU() + 1
	}
	opts.Timings = opts.Timings.withDefaults()
	if opts.MaxChunkMemory <= 0 {
		opts.MaxChunkMemory = DefaultClientChunkMemory
	}
	s := &Session{opts: opts, pathsUUID: uuid.New(), log: log.L.WithFields(log.Fields{"session": opts.SessName})}
	s.policy.Store(int32(opts.Policy))
	s.maxReconnect.Store(int32(opts.MaxReconnectAttempts))
	s.opening.Store(true) // link events are masked while the paths first connect
	defer s.opening.Store(false)
	for i, pa := range opts.Paths {
		p := s.newPath(pa, i == 0)
		if err := p.connectFirst(ctx); err != nil {
			for _, q := range s.Paths() {
				q.close()
			}
			return nil, fmt.Errorf("rtrs: path %v: %w", pa.Dst, err)
		}
	}
	return s, nil
}

// Name is the session name.
func (s *Session) Name() string { return s.opts.SessName }

// Port is the server port every path connects to.
func (s *Session) Port() uint16 { return s.opts.Port }

// QueueDepth is the server's queue depth: the number of permits.
func (s *Session) QueueDepth() int { return s.queueDepth }

// MaxIOSize is the largest data length of one request.
func (s *Session) MaxIOSize() int { return s.maxIOSize }

// MaxHdrSize bounds the user header plus the RTRS header of a request.
func (s *Session) MaxHdrSize() int { return MaxHdrSize }

// Policy is the current multipath policy.
func (s *Session) Policy() Policy { return Policy(s.policy.Load()) }

// SetPolicy switches the multipath policy at once.
func (s *Session) SetPolicy(p Policy) error {
	if p < RoundRobin || p > MinLatency {
		return fmt.Errorf("rtrs: policy %d: %w", p, syscall.EINVAL)
	}
	s.policy.Store(int32(p))
	return nil
}

// MaxReconnectAttempts is the current limit (-1: for ever).
func (s *Session) MaxReconnectAttempts() int { return int(s.maxReconnect.Load()) }

// SetMaxReconnectAttempts changes the limit; it applies at the next attempt.
func (s *Session) SetMaxReconnectAttempts(n int) error {
	if n < -1 || n > 9999 {
		return fmt.Errorf("rtrs: max_reconnect_attempts %d not in -1..9999: %w", n, syscall.EINVAL)
	}
	s.maxReconnect.Store(int32(n))
	return nil
}

// Paths lists the session's paths in the order they were added.
func (s *Session) Paths() []*Path {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return append([]*Path(nil), s.paths...)
}

// setPathsLocked replaces the path list and its snapshot; s.mu is held.
func (s *Session) setPathsLocked(paths []*Path) {
	s.paths = paths
	snap := append([]*Path(nil), paths...)
	s.snap.Store(&snap)
}

// Close closes every path, after the requests in flight have completed or failed.
func (s *Session) Close() error {
	if s.closed.Swap(true) {
		return ErrClosed
	}
	// Wait for every permit: no request is in flight after this.
	if s.permits != nil {
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timings.ConnectTimeout)
		defer cancel()
		if !s.permits.drain(ctx) {
			s.log.Warn("closing with requests still in flight")
		}
	}
	for _, p := range s.Paths() {
		p.close()
	}
	return nil
}

func (s *Session) linkEvent(ev LinkEvent) {
	s.log.Infof("session %v", ev)
	if s.opts.OnLinkEvent != nil {
		s.opts.OnLinkEvent(ev)
	}
}

// PathState is a client path's state (enum rtrs_clt_state).
type PathState int32

// Path states, in the kernel's order.
const (
	StateConnecting PathState = iota
	StateConnectingErr
	StateReconnecting
	StateConnected
	StateClosing
	StateClosed
	StateDead
)

func (st PathState) String() string {
	return [...]string{"CONNECTING", "CONNECTING_ERR", "RECONNECTING", "CONNECTED", "CLOSING", "CLOSED", "DEAD"}[st]
}

// allowedFrom is the transition table of spec 3.3.
var allowedFrom = map[PathState][]PathState{
	StateConnecting:    {StateReconnecting},
	StateConnectingErr: {StateConnecting},
	StateReconnecting:  {StateConnected, StateConnectingErr, StateClosed},
	StateConnected:     {StateConnecting},
	StateClosing:       {StateConnecting, StateConnectingErr, StateReconnecting, StateConnected},
	StateClosed:        {StateClosing},
	StateDead:          {StateClosed},
}

// Path is one path of a client session.
type Path struct {
	sess *Session
	uuid uuid.UUID
	dst  Addr
	logp atomic.Pointer[log.Entry]

	// posting counts the posts that found the path connected and still use its resources and
	// their requests' work requests; teardown waits for them before the failover, so that a
	// request is never rebuilt for another path while its PostSend here still reads it. (Not
	// a lock a post holds: a completion handler that the provider runs inside PostSend may post
	// again, and would deadlock behind a waiting teardown.) Added to under mu only while res is
	// set, which teardown clears before it waits.
	posting sync.WaitGroup

	mu        sync.Mutex
	stateCond *sync.Cond
	state     PathState
	src       Addr // as given, then as resolved at the first connect
	name      string
	firstConn bool
	cons      []*con
	hcaName   string
	hcaPort   int
	rbufs     []rbuf
	res       *pathRes
	attempts  int
	reconCnt  uint16
	counted   bool          // the path counts in the session's established paths
	trigger   chan struct{} // wakes the reconnect loop at once
	worker    bool          // a recovery/reconnect goroutine is running
	workDone  chan struct{}
	// Reconnect attempts begun and finished, and a channel closed (and replaced) at the end
	// of each: a reconnect write waits for the attempt it asked for, not for the worker.
	tryStarts, tryEnds uint64
	tryDone            chan struct{}
	infoErr            error // why the last INFO_RSP was refused (infoRsp), for infoExchange

	hb heartbeat

	// Stats are the path's counters (its stats/ directory).
	Stats *stats.ClientPath
}

type rbuf struct {
	addr uint64
	rkey atomic.Uint32
}

// pathRes are the memory resources of one connection round of a path.
type pathRes struct {
	pd rdma.PD
	// What this round's server announced in connection 0's response: its chunk size (at
	// least the session's) and whether it sends a new key with each response
	// (always_invalidate), per path as the kernel's client keeps them, since a server
	// restarted with other settings is the same path.
	chunk   int
	newRkey bool
	fr      []rdma.MR // per permit: fast-registration MR for the data
	iu      rdma.MR   // per permit MaxHdrSize: user header + RTRS header
	rcv     rdma.MR   // receive buffers: info response, then per connection 2*qd rkey responses
	rcvOff  []int     // per connection: offset of its receive buffers
	// stage is per permit maxIOSize bytes of registered memory, where data is staged for a
	// device that maps only registered memory (rdma.DeviceAttr.MapRegisteredOnly); nil
	// where the user's buffers are mapped directly.
	stage rdma.MR
	// direct are the session's IO buffers registered on this round's PD, by region start
	// (AllocIOBuffers), copied on change: their requests skip the stage.
	direct atomic.Pointer[map[uintptr]rdma.MR]
	// parked are regions of freed IO buffers a window was still bound over (Session.umu).
	parked []parkedMR
	// syncLocal: LOCAL_INV takes effect in the post (rdma.DeviceAttr.SyncLocalOps); else a
	// READ is finished from its invalidation's completion.
	syncLocal bool
}

func (s *Session) newPath(pa PathAddrs, first bool) *Path {
	p := &Path{sess: s, uuid: uuid.New(), dst: pa.Dst, src: pa.Src, firstConn: first,
		state: StateConnecting, trigger: make(chan struct{}, 1), tryDone: make(chan struct{}), Stats: stats.NewClientPath()}
	p.stateCond = sync.NewCond(&p.mu)
	p.logp.Store(s.log.WithField("dst", pa.Dst.String()))
	s.mu.Lock()
	s.setPathsLocked(append(s.paths, p))
	s.mu.Unlock()
	return p
}

func (p *Path) lg() *log.Entry { return p.logp.Load() }

// Name is "<src>@<dst>" with the source resolved at the first connect.
func (p *Path) Name() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.name != "" {
		return p.name
	}
	return PathName(p.src, p.dst)
}

// Listed says whether the path has connected once: the kernel creates a path's sysfs
// directory then, under the name it keeps from then on.
func (p *Path) Listed() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.name != "" }

// State is the path's state.
func (p *Path) State() PathState {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.state
}

// SrcAddr and DstAddr are the path's addresses.
func (p *Path) SrcAddr() Addr { p.mu.Lock(); defer p.mu.Unlock(); return p.src }

// DstAddr is the server's address.
func (p *Path) DstAddr() Addr { return p.dst }

// HCA is the device and port of connection 0 at its last establishment.
func (p *Path) HCA() (string, int) { p.mu.Lock(); defer p.mu.Unlock(); return p.hcaName, p.hcaPort }

// CurLatency is the last heartbeat round trip.
func (p *Path) CurLatency() time.Duration { return time.Duration(p.hb.latency.Load()) }

// Inflight is the min-inflight counter of the path.
func (p *Path) Inflight() int { return int(p.Stats.Inflight.Load()) }

// Session is the path's session.
func (p *Path) Session() *Session { return p.sess }

// setStateLocked moves the path to st if the transition table allows it.
func (p *Path) setStateLocked(st PathState) bool {
	for _, from := range allowedFrom[st] {
		if from == p.state {
			p.state = st
			p.stateCond.Broadcast()
			return true
		}
	}
	return false
}

func (p *Path) setState(st PathState) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.setStateLocked(st)
}

// connectFirst connects a new path; on failure it leaves the session (spec 3.2: no automatic
// reconnect during open or add_path).
func (p *Path) connectFirst(ctx context.Context) error {
	if err := p.init(ctx); err == nil {
		p.markUp()
	} else {
		p.sess.removePath(p)
		p.mu.Lock()
		p.state = StateDead
		p.mu.Unlock()
		return err
	}
	return nil
}

// init establishes every connection and the info exchange (init_path). The path is in
// CONNECTING; it ends CONNECTED or CONNECTING_ERR.
func (p *Path) init(ctx context.Context) (err error) {
	s := p.sess
	t := s.opts.Timings
	p.mu.Lock()
	p.reconCnt++
	src, first := p.src, p.firstConn
	p.mu.Unlock()
	defer func() {
		if err != nil {
			p.mu.Lock()
			p.setStateLocked(StateConnectingErr)
			p.mu.Unlock()
			p.teardown()
		}
	}()
	n := s.opts.ConPerPath
	cons := make([]*con, n)
	p.mu.Lock()
	p.cons = cons
	p.mu.Unlock()
	var rsp MsgConnRsp
	for cid := 0; cid < n; cid++ {
		cctx, cancel := context.WithTimeout(ctx, t.ConnectTimeout)
		c, r, err := p.connectCon(cctx, cid, n, src, first, int(rsp.QueueDepth))
		cancel()
		if err != nil {
			return err
		}
		p.mu.Lock()
		cons[cid] = c
		p.mu.Unlock()
		// A disconnect while the path is still connecting fails the connect at once.
		go p.watch(c)
		if cid == 0 {
			rsp = r
			p.mu.Lock()
			p.firstConn = true // any later connect of this path creates the session if needed
			la := c.id.LocalAddr()
			p.src = addrOf(la)
			p.src.GID = p.dst.GID
			p.hcaName, p.hcaPort = c.id.Device().Name(), c.id.Port()
			if p.name == "" {
				p.name = PathName(p.src, p.dst)
				p.logp.Store(s.log.WithField("path", p.name))
			}
			p.mu.Unlock()
		}
	}
	if err := s.takeLimits(p, &rsp); err != nil {
		return err
	}
	if err := p.allocRes(); err != nil {
		return err
	}
	ictx, cancel := context.WithTimeout(ctx, t.ConnectTimeout)
	defer cancel()
	if err := p.infoExchange(ictx); err != nil {
		return err
	}
	p.hb.missed.Store(0)
	p.hb.run(t.HeartbeatInterval, t.HeartbeatMissed, cons[0].postHB, func() {
		p.lg().Warn("heartbeat lost")
		p.errRecovery(fmt.Errorf("heartbeat lost: %w", syscall.ETIMEDOUT))
	})
	return nil
}

// connectCon establishes connection cid.
// known is the queue depth connection 0's response announced (0: none yet); before the
// session has its own, the queues are sized by it.
func (p *Path) connectCon(ctx context.Context, cid, n int, src Addr, first bool, known int) (*con, MsgConnRsp, error) {
	s := p.sess
	var rsp MsgConnRsp
	dst := netip.AddrPortFrom(p.dst.IP, s.opts.Port)
	id, err := s.opts.Provider.ResolveAddr(ctx, src.IP, dst)
	if err != nil {
		return nil, rsp, err
	}
	c := &con{cid: cid, id: id, sigInterval: ServiceConQD}
	fail := func(err error) (*con, MsgConnRsp, error) {
		c.destroy()
		return nil, rsp, err
	}
	// Queue sizes before the queue depth is known are bounded by the service depth; the IO
	// connections of a first connect take what connection 0 was told (a server of queue
	// depth above 768 needs more receives than the default gives).
	qd := s.queueDepth
	switch {
	case qd == 0 && known > 0:
		qd = known
	case qd == 0:
		qd = DefaultQueueDepth
	}
	sendWR, recvWR := min(4*qd+1, 16384), min(3*qd+1, 16384)
	if cid == 0 {
		sendWR, recvWR = 1026, 1026
	}
	if c.cq, err = id.Device().CreateCQ(sendWR + recvWR); err != nil {
		return fail(err)
	}
	p.mu.Lock()
	res := p.res
	p.mu.Unlock()
	var pd rdma.PD
	if res != nil && res.pd.Device().Name() == id.Device().Name() {
		pd = res.pd
	} else if pd, err = id.Device().AllocPD(); err != nil {
		return fail(err)
	} else {
		p.mu.Lock()
		if p.res == nil {
			p.res = &pathRes{pd: pd}
		} else {
			// Another connection of the path set the PD up first: ours is not needed.
			_ = pd.Dealloc()
			if p.res.pd.Device().Name() != id.Device().Name() {
				p.mu.Unlock()
				return fail(fmt.Errorf("rtrs: connection %d on %s, path on %s: %w", cid, id.Device().Name(), p.res.pd.Device().Name(), syscall.EINVAL))
			}
		}
		pd = p.res.pd
		p.mu.Unlock()
	}
	if c.qp, err = id.CreateQP(pd, rdma.QPInitAttr{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: sendWR, MaxRecvWR: recvWR, MaxSendSGE: 2, MaxRecvSGE: 1}); err != nil {
		return fail(err)
	}
	req := MsgConnReq{Cid: uint16(cid), CidNum: uint16(n), SessUUID: p.uuid, PathsUUID: s.pathsUUID, FirstConn: first}
	p.mu.Lock()
	req.ReconCnt = p.reconCnt
	p.mu.Unlock()
	data, err := id.Connect(ctx, rdma.ConnParam{PrivateData: req.Marshal(), RNRRetryCount: 7, RetryCount: 7})
	if err != nil {
		if r, ok := rdma.IsReject(err); ok {
			// The errno the server put in its conn_rsp is what the caller gets, as the kernel client
			// returns it from rtrs_rdma_conn_rejected (6.1 through 7.2).
			var m MsgConnRsp
			if len(r.PrivateData) >= connMsgSize && m.Unmarshal(r.PrivateData) == nil && m.Errno < 0 {
				return fail(fmt.Errorf("rtrs: server rejected connection %d: %w", cid, syscall.Errno(-m.Errno)))
			}
			return fail(fmt.Errorf("rtrs: connection %d rejected: %w", cid, syscall.ECONNRESET))
		}
		return fail(err)
	}
	if err := rsp.Unmarshal(data); err != nil {
		return fail(fmt.Errorf("rtrs: bad connection response (%v): %w", err, syscall.ECONNRESET))
	}
	if rsp.Errno != 0 {
		// An accept that carries an errno: no kernel server sends one.
		return fail(fmt.Errorf("rtrs: connection %d accepted with errno %d: %w", cid, rsp.Errno, syscall.ECONNRESET))
	}
	return c, rsp, nil
}

// takeLimits applies connection 0's response: the session's queue depth and sizes; a path
// whose server reports another queue depth than the session has is refused.
func (s *Session) takeLimits(p *Path, rsp *MsgConnRsp) error {
	qd := int(rsp.QueueDepth)
	chunk := int(rsp.MaxIOSize) + int(rsp.MaxHdrSize)
	if qd == 0 || rsp.MaxHdrSize == 0 || int(rsp.MaxHdrSize) > chunk {
		return fmt.Errorf("rtrs: server offers queue depth %d, io size %d, header size %d: %w", qd, rsp.MaxIOSize, rsp.MaxHdrSize, syscall.EINVAL)
	}
	if err := CheckImmBits(qd, chunk); err != nil {
		return fmt.Errorf("%w: %w", err, syscall.EINVAL)
	}
	if chunk < MinChunkSize {
		// The kernel's server never offers less; a tiny chunk would let a huge queue depth
		// pass the bound below while its per-permit buffers did not.
		return fmt.Errorf("rtrs: server offers %d-byte chunks, less than %d: %w", chunk, MinChunkSize, syscall.EINVAL)
	}
	// Per permit the client holds the chunk's worth (mapped, or staged on a device that maps
	// registered memory only) and a header buffer.
	if lim := s.opts.MaxChunkMemory; int64(qd)*int64(chunk+MaxHdrSize) > lim {
		return fmt.Errorf("rtrs: server offers queue depth %d × chunk %d (and a %d-byte header each), more than the %d bytes allowed (MaxChunkMemory): %w", qd, chunk, MaxHdrSize, lim, syscall.EINVAL)
	}
	p.mu.Lock()
	res := p.res
	p.mu.Unlock()
	res.chunk, res.newRkey = chunk, rsp.Flags&MsgNewRkeyF != 0
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.permits == nil {
		s.queueDepth, s.chunkSize, s.memBits = qd, chunk, MemBits(qd)
		s.maxIOSize = int(rsp.MaxIOSize)
		s.permits = newPermits(qd)
		s.reqs = make([]cltReq, qd)
		for i := range s.reqs {
			s.reqs[i].permit = i
		}
		return nil
	}
	if qd != s.queueDepth {
		p.mu.Lock()
		p.attempts = -1 // queue depth changed: no more automatic reconnects, as the kernel
		p.mu.Unlock()
		return fmt.Errorf("rtrs: queue depth changed from %d to %d: %w", s.queueDepth, qd, syscall.ECONNRESET)
	}
	// A larger chunk takes the session's requests as they are; a smaller one would not take
	// the largest (the block device above was told the session's max IO size at its open).
	if chunk < s.chunkSize || int(rsp.MaxIOSize) < s.maxIOSize {
		return fmt.Errorf("rtrs: server's chunks are %d bytes (max IO %d), less than the session's %d (max IO %d): %w", chunk, rsp.MaxIOSize, s.chunkSize, s.maxIOSize, syscall.ECONNRESET)
	}
	return nil
}

// allocRes allocates the per-permit memory of this connection round.
func (p *Path) allocRes() error {
	s := p.sess
	p.mu.Lock()
	res := p.res
	cons := p.cons
	p.mu.Unlock()
	qd := s.queueDepth
	var err error
	res.fr = make([]rdma.MR, qd)
	for i := range res.fr {
		// The server answers a READ on the connection it came on and invalidates the key
		// with SEND_WITH_INV (RTRS_MSG_NEED_INVAL_F), so the key serves that connection only.
		if res.fr[i], err = res.pd.AllocFastRegMR(s.maxIOSize, rdma.FastRegRemoteInv); err != nil {
			return err
		}
	}
	attr := res.pd.Device().Query()
	res.syncLocal = attr.SyncLocalOps
	if attr.MapRegisteredOnly {
		if res.stage, err = res.pd.AllocMR(qd*s.maxIOSize, rdma.AccessLocalWrite); err != nil {
			return err
		}
		s.addStaging(p, res)
	}
	if res.iu, err = res.pd.AllocMR(qd*MaxHdrSize, rdma.AccessLocalWrite); err != nil {
		return err
	}
	// Receive buffers: the info response, then 2*qd rkey responses per connection; connection
	// 0 carries heartbeats and the admin requests (DoAdmin), whose responses may bring keys.
	size := InfoRspSize(qd)
	res.rcvOff = make([]int, len(cons))
	for i := range cons {
		res.rcvOff[i] = size
		size += 2 * qd * rkeyRspSize
	}
	if res.rcv, err = res.pd.AllocMR(size, rdma.AccessLocalWrite); err != nil {
		return err
	}
	p.rbufs = make([]rbuf, qd)
	// Receives are consumed in order: connection 0 takes the INFO_RSP first.
	if _, err := cons[0].qp.PostRecv([]rdma.RecvWR{{ID: wrInfo, SGList: []rdma.SGE{rdma.SGEOf(res.rcv, 0, InfoRspSize(qd))}}}); err != nil {
		return err
	}
	for i, c := range cons {
		var wc [32]rdma.WC
		c.sigInterval = min(qd, ServiceConQD)
		c.cq.SetHandler(func() { p.onCompletions(c, wc[:]) })
		n := 2 * qd
		if i == 0 && len(cons) > 1 {
			n = min(n, 2*ServiceConQD) // the admin connection's queue (sized before qd is known)
		}
		wrs := make([]rdma.RecvWR, n)
		for j := range wrs {
			wrs[j].ID = wrRecv | uint64(j)
			if res.newRkey {
				wrs[j].SGList = []rdma.SGE{rdma.SGEOf(res.rcv, res.rcvOff[i]+j*rkeyRspSize, rkeyRspSize)}
			}
		}
		if _, err := c.qp.PostRecv(wrs); err != nil {
			return err
		}
	}
	return nil
}

// infoExchange sends INFO_REQ and waits for INFO_RSP (the path becomes CONNECTED there).
func (p *Path) infoExchange(ctx context.Context) error {
	s := p.sess
	p.mu.Lock()
	c0, res := p.cons[0], p.res
	p.infoErr = nil
	p.mu.Unlock()
	b, err := (&MsgInfoReq{PathName: s.opts.SessName}).Marshal()
	if err != nil {
		return err
	}
	copy(res.iu.Bytes(), b) // permit 0's header space is free until the path is up
	if _, err := c0.qp.PostSend([]rdma.SendWR{{ID: wrInfo, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(res.iu, 0, len(b))}}}); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() {
		p.mu.Lock()
		p.stateCond.Broadcast()
		p.mu.Unlock()
	})
	defer stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.state == StateConnecting && ctx.Err() == nil {
		p.stateCond.Wait()
	}
	if p.state != StateConnected {
		if p.infoErr != nil {
			return fmt.Errorf("rtrs: INFO_RSP refused: %w: %w", p.infoErr, syscall.ECONNRESET)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("rtrs: no INFO_RSP: %w", syscall.ETIMEDOUT)
		}
		// INFO_RSP carries no errno: a server that refuses the session by name (one used by
		// another client), by its bounds or its ACL disconnects, and only its log says why.
		return fmt.Errorf("rtrs: info exchange failed (the server ended the connection: a session name another client uses, or one of its bounds, refuses so; its log says which): %w", syscall.ECONNRESET)
	}
	return nil
}

// infoRsp validates INFO_RSP and maps the chunks (process_info_rsp).
func (p *Path) infoRsp(w rdma.WC) {
	s := p.sess
	p.mu.Lock()
	res := p.res
	p.mu.Unlock()
	if res == nil {
		return // torn down while the handler still drained: nobody waits for it
	}
	var m MsgInfoRsp
	err := m.Unmarshal(res.rcv.Bytes()[:w.ByteLen], s.queueDepth)
	if err == nil {
		err = p.mapChunks(m.Desc)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.infoErr = err
	if err != nil {
		p.lg().WithError(err).Warn("bad INFO_RSP")
		p.setStateLocked(StateConnectingErr)
		return
	}
	p.setStateLocked(StateConnected)
}

func (p *Path) mapChunks(desc []SgDesc) error {
	s := p.sess
	p.mu.Lock()
	cs := p.res.chunk
	p.mu.Unlock()
	qd := s.queueDepth
	if len(desc) == 0 || qd%len(desc) != 0 {
		return fmt.Errorf("%d descriptors for queue depth %d: %w", len(desc), qd, ErrMsg)
	}
	if ChunkBits(len(desc))+ChunkBits(cs) > maxImmPayloadBits {
		return fmt.Errorf("%d descriptors of chunk %d break the 28-bit rule: %w", len(desc), cs, ErrMsg)
	}
	k, total := 0, 0
	for _, d := range desc {
		if d.Len == 0 || int(d.Len)%cs != 0 {
			return fmt.Errorf("descriptor of %d bytes: %w", d.Len, ErrMsg)
		}
		for off := 0; off < int(d.Len); off += cs {
			if k == qd {
				return fmt.Errorf("more chunks than the queue depth: %w", ErrMsg)
			}
			p.rbufs[k].addr = d.Addr + uint64(off)
			p.rbufs[k].rkey.Store(d.Key)
			k++
		}
		total += int(d.Len)
	}
	if k != qd || total != qd*cs {
		return fmt.Errorf("%d chunks mapped of %d: %w", k, qd, ErrMsg)
	}
	return nil
}

// watch turns a connection's disconnect into error recovery.
func (p *Path) watch(c *con) {
	ev, ok := <-c.id.Events()
	if ok && ev.Type == rdma.EventDisconnected {
		why := "no error reported"
		if ev.Err != nil {
			why = ev.Err.Error()
		}
		p.errRecovery(fmt.Errorf("connection %d disconnected (%s): %w", c.cid, why, syscall.ECONNRESET))
	}
}

// errRecovery starts error recovery of a connected path (rtrs_rdma_error_recovery).
func (p *Path) errRecovery(cause error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.state {
	case StateConnected:
		p.Stats.Down[downCause(cause)].Inc()
		p.setStateLocked(StateReconnecting)
		p.lg().WithError(cause).Warn("path down")
		p.startWorkerLocked()
	case StateConnecting:
		// The connect fails with its own error; this is why (a peer's protocol violation,
		// a disconnect), which it would not say.
		p.lg().WithError(cause).Warn("connect failed")
		p.setStateLocked(StateConnectingErr)
	}
}

// downCause classifies the cause of an error recovery (stats.Down*).
func downCause(err error) int {
	switch {
	case errors.Is(err, syscall.ETIMEDOUT):
		return stats.DownHeartbeat
	case errors.Is(err, syscall.ECONNRESET):
		return stats.DownDisconnect
	case errors.Is(err, syscall.EIO):
		return stats.DownCompletion
	case errors.Is(err, syscall.EPROTO):
		return stats.DownProtocol
	}
	return stats.DownOther
}

// startWorkerLocked runs the recovery and reconnect loop unless it already runs.
func (p *Path) startWorkerLocked() {
	if p.worker {
		return
	}
	p.worker = true
	p.workDone = make(chan struct{})
	go p.recoverAndReconnect()
}

// recoverAndReconnect fails the path's requests over, tears it down, and reconnects after
// the delay until it succeeds, the attempts run out or the path is closed.
func (p *Path) recoverAndReconnect() {
	defer func() {
		p.mu.Lock()
		p.worker = false
		close(p.workDone)
		if p.state == StateReconnecting {
			// An error recovery came between the reconnect and this end (a heartbeat lost
			// at once): it found this worker still running and started none, and the path
			// would stay RECONNECTING for good.
			p.startWorkerLocked()
		}
		p.mu.Unlock()
	}()
	p.teardown()
	s := p.sess
	t := s.opts.Timings
	for {
		delay := t.ReconnectDelay + time.Duration(rand.IntN(8))*time.Millisecond
		select {
		case <-time.After(delay):
		case <-p.trigger:
		}
		p.mu.Lock()
		if p.state != StateReconnecting {
			p.mu.Unlock()
			return
		}
		max := uint32(s.maxReconnect.Load())
		if uint32(p.attempts) >= max {
			p.lg().Warnf("no more reconnect attempts (%d), closing the path", p.attempts)
			p.setStateLocked(StateClosing)
			p.setStateLocked(StateClosed)
			p.mu.Unlock()
			return
		}
		p.attempts++
		p.tryStarts++
		p.mu.Unlock()
		if t.ReconnectBackoff > 0 {
			time.Sleep(t.ReconnectBackoff)
		}
		if !p.setState(StateConnecting) {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*t.ConnectTimeout)
		err := p.init(ctx)
		cancel()
		if err == nil {
			p.mu.Lock()
			p.attempts = 0
			p.mu.Unlock()
			p.Stats.ReconnectOK.Inc()
			p.lg().Info("path reconnected")
			p.markUp()
			p.tryEnded()
			return
		}
		p.Stats.ReconnectFail.Inc()
		p.lg().WithError(err).Warn("reconnect failed")
		ok := p.setState(StateReconnecting)
		p.tryEnded()
		if !ok {
			return
		}
	}
}

// tryEnded tells a waiting Reconnect that an attempt has finished, its outcome in the state.
func (p *Path) tryEnded() {
	p.mu.Lock()
	p.tryEnds++
	close(p.tryDone)
	p.tryDone = make(chan struct{})
	p.mu.Unlock()
}

// teardown stops the heartbeat, kills the connections, fails the requests in flight over to
// other paths and releases the connections (the first half of err_recovery_work).
func (p *Path) teardown() {
	p.hb.halt()
	p.mu.Lock()
	cons := p.cons
	p.cons = nil
	res := p.res
	p.res = nil
	p.mu.Unlock()
	for _, c := range cons {
		if c != nil && c.qp != nil {
			c.cq.SetHandler(nil)
			c.qp.ToError()
		}
	}
	p.hb.wait()
	// Posts that found the path connected end before their requests fail over; later ones
	// find p.res nil.
	p.posting.Wait()
	p.failover(cons)
	p.finishInvalidating(cons, res)
	for _, c := range cons {
		if c != nil {
			c.destroy()
		}
	}
	if res != nil {
		n, err := deregAll(res.fr)
		p.sess.dropStaging(res) // after the windows, which may be bound over its regions
		if m, e := deregAll([]rdma.MR{res.iu, res.rcv, res.stage}); m > 0 {
			n, err = n+m, e
		}
		if n > 0 {
			p.lg().WithError(err).Warnf("%d regions not deregistered", n)
		}
		// A reconnect allocates its own: kept, every reconnect of a flapping link would leak
		// one (rxe has 32k).
		if err := res.pd.Dealloc(); err != nil {
			p.lg().WithError(err).Warn("protection domain not freed")
		}
	}
	p.markDown()
}

// markUp counts the path as established; the session's first comes back as RECONNECTED.
func (p *Path) markUp() {
	s := p.sess
	p.mu.Lock()
	up := !p.counted
	p.counted = true
	p.mu.Unlock()
	if up && s.established.Add(1) == 1 && !s.opening.Load() {
		s.linkEvent(LinkReconnected)
	}
}

// markDown stops counting the path; the session's last going is DISCONNECTED.
func (p *Path) markDown() {
	s := p.sess
	p.mu.Lock()
	down := p.counted
	p.counted = false
	p.mu.Unlock()
	if down && s.established.Add(-1) == 0 && !s.closed.Load() {
		s.linkEvent(LinkDisconnected)
	}
}

// close closes the path for good (used by Session.Close, open failure and remove_path).
func (p *Path) close() {
	p.mu.Lock()
	p.setStateLocked(StateClosing)
	w := p.workDone
	p.mu.Unlock()
	select {
	case p.trigger <- struct{}{}:
	default:
	}
	if w != nil {
		<-w
	}
	p.teardown()
	p.mu.Lock()
	p.setStateLocked(StateClosed)
	p.mu.Unlock()
}

// Disconnect closes the path and waits until it is closed; its requests fail over. It stays
// listed and can be revived with Reconnect.
func (p *Path) Disconnect() {
	p.close()
}

// Reconnect tears the path down if it is up, and reconnects it now; it returns when that
// attempt has finished (spec 5.1 reconnect): nil if the path is connected, ErrNotConn if the
// attempt failed (the path then goes on reconnecting after the delay). A path of a closed
// session is ErrClosed.
func (p *Path) Reconnect(ctx context.Context) error {
	p.mu.Lock()
	// A closed session's path would reconnect with no session to serve (and its worker
	// outlive it). Close marks the session before it takes p.mu to close the path, so a
	// Close that comes after this check closes the worker started here.
	if p.sess.closed.Load() {
		p.mu.Unlock()
		return ErrClosed
	}
	switch p.state {
	case StateConnected, StateConnectingErr, StateClosed:
		p.setStateLocked(StateReconnecting)
		p.startWorkerLocked()
	case StateReconnecting:
	default:
		st := p.state
		p.mu.Unlock()
		return fmt.Errorf("%w: path is %v", ErrBusy, st)
	}
	p.attempts = 0
	// The next attempt to end is this write's (one in its backoff now is it: it has not
	// connected yet; one connecting would have made the state CONNECTING, EBUSY above).
	want := p.tryEnds + 1
	p.mu.Unlock()
	select {
	case p.trigger <- struct{}{}:
	default:
	}
	for {
		// Done when that attempt has finished, or when no worker is left (the attempts ran
		// out, or the path closed). A failed attempt leaves the worker reconnecting after the
		// delay, as the kernel's sysfs write leaves its delayed work queued.
		p.mu.Lock()
		over, next, w, st := p.tryEnds >= want || !p.worker, p.tryDone, p.workDone, p.state
		p.mu.Unlock()
		if over {
			if st != StateConnected {
				return ErrNotConn
			}
			return nil
		}
		select {
		case <-next:
		case <-w:
			// The worker that ended may have started another on its way out (an error
			// recovery came as it finished): the check above looks again.
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Remove closes the path and removes it from the session.
func (p *Path) Remove() {
	p.close()
	p.mu.Lock()
	p.setStateLocked(StateDead)
	p.mu.Unlock()
	p.sess.removePath(p)
	p.sess.noteRemoved(p.dst)
}

// hasPath says whether the session has a path other than self to the addresses of pa.
func (s *Session) hasPath(pa PathAddrs, self *Path) bool {
	name := PathName(pa.Src, pa.Dst)
	for _, q := range s.Paths() {
		if q != self && q.Name() == name {
			return true
		}
	}
	return false
}

// removePath takes p out of the session's list.
func (s *Session) removePath(p *Path) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, q := range s.paths {
		if q == p {
			s.setPathsLocked(append(s.paths[:i:i], s.paths[i+1:]...))
			return
		}
	}
}

// noteRemoved records that the operator removed a path to dst (Path.Remove).
func (s *Session) noteRemoved(dst Addr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.removed == nil {
		s.removed = map[string]time.Time{}
	}
	now := time.Now()
	for k, t := range s.removed {
		if now.Sub(t) > s.opts.Timings.ConnectTimeout {
			delete(s.removed, k)
		}
	}
	s.removed[dst.String()] = now
}

// removedRecently says whether a path to dst was removed within the last ConnectTimeout.
func (s *Session) removedRecently(dst Addr) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	t, ok := s.removed[dst.String()]
	return ok && time.Since(t) <= s.opts.Timings.ConnectTimeout
}

// AddPath adds a path and connects it; it returns when the path is connected or failed
// (add_path).
func (s *Session) AddPath(ctx context.Context, pa PathAddrs) (*Path, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	// A path the session lists is refused before anything connects: a second connection
	// from the same address would make the server drop the first. Without a source the
	// name is known only once connected, below.
	if pa.Src.IP.IsValid() {
		if err := s.checkNewPath(PathName(pa.Src, pa.Dst), nil); err != nil {
			return nil, err
		}
	}
	s.mu.RLock()
	n := len(s.paths)
	s.mu.RUnlock()
	p := s.newPath(pa, n == 0)
	// EEXIST from the server for a path to an address this session has just removed is the
	// server still holding that one (`rnbd client path readd`): it goes as soon as the server
	// sees the disconnect, so the add is tried again for a while. Any other EEXIST is the
	// server's answer (the kernel's refuses a path of a second address family so), given at
	// once as the kernel's client gives it.
	deadline := time.Now().Add(s.opts.Timings.ConnectTimeout)
	for {
		err := p.connectFirst(ctx)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EEXIST) || s.hasPath(pa, p) || time.Now().After(deadline) || !s.removedRecently(pa.Dst) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(20 * time.Millisecond):
		}
		p = s.newPath(pa, n == 0)
	}
	p.mu.Lock()
	name := p.name
	p.mu.Unlock()
	if err := s.checkNewPath(name, p); err != nil {
		p.Remove()
		return nil, err
	}
	return p, nil
}

// checkNewPath refuses a path named name that the session lists already, p aside (EEXIST).
func (s *Session) checkNewPath(name string, p *Path) error {
	for _, q := range s.Paths() {
		if q != p && q.Listed() && q.Name() == name {
			return fmt.Errorf("%w: path %s", ErrExists, name)
		}
	}
	return nil
}
