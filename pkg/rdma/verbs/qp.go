//go:build verbs

package verbs

// #include "glue.h"
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// recvBit marks a receive's wr_id; the rest of every wr_id is the request's sequence number
// on its queue, which indexes the QP's record of what was posted. A completion's opcode is
// undefined in verbs when it failed; the record says what the request was, and gives back
// the caller's ID.
const recvBit = 1 << 63

// windowChange is what a posted request does to a memory window.
type windowChange struct {
	idx      int
	m        *mr
	old, key uint32
	valid    bool
}

// setState makes key the window's key (found by it in the PD), valid or not, bound to
// QP bound (type 2 only).
func (m *mr) setState(p *pd, valid bool, old, key uint32, bound *qp) {
	m.mu.Lock()
	m.boundQP = bound
	m.mu.Unlock()
	p.rekey(m, old, key)
	m.key.Store(key)
	m.valid.Store(valid)
}

// sent is the record of a posted send work request.
type sent struct {
	id uint64
	op rdma.WCOpcode
	mw *mr // a window this request binds or invalidates
}

// qp is a reliable-connected queue pair created through its connection identifier.
type qp struct {
	id  *connID
	pd  *pd
	qp  *C.struct_ibv_qp
	num uint32
	// calls counts the QP's posts into C (Provider.DataPathCalls).
	calls atomic.Uint64

	mu   sync.Mutex
	dead bool
	// failed: the QP is in error as far as we know (ToError, or an error completion).
	failed  bool
	sq      []sent // ring of MaxSendWR records
	sqHead  uint64 // sequence number of the next send
	sqTail  uint64 // oldest send not known complete
	rq      []uint64
	rqHead  uint64
	rqTail  uint64
	maxSGE  int
	maxRSGE int

	changes []windowChange // scratch of postLocked, under mu

	// C memory for posting, reused under mu.
	gwr    *C.struct_gwr
	chain  *C.struct_ibv_send_wr
	sges   *C.struct_ibv_sge
	grecv  *C.struct_grecv
	rchain *C.struct_ibv_recv_wr
	rsges  *C.struct_ibv_sge
	bad    *C.int // where a post puts the index of the first request not posted
}

// postBatch is how many work requests one post takes from the C buffers; longer chains go
// in pieces (each in order on the queue, which is all a chain promises).
const postBatch = 64

var _ rdma.QP = (*qp)(nil)

func newQP(id *connID, p *pd, c *C.struct_ibv_qp, swr, rwr, ssge, rsge int) *qp {
	q := &qp{id: id, pd: p, qp: c, num: uint32(c.qp_num), sq: make([]sent, swr), rq: make([]uint64, rwr),
		maxSGE: ssge, maxRSGE: rsge}
	q.gwr = (*C.struct_gwr)(C.calloc(postBatch, C.sizeof_struct_gwr))
	q.chain = (*C.struct_ibv_send_wr)(C.calloc(postBatch, C.sizeof_struct_ibv_send_wr))
	q.sges = (*C.struct_ibv_sge)(C.calloc(C.size_t(postBatch*max(ssge, 1)), C.sizeof_struct_ibv_sge))
	q.grecv = (*C.struct_grecv)(C.calloc(postBatch, C.sizeof_struct_grecv))
	q.rchain = (*C.struct_ibv_recv_wr)(C.calloc(postBatch, C.sizeof_struct_ibv_recv_wr))
	q.rsges = (*C.struct_ibv_sge)(C.calloc(C.size_t(postBatch*max(rsge, 1)), C.sizeof_struct_ibv_sge))
	// In C memory, as the rest: a Go variable whose address goes to C is a heap allocation
	// per post.
	q.bad = (*C.int)(C.calloc(1, C.sizeof_int))
	return q
}

func (q *qp) Num() uint32 { return q.num }

func (q *qp) State() rdma.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.dead {
		return rdma.QPSErr
	}
	s := C.rtrs_qp_state(q.qp)
	if s < 0 {
		return rdma.QPSErr
	}
	return rdma.QPState(s)
}

func (q *qp) ToError() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.dead {
		q.failed = true
		C.rtrs_qp_to_error(q.qp)
	}
}

var wcOf = [...]rdma.WCOpcode{
	rdma.OpRDMAWrite: rdma.WCRDMAWrite, rdma.OpRDMAWriteWithImm: rdma.WCRDMAWrite,
	rdma.OpSend: rdma.WCSend, rdma.OpSendWithImm: rdma.WCSend, rdma.OpSendWithInv: rdma.WCSend,
	rdma.OpRDMARead: rdma.WCRDMARead, rdma.OpLocalInv: rdma.WCLocalInv, rdma.OpRegMR: rdma.WCRegMR,
}

