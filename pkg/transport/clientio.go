package transport

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/stats"
)

// cltReq is the state of the request that holds a permit.
type cltReq struct {
	permit int
	dir    Dir
	usr    []byte
	data   []byte
	done   func(error)
	// owner is the connection the request is in flight on; whoever swaps it to nil (the
	// completion or the failover) finishes the request, exactly once.
	owner atomic.Pointer[con]
	// inv is the connection whose LOCAL_INV of the request's key finishes it (a device
	// that executes it after the post: until then the key still reaches the data), and
	// invErrno the server's answer meanwhile; whoever swaps inv to nil finishes it.
	inv      atomic.Pointer[con]
	invErrno int
	// invAfterPost: inv was set by post for a request answered under its PostSend, which
	// the invalidation's completion finishes with answer (recv accounted for it).
	invAfterPost bool
	// posting is set while post is in PostSend with the request's chain; a response that
	// comes meanwhile (a hostile server's before the request has left, or an honest one's
	// to a request that left before PostSend returned: with the soft provider over loopback,
	// often) leaves its outcome in answer and the request to post to finish, so the permit
	// and the chain are not reused under PostSend (the kernel's req->ref).
	posting   atomic.Uint32
	answer    error
	path      *Path
	admin     bool // on connection 0, as RTRS_ADMIN_CON permits are
	countedMI bool
	staged    bool          // the data went through the path's stage (set by post)
	gen       atomic.Uint64 // counts the permit's requests: a waiter tells its own from the next
	// expiries counts the paths its waiter recovered for it (Do past its deadline and
	// grace): the first failover sends it again, on another path; after the second it ends
	// with ETIMEDOUT, since with a path always back in time it bounced between them for ever.
	// One word, gen<<2 | count, so that a count never lands on the permit's next request.
	expiries atomic.Uint64
	start    time.Time
	cpu      int
	wrs      [2]rdma.SendWR // the request chain, reused: posting copies it
	sges     [3]rdma.SGE
}

// Request submits a request: dir READ fills data from the server, WRITE sends it; usr is the
// user header (the server's handler gets both). done is called once with the outcome, unless
// Request returns an error; it must not block. It runs on a goroutine of the transport's or
// of the provider's, which can be that of a caller of Request (the soft provider's posts run
// the completion handlers of what they find queued, another request's done among them) or of
// Path.Disconnect, Path.Remove or Session.Close (their failover finishes what no other path
// takes), so it must not take a lock held across those calls. Request waits for a permit
// until ctx ends.
func (s *Session) Request(ctx context.Context, dir Dir, usr, data []byte, done func(error)) error {
	_, _, err := s.request(ctx, dir, usr, data, done, true, false)
	return err
}

// TryRequest is Request without waiting for a permit: ErrNoPermit when none is free.
func (s *Session) TryRequest(dir Dir, usr, data []byte, done func(error)) error {
	_, _, err := s.request(context.Background(), dir, usr, data, done, false, false)
	return err
}

// Do is the synchronous Request.
func (s *Session) Do(ctx context.Context, dir Dir, usr, data []byte) error {
	return s.do(ctx, dir, usr, data, false)
}

// DoAdmin is Do on connection 0 of a path, where the kernel's users (RNBD's SESS_INFO, OPEN
// and CLOSE) send their control messages with an admin permit.
func (s *Session) DoAdmin(ctx context.Context, dir Dir, usr, data []byte) error {
	return s.do(ctx, dir, usr, data, true)
}

