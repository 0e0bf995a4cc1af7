package transport

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

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
		case w.ID == wrInfo && w.Opcode == rdma.WCRecv: // not INFO_RSP's send completion
			p.infoReq(c, w)
		case w.ID&wrKindMask == wrLocalInv:
			p.dispatch(c, int(w.ID&^wrKindMask))
		case w.Opcode == rdma.WCRecvRDMAWithImm:
			p.recvImm(c, w.Imm)
		case w.Opcode == rdma.WCRecv:
			// A SEND after INFO_REQ: the protocol has none (requests and heartbeats are
			// RDMA writes with immediate), and it used up a receive, which is not posted
			// again; enough of them would stall the connection unseen.
			p.refuse("malformed request", fmt.Sprintf("connection %d: a SEND of %d bytes after the info exchange", c.cid, w.ByteLen))
			go p.Close()
		}
	}))
}

// recvImm handles an RDMA_WRITE_WITH_IMM from the client.
func (p *SrvPath) recvImm(c *con, imm uint32) {
	p.hb.missed.Store(0)
	if err := c.repostEmpty(); err != nil {
		p.lg().WithError(err).Warnf("connection %d: receive not posted, closing the path", c.cid)
		go p.Close()
		return
	}
	typ, payload := ImmFields(imm)
	if p.hb.onImm(c, typ) {
		return
	}
	if typ != ImmIOReq {
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
	for spins := 0; !r.busy.CompareAndSwap(false, true); spins++ {
		// The chunk's response is being posted: a client may send its next request as soon
		// as the response lands, before PostSend has returned; it waits the few µs the post
		// has left (the chain must not change under the post). Otherwise a client reuses a
		// chunk only once its request is answered; one that does not could have the same
		// request served over and over, each time held in a queue.
		if !r.posting.Load() || spins >= maxPostingSpins {
			// The post may have ended since the swap failed (it frees the chunk, then
			// clears posting): only a chunk still taken after that is refused.
			if r.busy.CompareAndSwap(false, true) {
				break
			}
			p.refuse("malformed request", fmt.Sprintf("request into chunk %d, whose request is not answered yet", id))
			go p.Close()
			return
		}
		runtime.Gosched()
	}
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
	r.inv[0] = rdma.SendWR{ID: wrLocalInv | uint64(id), Opcode: rdma.OpLocalInv, InvRKey: mr.RKey()}
	if !p.syncLocal {
		r.inv[0].Flags = rdma.SendSignaled
	}
	if _, err := c.qp.PostSend(r.inv[:]); err != nil {
		p.lg().WithError(err).Warnf("connection %d: LOCAL_INV of chunk %d not posted, closing the path", c.cid, id)
		go p.Close()
		return
	}
	if p.syncLocal {
		if mr.Valid() {
			// On a QP already in error the LOCAL_INV was flushed, not run, and the QP reaches
			// no memory: the path is going (a disconnect raced the request). Anything else
			// breaks the provider's word.
			if c.qp.State() != rdma.QPSErr {
				p.lg().Warnf("connection %d: chunk %d's key still valid after a synchronous LOCAL_INV, closing the path", c.cid, id)
			}
			go p.Close()
			return
		}
		p.dispatch(c, int(id))
	}
}

// keepClientKeys, set by a test, answers READs without invalidating the client's key, as a
// server that does not honour RTRS_MSG_NEED_INVAL_F: the client must take the key back.
var keepClientKeys bool

// srvReq is the per-chunk request state of a path.
type srvReq struct {
	r       SrvRequest
	id      int
	off     int
	con     *con
	busy    atomic.Bool // from the request's arrival until its response is posted
	posting atomic.Bool // its response chain is being posted (busy still set)
	needInv bool
	cliKey  uint32
	desc    SgDesc
	hasData bool
	wrs     [4]rdma.SendWR // response chain, reused: posting copies it
	inv     [1]rdma.SendWR // the chunk's LOCAL_INV at arrival (always_invalidate)
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

// AtBurstEnd has fn called once the burst of requests this one came in (one poll of the
// connection's completions) has been handed up, on the same goroutine, so that a handler can
// gather what the burst's requests start (one system call for many). Only from
// Handler.Request, on its goroutine, before it returns: from anywhere else it races with the
// burst's end. False for a request that came through no connection (a test's), and fn is then
// the caller's to call.
func (r *SrvRequest) AtBurstEnd(fn func()) bool {
	if r.slot == nil || r.slot.con == nil {
		return false
	}
	r.slot.con.atEnd = append(r.slot.con.atEnd, fn)
	return true
}

// Session is the request's session.
func (r *SrvRequest) Session() *SrvSess { return r.path.sess }

// Path is the path the request came on.
func (r *SrvRequest) Path() *SrvPath { return r.path }

// ID is the request's chunk (the kernel's buf_id): requests in flight at once have distinct
// IDs, and a client keeps a chunk to one connection of a path.
func (r *SrvRequest) ID() int { return r.slot.id }

// chunk returns chunk id's memory; the path's chunks are registered (regChunks).
func (p *SrvPath) chunk(id int) []byte {
	cs := p.sess.srv.opts.ChunkSize
	return p.mem[id*cs : (id+1)*cs : (id+1)*cs]
}

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
	typ, usrLen := reqHdr(hdr)
	if usrLen > r.off || usrLen > MaxHdrSize {
		p.badRequest(id, fmt.Sprintf("user header of %d bytes at offset %d", usrLen, r.off))
		return
	}
	dataLen := r.off - usrLen
	r.needInv, r.hasData = false, false
	switch typ {
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
			r.needInv, r.cliKey = m.Flags&MsgNeedInvalF != 0 && !keepClientKeys, r.desc.Key
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
	// The chunk is free once the post has read the chain: a request into it that comes
	// before (a client that saw the response while PostSend finishes) waits for that, and
	// one that comes before the response was posted at all is refused; neither can change
	// the chain under the post (a torn SendWR.MR would crash the provider).
	sr.posting.Store(true)
	_, err := c.qp.PostSend(wrs[:n])
	sr.busy.Store(false)
	sr.posting.Store(false)
	if err != nil {
		p.lg().WithError(err).Warn("response not sent")
		go p.Close()
	}
}

// maxPostingSpins bounds how long a request into a chunk whose response is being posted
// waits for the post (a yield each).
const maxPostingSpins = 100000