// PostSend posts wrs in order. REG_MR binds the region's memory window over the registered
// region under its memory; LOCAL_INV of a window's key invalidates it (a type 1 window by a
// bind of length 0, since type 1 windows cannot be invalidated).
func (q *qp) PostSend(wrs []rdma.SendWR) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.dead {
		return 0, rdma.ErrClosed
	}
	// In pieces of postBatch, each in order on the queue, which is all a chain promises.
	for done := 0; done < len(wrs); {
		n := min(len(wrs)-done, postBatch)
		bad, err := q.postLocked(wrs[done:done+n], done)
		if err != nil {
			return bad, err
		}
		done += n
	}
	return len(wrs), nil
}

// postLocked posts up to postBatch requests; base is the index of wrs[0] in the caller's list.
func (q *qp) postLocked(wrs []rdma.SendWR, base int) (int, error) {
	if free := uint64(len(q.sq)) - (q.sqHead - q.sqTail); uint64(len(wrs)) > free {
		if free == 0 {
			return base, fmt.Errorf("%w: send queue of %d full", rdma.ErrNoMem, len(q.sq))
		}
		bad, err := q.postLocked(wrs[:free], base)
		if err != nil {
			return bad, err
		}
		return base + int(free), fmt.Errorf("%w: send queue of %d full", rdma.ErrNoMem, len(q.sq))
	}
	g := unsafe.Slice(q.gwr, postBatch)
	sges := unsafe.Slice(q.sges, postBatch*max(q.maxSGE, 1))
	ns := 0
	// What the posted requests do to windows, applied once they are on the queue (kept in
	// the QP: a post is on the hot path, and most change nothing).
	changes := q.changes[:0]
	// A request found wrong stops the list there: those before it are posted (as a device
	// refuses at the first bad request of a chain), it and those after it are not.
	n := len(wrs)
	var verr error
build:
	for i := range wrs {
		wr := &wrs[i]
		x := &g[i]
		*x = C.struct_gwr{}
		if wr.Opcode > rdma.OpRegMR {
			verr, n = fmt.Errorf("%w: opcode %v", rdma.ErrInvalid, wr.Opcode), i
			break build
		}
		if len(wr.SGList) > q.maxSGE {
			verr, n = fmt.Errorf("%w: %d SGEs, at most %d", rdma.ErrInvalid, len(wr.SGList), q.maxSGE), i
			break build
		}
		x.wr_id = C.uint64_t(q.sqHead + uint64(i))
		x.op = C.uint32_t(wr.Opcode)
		x.flags = C.uint32_t(wr.Flags)
		x.imm = C.uint32_t(wr.Imm)
		x.remote_addr = C.uint64_t(wr.RemoteAddr)
		x.rkey = C.uint32_t(wr.RKey)
		x.inv_rkey = C.uint32_t(wr.InvRKey)
		x.nsge = C.uint32_t(len(wr.SGList))
		if len(wr.SGList) > 0 {
			x.sge = &sges[ns]
			for _, s := range wr.SGList {
				sges[ns] = C.struct_ibv_sge{addr: C.uint64_t(s.Addr), length: C.uint32_t(s.Length), lkey: C.uint32_t(s.LKey)}
				ns++
			}
		}
		q.sq[(q.sqHead+uint64(i))%uint64(len(q.sq))] = sent{id: wr.ID, op: wcOf[wr.Opcode]}
		if wr.Opcode == rdma.OpRegMR || wr.Opcode == rdma.OpLocalInv {
			var c windowChange
			var err error
			if wr.Opcode == rdma.OpRegMR {
				c, err = q.regMRWR(x, wr)
			} else {
				c, err = q.localInvWR(x, wr)
			}
			if err != nil {
				verr, n = err, i
				break build
			}
			c.idx = i
			changes = append(changes, c)
			q.sq[(q.sqHead+uint64(i))%uint64(len(q.sq))].mw = c.m
		}
	}
	// A PD-wide (type 1) window serves every QP of the PD, so its new state is taken before
	// the post: the chain may carry the new key to the peer, whose next request on another
	// connection can reach that QP's post before this call returns. (Measured: the kernel's
	// client at QD32 did, and the LOCAL_INV taking the chunk back was refused.) Those that end
	// up not posted are put back below.
	for _, c := range changes {
		if !c.m.type2 {
			c.m.setState(q.pd, c.valid, c.old, c.key, nil)
		}
	}
	var rc C.int
	if n > 0 {
		q.calls.Add(1)
		rc = C.rtrs_post_send(handle(q.qp), handle(q.gwr), C.int(n), handle(q.chain), q.bad)
	}
	posted := n
	if rc != 0 {
		posted = int(*q.bad)
	}
	keyErr := q.settleWindows(changes, posted, g)
	q.changes = changes[:0]
	q.sqHead += uint64(posted)
	if rc != 0 {
		return base + posted, fmt.Errorf("verbs: ibv_post_send: %w", errnoOf(rc))
	}
	if verr != nil {
		return base + posted, verr
	}
	return base + posted, keyErr
}