// do waits for the request's end. ctx bounds the wait for a permit; a request posted is
// waited for even when ctx ends (its buffers are the server's to fill until it ends, and a
// daemon stopping still has IO to finish, such as a device's last flush). It gets
// ConnectTimeout more to be answered once ctx has ended (a caller's short deadline is no
// sign of a bad path); then the path that holds it is recovered as one whose heartbeats
// stopped (a server that answers them but not this request is no better), which fails the
// request over or ends it; and so again every ConnectTimeout while it is not answered, but a
// request recovered for twice ends with ETIMEDOUT (sent again each time, it bounced between
// the paths for as long as one came back in time).
func (s *Session) do(ctx context.Context, dir Dir, usr, data []byte, admin bool) error {
	ch := make(chan error, 1)
	r, gen, err := s.request(ctx, dir, usr, data, func(err error) { ch <- err }, true, admin)
	if err != nil {
		return err
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
	}
	grace := time.NewTimer(s.opts.Timings.ConnectTimeout)
	select {
	case err := <-ch:
		grace.Stop()
		return err
	case <-grace.C:
	}
	for {
		// The owner is read before the count: a later request of the permit counts
		// itself before it is posted.
		if c := r.owner.Load(); c != nil && r.gen.Load() == gen {
			if p := s.pathOf(c); p != nil {
				r.expire(gen)
				p.errRecovery(fmt.Errorf("a request unanswered past its caller's deadline (%v): %w", ctx.Err(), syscall.ETIMEDOUT))
			}
		}
		t := time.NewTimer(s.opts.Timings.ConnectTimeout)
		select {
		case err := <-ch:
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// expire counts one recovery of a path for request gen of the permit (nothing if the permit
// has moved on to another request).
func (r *cltReq) expire(gen uint64) {
	for {
		v := r.expiries.Load()
		n := uint64(0)
		if v>>2 == gen {
			n = min(v&3+1, 3)
		} else {
			n = 1
		}
		if r.gen.Load() != gen || r.expiries.CompareAndSwap(v, gen<<2|n) {
			return
		}
	}
}

// expired says whether the permit's current request was recovered for twice.
func (r *cltReq) expired() bool {
	v := r.expiries.Load()
	return v>>2 == r.gen.Load() && v&3 >= 2
}

// pathOf is the path connection c belongs to, if it is still one of the session's.
func (s *Session) pathOf(c *con) *Path {
	for _, p := range s.Paths() {
		p.mu.Lock()
		found := slices.Contains(p.cons, c)
		p.mu.Unlock()
		if found {
			return p
		}
	}
	return nil
}

func (s *Session) request(ctx context.Context, dir Dir, usr, data []byte, done func(error), wait, admin bool) (*cltReq, uint64, error) {
	if err := s.checkRequest(dir, usr, data); err != nil {
		return nil, 0, err
	}
	var permit int
	if wait {
		var ok bool
		if permit, ok = s.permits.tryGet(); !ok {
			s.startWait()
			var err error
			permit, err = s.permits.get(ctx)
			s.plug.waiting.Add(-1)
			if err != nil {
				return nil, 0, err
			}
		}
	} else {
		var ok bool
		if permit, ok = s.permits.tryGet(); !ok {
			return nil, 0, ErrNoPermit
		}
	}
	return s.start(permit, dir, usr, data, done, admin)
}

// checkRequest refuses a request on a closed session, or one too large for its chunks.
func (s *Session) checkRequest(dir Dir, usr, data []byte) error {
	if s.closed.Load() {
		return ErrClosed
	}
	hdr := writeHdrSize
	if dir == Read {
		hdr = ReadHdrSize(1)
	}
	if len(usr)+hdr > MaxHdrSize || len(data) > s.maxIOSize || len(data)+len(usr)+hdr > s.chunkSize {
		return fmt.Errorf("%w: %d data + %d header bytes", ErrMsgSize, len(data), len(usr))
	}
	return nil
}

// startWait counts a caller about to wait for a permit. Permits come back with completions,
// which need what a plug holds; and while anyone waits, nothing is held (the plug is the
// session's: another caller's requests would wait for this caller's Unplug).
func (s *Session) startWait() {
	s.plug.waiting.Add(1)
	s.flushPlugs()
	if s.beforePermitWait != nil {
		s.beforePermitWait()
	}
}

// start sends a request with permit.
func (s *Session) start(permit int, dir Dir, usr, data []byte, done func(error), admin bool) (*cltReq, uint64, error) {
	r := &s.reqs[permit]
	r.dir, r.usr, r.data, r.done, r.admin = dir, usr, data, done, admin
	r.start, r.cpu = time.Now(), stats.CPU()
	gen := r.gen.Add(1)
	if err := s.issue(r, nil, false); err != nil {
		s.failNoPath.Inc()
		r.done = nil // the caller has the error: done is not called as well
		s.finish(r, nil)
		return nil, 0, err
	}
	return r, gen, nil
}

// PermitTicket is a place in the session's permit line, taken by a caller that found no
// permit free and waits for one elsewhere (a device's backlog, on its drainer): a permit put
// after it joined goes to it before any taken later. The kernel's client likewise puts a
// queue on its requeue list the moment a request finds no permit.
type PermitTicket struct {
	s    *Session
	ch   chan int
	used bool
}

// TryRequestOrJoin is TryRequest that, finding no permit free, takes a place in the permit
// line instead of failing: the request is not sent, and the ticket returned is to be used by
// RequestWith or given up by Release.
func (s *Session) TryRequestOrJoin(dir Dir, usr, data []byte, done func(error)) (*PermitTicket, error) {
	if err := s.checkRequest(dir, usr, data); err != nil {
		return nil, err
	}
	permit, ch := s.permits.join()
	if ch != nil {
		s.startWait()
		return &PermitTicket{s: s, ch: ch}, nil
	}
	_, _, err := s.start(permit, dir, usr, data, done, false)
	return nil, err
}

// RequestWith is Request with the permit t stands in line for, which it waits for until ctx
// ends. If ctx ends first, t keeps its place (for RequestWith again, or Release); otherwise t
// is used up, whatever the outcome.
func (s *Session) RequestWith(ctx context.Context, t *PermitTicket, dir Dir, usr, data []byte, done func(error)) error {
	if t.s != s || t.used {
		return fmt.Errorf("%w: a permit ticket of another session, or used", syscall.EINVAL)
	}
	if err := s.checkRequest(dir, usr, data); err != nil {
		t.Release()
		return err
	}
	permit, err := s.permits.wait(ctx, t.ch)
	if err != nil {
		return err
	}
	t.used = true
	s.plug.waiting.Add(-1)
	_, _, err = s.start(permit, dir, usr, data, done, false)
	return err
}

// Release gives up t's place in line, unless it is used up; a permit handed to it goes on.
func (t *PermitTicket) Release() {
	if t.used {
		return
	}
	t.used = true
	t.s.permits.leave(t.ch)
	t.s.plug.waiting.Add(-1)
}

// issue posts r on the first path the policy offers that takes it, skipping skip.
func (s *Session) issue(r *cltReq, skip *Path, failover bool) error {
	sp := s.snap.Load()
	if sp == nil {
		return ErrNoPath
	}
	paths := *sp
	var tried [MaxPathsNum/64 + 1]uint64
	policy := s.Policy()
	for range paths {
		i := s.pick(paths, &tried, policy, skip)
		if i < 0 {
			break
		}
		tried[i/64] |= 1 << (i % 64)
		p := paths[i]
		if p == skip {
			continue
		}
		if err := p.post(r, policy == MinInflight); err == nil {
			if failover {
				p.Stats.Failovered.Inc()
			}
			return nil
		}
	}
	return ErrNoPath
}

// pick returns the next candidate path index, or -1 (the policy iterators of spec 3.6).
func (s *Session) pick(paths []*Path, tried *[MaxPathsNum/64 + 1]uint64, policy Policy, skip *Path) int {
	isTried := func(i int) bool { return tried[i/64]&(1<<(i%64)) != 0 }
	switch policy {
	case RoundRobin:
		// Advances on every step, also over paths that are not connected.
		for range paths {
			i := int(s.rr.Add(1)-1) % len(paths)
			if !isTried(i) {
				return i
			}
		}
		return -1
	default:
		best := -1
		var bestV int64
		for i, p := range paths {
			if isTried(i) || p == skip || p.State() != StateConnected {
				continue
			}
			v := int64(p.Stats.Inflight.Load())
			if policy == MinLatency {
				v = p.hb.latency.Load()
			}
			if best < 0 || v < bestV {
				best, bestV = i, v
			}
		}
		return best
	}
}

// post puts r on this path (rtrs_clt_write_req / rtrs_clt_read_req).
func (p *Path) post(r *cltReq, countMI bool) error {
	s := p.sess
	p.mu.Lock()
	if p.state != StateConnected || p.res == nil {
		p.mu.Unlock()
		return ErrNotConn
	}
	p.posting.Add(1)
	defer p.posting.Done()
	res, cons := p.res, p.cons
	rb := &p.rbufs[r.permit]
	p.mu.Unlock()
	// A permit keeps to one IO connection; the kernel picks it by submitting CPU, which in Go
	// would let a chunk be filled through a different connection each time.
	c := cons[0]
	if len(cons) > 1 && !r.admin {
		c = cons[r.permit%(len(cons)-1)+1]
	}
	iu := res.iu.Bytes()[r.permit*MaxHdrSize : (r.permit+1)*MaxHdrSize]
	n := copy(iu, r.usr)
	wrs := &r.wrs
	k := 0
	var dataSGE rdma.SGE
	r.staged = false
	if len(r.data) > 0 {
		fr := res.fr[r.permit]
		buf := r.data
		var direct rdma.MR
		if res.stage != nil {
			if direct = res.directMR(r.data); direct == nil {
				buf = res.stage.Bytes()[r.permit*s.maxIOSize:][:len(r.data)]
				r.staged = true
				s.staged.Inc()
			}
		}
		switch {
		case direct != nil && r.dir == Write:
			// The caller's registered region: the data goes out from it under its key.
			dataSGE = rdma.SGE{Addr: uint64(uintptr(unsafe.Pointer(&r.data[0]))), Length: uint32(len(r.data)), LKey: direct.LKey()}
		case r.staged && r.dir == Write:
			// Staged: the data goes out from registered memory under its own key.
			copy(buf, r.data)
			dataSGE = rdma.SGE{Addr: res.stage.Addr() + uint64(r.permit*s.maxIOSize), Length: uint32(len(r.data)), LKey: res.stage.LKey()}
		default:
			if fr.Valid() {
				// Still registered from a request that failed over: take it back first.
				if _, err := c.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpLocalInv, InvRKey: fr.RKey()}}); err != nil {
					return err
				}
			}
			if err := fr.Map(buf, uint64(r.permit+1)<<32); err != nil {
				return err
			}
			access := rdma.AccessLocalWrite
			if r.dir == Read {
				access |= rdma.AccessRemoteWrite
			}
			key := rdma.IncKey(fr.LKey())
			wrs[k] = rdma.SendWR{Opcode: rdma.OpRegMR, MR: fr, Key: key, Access: access}
			k++
			dataSGE = rdma.SGE{Addr: fr.Addr(), Length: uint32(len(r.data)), LKey: key}
		}
	}
	wr := &wrs[k]
	k++
	*wr = rdma.SendWR{ID: wrReq | uint64(r.permit), Opcode: rdma.OpRDMAWriteWithImm, Flags: c.signal(), RKey: rb.rkey.Load()}
	if r.dir == Write {
		PutMsgRdmaWrite(iu[n:], uint16(len(r.usr)))
		n += writeHdrSize
		sg := r.sges[:0]
		if len(r.data) > 0 {
			sg = append(sg, dataSGE)
		}
		wr.SGList = append(sg, rdma.SGEOf(res.iu, r.permit*MaxHdrSize, n))
		wr.RemoteAddr = rb.addr
	} else {
		var desc [1]SgDesc
		m := MsgRdmaRead{UsrLen: uint16(len(r.usr))}
		if len(r.data) > 0 {
			m.Flags = MsgNeedInvalF
			desc[0] = SgDesc{Addr: dataSGE.Addr, Key: dataSGE.LKey, Len: dataSGE.Length}
			m.Desc = desc[:]
		}
		m.Put(iu[n:])
		n += ReadHdrSize(len(m.Desc))
		r.sges[2] = rdma.SGEOf(res.iu, r.permit*MaxHdrSize, n)
		wr.SGList = r.sges[2:3]
		wr.RemoteAddr = rb.addr + uint64(len(r.data))
	}
	wr.Imm = IOReqImm(uint32(r.permit), uint32(len(r.data)+len(r.usr)), s.memBits)
	r.path, r.countedMI = p, countMI
	if countMI {
		p.Stats.Inflight.Add(1)
	}
	r.posting.Store(postPosting)
	r.owner.Store(c)
	s.plugCon(c)
	if s.beforePost != nil {
		s.beforePost(r.permit, c.cid)
	}
	if _, err := c.qp.PostSend(wrs[:k]); err != nil && r.owner.CompareAndSwap(c, nil) {
		r.posting.Store(0)
		if countMI {
			p.Stats.Inflight.Add(-1)
		}
		return err
	}
	// Posted, or not but a response took the request (failover waits for the path's posts).
	if !r.posting.CompareAndSwap(postPosting, 0) {
		// Answered under PostSend: finished on a goroutine of its own rather than this
		// one, which may be inside its caller's Request with done's lock held, and followed
		// there by the AfterCompletions hook. An answer that came before the chain's
		// REG_MR had run found no key to take back: the key this post handed the server
		// must not outlive the request, which gives the buffer back to its caller.
		if fr := res.fr[r.permit]; len(r.data) > 0 && fr != nil && fr.Valid() {
			if res.syncLocal {
				_, _ = c.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpLocalInv, InvRKey: fr.RKey()}})
			} else {
				// As in recv: the request waits for the invalidation's completion, which
				// finishes it (invDone; recv accounted for it already).
				// Before the post: its completion may finish the request, and the permit's
				// next request set posting, inside PostSend.
				r.posting.Store(0)
				r.invAfterPost = true
				r.inv.Store(c)
				_, err := c.qp.PostSend([]rdma.SendWR{{ID: wrLocalInv | uint64(r.permit), Opcode: rdma.OpLocalInv, InvRKey: fr.RKey(), Flags: rdma.SendSignaled}})
				if err == nil || !r.inv.CompareAndSwap(c, nil) {
					return nil
				}
				r.invAfterPost = false
				c.qp.ToError()
				p.errRecovery(fmt.Errorf("connection %d: LOCAL_INV of message %d: %w", c.cid, r.permit, err))
			}
		}
		r.posting.Store(0)
		go func(err error) {
			s.finish(r, err)
			s.afterCompletions()
		}(r.answer)
	}
	return nil
}

