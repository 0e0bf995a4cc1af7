package transport

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/stats"
)

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
	onHost  bool       // the client is on this host (PeerOnHost)
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
	settingUp int                     // connections between setupPath and the end of their addCon
	pdOrphan  rdma.PD                 // the PD of a closed path, freed when the last of them ends
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

// PeerOnHost says whether the client runs on this host, as far as the path's addresses tell:
// its address is a loopback one or the very address it reached. A local client connecting from
// another of the host's addresses is not recognised (that would take the host's address list
// per path).
func (p *SrvPath) PeerOnHost() bool { return p.onHost }

// onHost is PeerOnHost's test, on the path's addresses.
func onHost(src, dst Addr) bool {
	s, d := src.IP.Unmap(), dst.IP.Unmap()
	return s.IsLoopback() || (s.IsValid() && s == d)
}

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

// CurLatency is the path's last heartbeat round trip (0 before the first was answered).
func (p *SrvPath) CurLatency() time.Duration { return time.Duration(p.hb.latency.Load()) }

// refuse logs that the path's client was refused for cause, once per cause and interval.
func (p *SrvPath) refuse(cause, detail string) {
	p.sess.srv.countRefusal(cause)
	p.sess.srv.refusals.Warn(p.lg(), cause, p.src.IP.String(), detail)
}