// regMRWR fills x for a REG_MR of wr's fast-reg region (a window bind) and returns what it
// will do to the window, or why wr is refused.
func (q *qp) regMRWR(x *C.struct_gwr, wr *rdma.SendWR) (windowChange, error) {
	m, ok := wr.MR.(*mr)
	if !ok || m.pd != q.pd || m.mw == nil {
		return windowChange{}, fmt.Errorf("%w: REG_MR of a region that is not a fast-reg region of this PD", rdma.ErrInvalid)
	}
	if wr.Access&^accessAll != 0 {
		return windowChange{}, fmt.Errorf("%w: REG_MR access %#x", rdma.ErrInvalid, uint32(wr.Access))
	}
	m.mu.Lock()
	buf, under, old, mw := m.buf, m.base, m.key.Load(), m.mw
	m.mu.Unlock()
	if under == nil || m.valid.Load() {
		return windowChange{}, fmt.Errorf("%w: REG_MR of a region that is not mapped, or still valid", rdma.ErrInvalid)
	}
	if wr.Key>>8 != old>>8 || !m.type2 && wr.Key != rdma.IncKey(old) {
		// A type 1 window's next key is the library's: the low byte plus one.
		return windowChange{}, fmt.Errorf("%w: REG_MR key %#x for a window keyed %#x", rdma.ErrInvalid, wr.Key, old)
	}
	x.mw, x.mr = mw, under.mr
	x.addr = C.uint64_t(uintptr(unsafe.Pointer(&buf[0])))
	x.length = C.uint64_t(len(buf))
	// Local write is the underlying region's; a window grants remote rights.
	x.access = C.uint32_t(ibvAccess(wr.Access &^ rdma.AccessLocalWrite))
	x.new_key = C.uint32_t(wr.Key)
	return windowChange{m: m, old: old, key: wr.Key, valid: true}, nil
}

// localInvWR fills x for a LOCAL_INV of the window wr.InvRKey names and returns what it
// will do to the window, or why wr is refused.
func (q *qp) localInvWR(x *C.struct_gwr, wr *rdma.SendWR) (windowChange, error) {
	m := q.pd.window(wr.InvRKey)
	if m == nil {
		return windowChange{}, fmt.Errorf("%w: LOCAL_INV of key %#x, which names no fast-reg region of this PD (registered regions keep their keys on verbs)", rdma.ErrInvalid, wr.InvRKey)
	}
	m.mu.Lock()
	under, mw := m.base, m.mw
	m.mu.Unlock()
	if !m.valid.Load() || under == nil {
		// Invalidating a window that is not bound is an error on an HCA (and has crashed
		// rxe): refused here.
		return windowChange{}, fmt.Errorf("%w: LOCAL_INV of key %#x, which is not valid", rdma.ErrInvalid, wr.InvRKey)
	}
	if !m.type2 {
		// Unbinding a type 1 window is a bind of length 0, and moves its key on. (rxe's
		// library reads the region of the bind even when its length is 0.)
		x.mw, x.mr = mw, under.mr
		return windowChange{m: m, old: wr.InvRKey, key: rdma.IncKey(wr.InvRKey)}, nil
	}
	return windowChange{m: m, old: wr.InvRKey, key: wr.InvRKey}, nil
}

// settleWindows brings the windows the requests changed to their state once posted requests
// are known: type 1 changes not posted are put back, type 1 keys the library chose are
// taken, type 2 windows follow their posted binds. An error says a library key differed.
func (q *qp) settleWindows(changes []windowChange, posted int, g []C.struct_gwr) error {
	var keyErr error
	for _, c := range changes {
		switch {
		case !c.m.type2 && c.idx >= posted:
			c.m.setState(q.pd, !c.valid, c.key, c.old, nil)
		case !c.m.type2:
			// ibv_bind_mw chose the key (the low byte plus one); the glue kept it.
			if k := uint32(g[c.idx].new_key); k != c.key {
				if keyErr == nil {
					keyErr = fmt.Errorf("verbs: type 1 window bound with key %#x, %#x expected", k, c.key)
				}
				c.m.setState(q.pd, c.valid, c.key, k, nil)
			}
		case c.idx < posted:
			// A QP-bound (type 2) window serves this QP only. Its bind posted by work request
			// leaves the library's copy of the key as it was; the next bind names the window
			// by it, so it must follow.
			var bound *qp
			if c.valid {
				C.rtrs_set_mw_rkey(c.m.mw, C.uint32_t(c.key))
				bound = q
			}
			c.m.setState(q.pd, c.valid, c.old, c.key, bound)
		}
	}
	return keyErr
}