// States of cltReq.posting.
const (
	postPosting  = 1 // in PostSend
	postAnswered = 2 // and a response has come
)

// answered finishes r with a response's outcome, or leaves that to its post if the post is
// still running.
func (s *Session) answered(r *cltReq, err error) {
	r.answer = err
	if r.posting.CompareAndSwap(postPosting, postPosting|postAnswered) {
		return
	}
	s.finish(r, err)
}

// onCompletions is connection c's completion handler.
func (p *Path) onCompletions(c *con, wc []rdma.WC) {
	p.Stats.HandlerCall(c.drain(wc, func(w rdma.WC) {
		if w.ID&wrKindMask == wrLocalInv {
			p.invDone(c, w)
			return
		}
		if w.Status != rdma.WCSuccess {
			if w.Status != rdma.WCFlushErr {
				p.errRecovery(fmt.Errorf("connection %d: %v completion: %v: %w", c.cid, w.Opcode, w.Status, syscall.EIO))
			}
			return
		}
		if w.Opcode != rdma.WCRecv && w.Opcode != rdma.WCRecvRDMAWithImm {
			return // send completions only free the send queue
		}
		p.hb.missed.Store(0)
		if w.ID == wrInfo {
			p.infoRsp(w)
			return
		}
		p.recv(c, w)
	}))
	p.sess.afterCompletions()
}