// addCon creates the QP of connection cid and accepts it.
func (p *SrvPath) addCon(req *rdma.ConnRequest, cid int) error {
	srv := p.sess.srv
	o := srv.opts
	pd, err := p.setupPath(req.ID.Device())
	if err != nil {
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	defer p.setupDone()
	c := &con{cid: cid, id: req.ID, sigInterval: min(o.QueueDepth, ServiceConQD), recvBatch: 1}
	// refuse rejects the request, which destroys its identifier and QP, then the CQ: the
	// other order would reject through an identifier already destroyed.
	refuse := func(errno syscall.Errno) {
		p.sess.srv.reject(req, errno)
		c.id = nil
		c.destroy()
	}
	c.recvWR[0].ID = wrRecv
	for i := range c.emptyWRs {
		c.emptyWRs[i].ID = wrRecv
	}
	// Five per request in both modes, as the kernel sizes it: a response is up to four work
	// requests (data, SEND_WITH_INV, REG_MR, the response) plus the LOCAL_INV taking the
	// chunk back, and only every signal interval's response is signaled, so up to that many
	// responses' work requests wait for one completion. (Three per request filled the queue
	// under the kernel's client at QD32 with always_invalidate off.)
	// An IO connection re-posts its receives in batches (ioRecvs); connection 0's (the
	// service queue, after INFO_REQ) are re-posted one by one.
	recvWR, batch, initial := ioRecvs(o.QueueDepth)
	sendWR := 5*o.QueueDepth + 1
	c.recvBatch = batch
	if cid == 0 {
		// Connection 0 also carries the chunks' registrations in front of INFO_RSP.
		sendWR, recvWR, c.recvBatch = max(sendWR, 1026, o.QueueDepth+ServiceConQD+2), max(recvWR, 1026), 1
	}
	sendWR, recvWR = min(sendWR, 16384), min(recvWR, 16384)
	if c.cq, err = req.ID.Device().CreateCQ(sendWR + recvWR); err != nil {
		p.sess.srv.reject(req, syscall.ENOMEM)
		return err
	}
	if c.qp, err = req.ID.CreateQP(pd, rdma.QPInitAttr{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: sendWR, MaxRecvWR: recvWR, MaxSendSGE: 1, MaxRecvSGE: 1}); err != nil {
		refuse(syscall.ENOMEM)
		return err
	}
	// Connection 0 waits for INFO_REQ; IO connections for requests.
	if cid == 0 {
		_, err = c.qp.PostRecv([]rdma.RecvWR{{ID: wrInfo, SGList: []rdma.SGE{rdma.SGEOf(p.ctlMR, 0, infoReqSize)}}})
	} else {
		err = postEmptyRecvs(c.qp, initial)
	}
	if err != nil {
		refuse(syscall.ENOMEM)
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
	if p.state != srvConnecting {
		// The path closed while this connection was set up: its Close has taken the list
		// of connections it destroys, so this one would be left behind.
		p.mu.Unlock()
		refuse(syscall.ECONNRESET)
		return fmt.Errorf("rtrs: path closed while connection %d was set up: %w", cid, syscall.ECONNRESET)
	}
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

// setupPath allocates the path's protection domain and control buffer, once, and returns
// the PD for the connection being set up, which counts in settingUp until setupDone. The
// chunks come at INFO_REQ (regChunks): a connection request costs no chunk memory.
func (p *SrvPath) setupPath(dev rdma.Device) (rdma.PD, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state != srvConnecting {
		// Its Close may have let the PD go already; a new one would never be freed.
		return nil, fmt.Errorf("rtrs: path closing: %w", syscall.ECONNRESET)
	}
	if p.pd != nil {
		if p.pd.Device().Name() != dev.Name() {
			return nil, fmt.Errorf("rtrs: connection on %s, path on %s", dev.Name(), p.pd.Device().Name())
		}
		p.settingUp++
		return p.pd, nil
	}
	o := p.sess.srv.opts
	pd, err := dev.AllocPD()
	if err != nil {
		return nil, err
	}
	ctl, err := pd.AllocMR(infoReqSize+InfoRspSize(p.nChunkMR())+rkeyRspSize*o.QueueDepth, rdma.AccessLocalWrite)
	if err != nil {
		_ = pd.Dealloc()
		return nil, err
	}
	p.pd, p.ctlMR = pd, ctl
	p.syncLocal = dev.Query().SyncLocalOps
	p.reqs = make([]srvReq, o.QueueDepth)
	for i := range p.reqs {
		p.reqs[i].r.path, p.reqs[i].r.slot, p.reqs[i].id = p, &p.reqs[i], i
	}
	p.settingUp++
	return pd, nil
}

// setupDone ends a connection's setup; the last one frees the PD of a path that closed
// meanwhile (after the QPs made on it: the connection's is stored, and destroyed by Close,
// or refused).
func (p *SrvPath) setupDone() {
	p.mu.Lock()
	p.settingUp--
	var pd rdma.PD
	if p.settingUp == 0 {
		pd, p.pdOrphan = p.pdOrphan, nil
	}
	p.mu.Unlock()
	p.deallocPD(pd)
}

// deallocPD frees pd (nil: nothing), logging a failure.
func (p *SrvPath) deallocPD(pd rdma.PD) {
	if pd == nil {
		return
	}
	if err := pd.Dealloc(); err != nil {
		p.lg().WithError(err).Warn("protection domain not freed")
	}
}

// deregAll deregisters the regions of mrs (nil ones skipped) and counts those that failed,
// with the last error: a region left registered holds its protection domain.
func deregAll(mrs []rdma.MR) (failed int, err error) {
	for _, m := range mrs {
		if m == nil {
			continue
		}
		if e := m.Dereg(); e != nil {
			failed, err = failed+1, e
		}
	}
	return failed, err
}

// nChunkMR is how many regions the chunks are registered as: one per chunk with
// always_invalidate, else one for all.
func (p *SrvPath) nChunkMR() int {
	if o := p.sess.srv.opts; o.AlwaysInvalidate {
		return o.QueueDepth
	}
	return 1
}

// ctl buffer layout: [info request 272][info response][rkey responses qd*8].
func (p *SrvPath) ctlInfoRsp() int { return infoReqSize }

func (p *SrvPath) ctlRkey(id int) int {
	return infoReqSize + InfoRspSize(p.nChunkMR()) + rkeyRspSize*id
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
	case ev := <-c.id.Events():
		if errors.Is(ev.Err, rdma.ErrPeerFault) {
			// An access outside the client's keys or ranges (past a chunk, a READ of one),
			// or a protocol violation, that the provider stopped.
			p.refuse("peer fault", fmt.Sprintf("connection %d: %v", c.cid, ev.Err))
		} else {
			p.lg().WithError(ev.Err).Infof("connection %d disconnected", c.cid)
		}
		p.Close()
	case <-p.closed:
	}
}

// zombieLocked tells whether the path is still connecting more than z after its latest
// connection request (rtrs_srv_check_close_path); p.mu held.
func (p *SrvPath) zombieLocked(z time.Duration) bool {
	return p.state == srvConnecting && (time.Since(p.connStart) > z || time.Since(p.created) >= establishCap*z)
}

// establishCap bounds, in zombie timeouts from its first connection, how long a path may
// take to connect all its connections: the kernel restarts the clock at each connection, so
// that a client trickling one in before each timeout could hold the path (and its session's
// slots) for cid_num timeouts, hours at the default.
const establishCap = 4

// zombieWaitLocked is how long the zombie timer waits now: until a timeout after the latest
// connection, or the cap from the first, whichever is sooner; p.mu held.
func (p *SrvPath) zombieWaitLocked(z time.Duration) time.Duration {
	return min(z, time.Until(p.created.Add(establishCap*z)))
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
	srv, name := p.sess.srv, m.PathName
	if holder := srv.nameHolder(p.sess, name); holder != nil && holder.owner.Key() == p.sess.owner.Key() {
		// The holder may be a session its client has just closed, whose paths' ends this
		// server has not seen yet (an unmap and a map of the same session name, back to
		// back): the path waits for the name a moment, off the completion path. Another
		// identity's holder is refused at once (named).
		srv.mu.Lock()
		if srv.closed {
			srv.mu.Unlock()
			return
		}
		srv.wg.Add(1)
		srv.mu.Unlock()
		go func() {
			defer srv.wg.Done()
			free := srv.waitName(p.sess, name, nameWait)
			if srv.ctx.Err() != nil || !free && !p.sess.holdsName() {
				return // the server or the path went while it waited: nothing to refuse
			}
			p.named(c, name)
		}()
		return
	}
	p.named(c, name)
}

// nameWait bounds how long a path waits for its session name to be let go by another
// session (Server.waitName).
const nameWait = time.Second

// named ends INFO_REQ's handling: the session named, the path established and INFO_RSP sent.
func (p *SrvPath) named(c *con, name string) {
	if !p.nameSession(c.id.RemoteAddr(), name) {
		go p.Close()
		return
	}
	if err := postEmptyRecvs(c.qp, ServiceConQD); err != nil {
		p.lg().WithError(err).Warn("receives not posted, closing the path")
		go p.Close()
		return
	}
	if !p.establish() {
		return
	}
	if err := p.sendInfoRsp(c); err != nil {
		p.lg().WithError(err).Warn("INFO_RSP not sent")
		go p.Close()
		return
	}
	p.startHeartbeat(c)
	p.lg().Info("path connected")
}

// nameSession gives the path's session the name of its INFO_REQ, with the session's chunks
// registered for the path first. It refuses the path (false) when the name is held by
// another live session or, in the names file, by another identity, or when the chunks cannot
// be had.
func (p *SrvPath) nameSession(peer netip.AddrPort, name string) bool {
	srv, ss := p.sess.srv, p.sess
	inUse := func() {
		srv.refuse(peer, "session name in use", fmt.Sprintf("session name %q is used by another client session: %v", name, syscall.EPERM))
	}
	if !srv.nameFree(ss, name) {
		inUse()
		return false
	}
	// Memory first: a session refused for want of it does not take a name.
	if err := p.regChunks(); err != nil {
		cause := "chunk memory"
		if errors.Is(err, errClientMemory) {
			cause = "chunk memory per client"
		}
		srv.refuse(peer, cause, err.Error())
		return false
	}
	if !p.claimName(peer, name) {
		return false
	}
	srv.mu.Lock()
	if !srv.nameFreeLocked(ss, name) {
		srv.mu.Unlock()
		inUse()
		return false
	}
	ss.mu.Lock()
	if ss.name == "" {
		ss.name = name
	}
	ss.mu.Unlock()
	srv.sessNamedLocked(ss)
	srv.mu.Unlock()
	p.logp.Store(p.lg().WithField("session", name))
	return true
}

// claimName claims name in the names file for the owner of a session that has no name yet;
// false when it belongs to another identity or the file has no room. The server's lock is
// not held: a new name is written to the file.
func (p *SrvPath) claimName(peer netip.AddrPort, name string) bool {
	srv, ss := p.sess.srv, p.sess
	ss.mu.Lock()
	named := ss.name != ""
	ss.mu.Unlock()
	if named {
		return true
	}
	errno, err := srv.names.claim(name, ss.owner.Key(), ss.client, srv.liveNames())
	if err != nil {
		p.lg().WithError(err).Warn("session name not saved")
	}
	switch errno {
	case syscall.EPERM:
		srv.refuse(peer, "session name of another identity", fmt.Sprintf("%v asked for session name %q, which belongs to another client: %v", ss.owner, name, errno))
	case syscall.ENOSPC:
		srv.refuse(peer, "session names full", fmt.Sprintf("%v asked for a new session name %q with %d names kept: %v", ss.owner, name, maxNames, errno))
	case syscall.EDQUOT:
		srv.refuse(peer, "session names per client", fmt.Sprintf("%v asked for a new session name %q with %d of its names kept, all in use: %v", ss.owner, name, maxNamesPerOwner, errno))
	}
	return errno == 0
}

// establish marks the path connected, unless it is closing (false): its zombie clock stops,
// its connections stop counting as unfinished, and the session's first connected path is
// reported to the handler.
func (p *SrvPath) establish() bool {
	srv, ss := p.sess.srv, p.sess
	p.mu.Lock()
	if p.state != srvConnecting {
		p.mu.Unlock()
		return false
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
	return true
}

// sendInfoRsp sends INFO_RSP on connection 0: the chunks' addresses and keys, behind the
// registrations of their first keys with always_invalidate.
func (p *SrvPath) sendInfoRsp(c *con) error {
	o := p.sess.srv.opts
	rsp := MsgInfoRsp{}
	cs := o.ChunkSize
	var wrs []rdma.SendWR
	for _, mr := range p.chunkMR {
		key := mr.RKey()
		if o.AlwaysInvalidate {
			// Registered in front of the response on the same queue, so no key is named
			// before it works.
			key = rdma.IncKey(mr.RKey())
			wrs = append(wrs, rdma.SendWR{Opcode: rdma.OpRegMR, MR: mr, Key: key, Access: rdma.AccessLocalWrite | rdma.AccessRemoteWrite})
		}
		rsp.Desc = append(rsp.Desc, SgDesc{Addr: mr.Addr(), Key: key, Len: uint32(mr.Len() / cs * cs)})
	}
	b := rsp.Marshal()
	copy(p.ctlMR.Bytes()[p.ctlInfoRsp():], b)
	// Signaled: the chain's qd+1 slots are freed by its own completion, not held until the
	// connection's next signaled send.
	wrs = append(wrs, rdma.SendWR{ID: wrInfo, Opcode: rdma.OpSend, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(p.ctlMR, p.ctlInfoRsp(), len(b))}})
	_, err := c.qp.PostSend(wrs)
	return err
}

// startHeartbeat starts the path's heartbeat on connection 0; a lost one closes the path.
func (p *SrvPath) startHeartbeat(c *con) {
	t := p.sess.srv.opts.Timings
	p.hb.run(t.HeartbeatInterval, t.HeartbeatMissed, c.postHB, func() {
		p.lg().Warn("heartbeat lost, closing the path")
		go p.Close()
	})
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
		letGo := p.sess.live == 0
		p.sess.mu.Unlock()
		if letGo {
			p.sess.srv.nameLetGo()
		}
		p.zombie.Stop()
		p.hb.halt()
		// All at once: each may wait its write deadline for a peer that does not read, and
		// one after another a path of 257 connections took minutes to close.
		eachCon(cons, func(c *con) {
			if c.qp != nil {
				c.qp.ToError()
			}
		})
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
		eachCon(cons, (*con).destroy)
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
			delete(srv.sessions, sessKey{ss.owner.Key(), ss.uuid})
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
		if n, err := deregAll(mrs); n > 0 {
			p.lg().WithError(err).Warnf("%d regions not deregistered", n)
		}
		p.dropFileMRs()
		p.mu.Lock()
		pd := p.pd
		p.pd = nil // setupPath and the file regions see the state first: nobody takes it now
		if p.settingUp > 0 {
			// A connection being set up may be making its QP on it: the last one frees it.
			p.pdOrphan, pd = pd, nil
		}
		p.mu.Unlock()
		p.deallocPD(pd)
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

// eachCon runs f on every connection of cons (nil ones skipped) at once, and waits for all.
func eachCon(cons []*con, f func(*con)) {
	var wg sync.WaitGroup
	for _, c := range cons {
		if c != nil {
			wg.Add(1)
			go func() {
				defer wg.Done()
				f(c)
			}()
		}
	}
	wg.Wait()
}