func (q *qp) PostRecv(wrs []rdma.RecvWR) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.dead {
		return 0, rdma.ErrClosed
	}
	for done := 0; done < len(wrs); {
		n := min(len(wrs)-done, postBatch)
		if free := uint64(len(q.rq)) - (q.rqHead - q.rqTail); uint64(n) > free {
			n = int(free)
			if n == 0 {
				return done, fmt.Errorf("%w: receive queue of %d full", rdma.ErrNoMem, len(q.rq))
			}
		}
		g := unsafe.Slice(q.grecv, postBatch)
		sges := unsafe.Slice(q.rsges, postBatch*max(q.maxRSGE, 1))
		ns := 0
		for i, wr := range wrs[done : done+n] {
			if len(wr.SGList) > q.maxRSGE {
				return done + i, fmt.Errorf("%w: %d SGEs, at most %d", rdma.ErrInvalid, len(wr.SGList), q.maxRSGE)
			}
			seq := q.rqHead + uint64(i)
			g[i] = C.struct_grecv{wr_id: C.uint64_t(seq | recvBit), nsge: C.uint32_t(len(wr.SGList))}
			if len(wr.SGList) > 0 {
				g[i].sge = &sges[ns]
			}
			for _, s := range wr.SGList {
				sges[ns] = C.struct_ibv_sge{addr: C.uint64_t(s.Addr), length: C.uint32_t(s.Length), lkey: C.uint32_t(s.LKey)}
				ns++
			}
			q.rq[seq%uint64(len(q.rq))] = wr.ID
		}
		q.calls.Add(1)
		if rc := C.rtrs_post_recv(handle(q.qp), handle(q.grecv), C.int(n), handle(q.rchain), q.bad); rc != 0 {
			bad := int(*q.bad)
			q.rqHead += uint64(bad)
			return done + bad, fmt.Errorf("verbs: ibv_post_recv: %w", errnoOf(rc))
		}
		q.rqHead += uint64(n)
		done += n
	}
	if q.failed {
		// Receives posted to a QP in error must flush. An HCA does that at once; rxe flushes
		// only when its responder runs, which nothing else would make it do now.
		C.rtrs_qp_to_error(q.qp)
	}
	return len(wrs), nil
}

// complete fills in what a completion leaves to the records: the caller's ID and the opcode,
// and frees the queue slots it accounts for. A receive that invalidated one of our windows
// marks it invalid.
func (q *qp) complete(w *rdma.WC, wrID uint64, opcode uint32) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if w.Status != rdma.WCSuccess {
		q.failed = true
	}
	if wrID&recvBit != 0 {
		seq := wrID &^ recvBit
		if seq < q.rqTail || seq >= q.rqHead {
			w.ID = wrID
			return
		}
		w.ID = q.rq[seq%uint64(len(q.rq))]
		q.rqTail = seq + 1
		w.Opcode = rdma.WCRecv
		if w.Status == rdma.WCSuccess && opcode == C.IBV_WC_RECV_RDMA_WITH_IMM {
			w.Opcode = rdma.WCRecvRDMAWithImm
		}
		if w.Flags&rdma.WCWithInv != 0 {
			if m := q.pd.window(w.InvRKey); m != nil {
				m.mu.Lock()
				m.boundQP = nil
				m.mu.Unlock()
				m.valid.Store(false)
			}
		}
		return
	}
	if wrID < q.sqTail || wrID >= q.sqHead {
		w.ID = wrID
		return
	}
	s := q.sq[wrID%uint64(len(q.sq))]
	// Send completions come in order: every earlier request is done too.
	q.sqTail = wrID + 1
	w.ID, w.Opcode = s.id, s.op
	if w.Status != rdma.WCSuccess && s.mw != nil && w.Opcode == rdma.WCRegMR {
		s.mw.valid.Store(false)
	}
}

// destroy frees the C buffers; the identifier destroys the QP itself.
func (q *qp) destroy() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.dead {
		return
	}
	q.dead = true
	q.pd.dev.retire(q)
	for _, p := range []unsafe.Pointer{unsafe.Pointer(q.gwr), unsafe.Pointer(q.chain), unsafe.Pointer(q.sges),
		unsafe.Pointer(q.grecv), unsafe.Pointer(q.rchain), unsafe.Pointer(q.rsges), unsafe.Pointer(q.bad)} {
		C.free(p)
	}
}