// afterCompletions runs the AfterCompletions hook after request callbacks have run: a
// user that gathers what its callbacks produce sends it there, so every goroutine that
// finishes requests calls this after them.
func (s *Session) afterCompletions() {
	if f := s.opts.AfterCompletions; f != nil {
		f()
	}
}

// recv handles a receive completion on c and re-posts the receive.
func (p *Path) recv(c *con, w rdma.WC) {
	s := p.sess
	p.mu.Lock()
	res := p.res
	p.mu.Unlock()
	if res == nil {
		return
	}
	repost := &c.recvWR[0]
	*repost = rdma.RecvWR{ID: w.ID, SGList: repost.SGList[:0]}
	idx := int(w.ID &^ wrKindMask)
	var buf []byte
	if res.newRkey && c.cid < len(res.rcvOff) && idx < 2*s.queueDepth {
		off := res.rcvOff[c.cid] + idx*rkeyRspSize
		repost.SGList = append(repost.SGList, rdma.SGEOf(res.rcv, off, rkeyRspSize))
		buf = res.rcv.Bytes()[off : off+rkeyRspSize]
	}
	if _, err := c.qp.PostRecv(c.recvWR[:]); err != nil {
		p.errRecovery(err)
		return
	}
	if w.Flags&rdma.WCWithImm == 0 {
		return // SEND_WITH_INV: the server released our data key; the response follows
	}
	typ, payload := ImmFields(w.Imm)
	if p.hb.onImm(c, typ) {
		return
	}
	if typ != ImmIORsp && typ != ImmIORspWInv {
		p.errRecovery(fmt.Errorf("unknown immediate %#x: %w", w.Imm, syscall.EPROTO))
		return
	}
	msgID, errno := IORspFields(payload)
	if int(msgID) >= s.queueDepth {
		p.errRecovery(fmt.Errorf("response for message %d: %w", msgID, syscall.EPROTO))
		return
	}
	if w.Opcode == rdma.WCRecv && res.newRkey {
		var rk MsgRkeyRsp
		if buf == nil || w.ByteLen != rkeyRspSize || rk.Unmarshal(buf) != nil || int(rk.BufID) != int(msgID) {
			p.errRecovery(fmt.Errorf("bad rkey response for message %d: %w", msgID, syscall.EPROTO))
			return
		}
		p.rbufs[rk.BufID].rkey.Store(rk.Rkey)
	}
	r := &s.reqs[msgID]
	if !r.owner.CompareAndSwap(c, nil) {
		return // stale: the request was failed over or finished
	}
	// The key is taken back unless the server's SEND_WITH_INV did (the MR is then invalid):
	// an IO_RSP_W_INV alone is the server's word, not the invalidation itself.
	if len(r.data) > 0 && res.fr[r.permit].Valid() {
		c.sendWR[0] = rdma.SendWR{Opcode: rdma.OpLocalInv, InvRKey: res.fr[r.permit].RKey()}
		if !res.syncLocal {
			// The key reaches the data until the device has executed the invalidation:
			// the request, its buffer and its permit wait for the completion, as the
			// kernel's client's do (need_inv_comp), so that a late WRITE of the server's
			// cannot land in the next user of the memory.
			r.invErrno = errno
			r.inv.Store(c)
			c.sendWR[0].ID, c.sendWR[0].Flags = wrLocalInv|uint64(msgID), rdma.SendSignaled
			_, err := c.qp.PostSend(c.sendWR[:])
			if err == nil || !r.inv.CompareAndSwap(c, nil) {
				return
			}
			// Not posted (a send queue full, a QP going): in the error state the QP reaches
			// no memory through any key, so the request may end; the path recovers.
			c.qp.ToError()
			p.errRecovery(fmt.Errorf("connection %d: LOCAL_INV of message %d: %w", c.cid, msgID, err))
		} else {
			_, _ = c.qp.PostSend(c.sendWR[:])
		}
	}
	p.complete(r, res, errno)
}

// complete finishes a request the server answered with errno, its key dead.
func (p *Path) complete(r *cltReq, res *pathRes, errno int) {
	s := p.sess
	if r.staged && r.dir == Read && errno == 0 {
		copy(r.data, res.stage.Bytes()[r.permit*s.maxIOSize:])
	}
	p.account(r)
	if errno != 0 {
		s.failServer.Inc()
	}
	s.answered(r, errnoErr(errno))
}

// invDone handles the completion of a LOCAL_INV posted by recv on c: the request it kept
// is finished, also when the completion is a flush (the QP in error reaches no memory).
func (p *Path) invDone(c *con, w rdma.WC) {
	if w.Status != rdma.WCSuccess && w.Status != rdma.WCFlushErr {
		p.errRecovery(fmt.Errorf("connection %d: LOCAL_INV completion: %v: %w", c.cid, w.Status, syscall.EIO))
	}
	idx := int(w.ID &^ wrKindMask)
	if idx >= p.sess.queueDepth {
		return
	}
	p.mu.Lock()
	res := p.res
	p.mu.Unlock()
	r := &p.sess.reqs[idx]
	// On a path being torn down (res nil) this may run before or after the teardown's
	// sweep (finishInvalidating): whichever takes inv finishes the request.
	if !r.inv.CompareAndSwap(c, nil) {
		return
	}
	p.completeRes(r, res)
}

// completeRes finishes r after its invalidation: a request recv answered, or one answered
// under its post (finished by post's rules); res nil (the path torn down) only for requests
// that need no copy out of the stage, else they fail.
func (p *Path) completeRes(r *cltReq, res *pathRes) {
	if r.invAfterPost {
		r.invAfterPost = false
		p.sess.finish(r, r.answer)
		return
	}
	if res == nil && r.staged && r.dir == Read && r.invErrno == 0 {
		r.invErrno = int(syscall.EIO)
	}
	p.complete(r, res, r.invErrno)
}

// account counts a finished request on the path that carried it.
func (p *Path) account(r *cltReq) {
	if r.countedMI {
		p.Stats.Inflight.Add(-1)
	}
	sg := 0
	if len(r.data) > 0 {
		sg = 1
	}
	p.Stats.Done(r.dir == Read, uint64(len(r.data)+len(r.usr)), time.Since(r.start), r.cpu, stats.CPU(), sg)
}

// finish returns r's permit and calls its callback.
func (s *Session) finish(r *cltReq, err error) {
	done := r.done
	r.done, r.usr, r.data, r.path = nil, nil, nil, nil
	s.permits.put(r.permit)
	if done != nil {
		done(err)
	}
}

// finishInvalidating finishes the requests whose LOCAL_INV on cons had not completed when
// they went to the error state, where their keys reach nothing more (the kernel's client
// finishes them from the flushed completion); res is the path's last resources.
func (p *Path) finishInvalidating(cons []*con, res *pathRes) {
	done := false
	for i := range p.sess.reqs {
		r := &p.sess.reqs[i]
		if c := r.inv.Load(); c != nil && contains(cons, c) && r.inv.CompareAndSwap(c, nil) {
			p.completeRes(r, res)
			done = true
		}
	}
	if done {
		p.sess.afterCompletions()
	}
}

// failover re-issues every request in flight on cons through the other connected paths
// (rtrs_clt_failover_req); those no path takes fail.
func (p *Path) failover(cons []*con) {
	s := p.sess
	failed := false
	for i := range s.reqs {
		r := &s.reqs[i]
		c := r.owner.Load()
		if c == nil || !contains(cons, c) || !r.owner.CompareAndSwap(c, nil) {
			continue
		}
		if r.countedMI {
			p.Stats.Inflight.Add(-1)
		}
		if r.expired() {
			s.finish(r, fmt.Errorf("rtrs: a request unanswered on two paths past its caller's deadline: %w", syscall.ETIMEDOUT))
			failed = true
			continue
		}
		if err := s.issue(r, p, true); err != nil {
			s.failNoPath.Inc()
			s.finish(r, err)
			failed = true
		}
	}
	if failed {
		s.afterCompletions()
	}
}

func contains(cons []*con, c *con) bool {
	for _, x := range cons {
		if x == c {
			return true
		}
	}
	return false
}
