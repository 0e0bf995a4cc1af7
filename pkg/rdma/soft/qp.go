package soft

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/sockread"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Teardown timings: how long an orderly disconnect may spend writing its last frames and
// waiting for the peer's.
const (
	discWriteTimeout = time.Second
	discLinger       = 2 * time.Second
)

// maxRdAtomic is the QP's RDMA READ depth both ways, rxe's max_qp_rd_atom: as requester
// (initiator depth) no more READs than this are on the wire, later requests wait behind the
// one that would pass it; as responder (responder resources) a peer that has more READ
// responses waiting for it to read them is in violation and the QP fails, as an HCA NAKs.
const maxRdAtomic = 128

// sqEntry is one posted send work request.
type sqEntry struct {
	id       uint64
	op       rdma.WCOpcode
	signaled bool
	wire     bool // executed by the responder: done on ACK, READ_RESP or TERMINATE
	seq      uint64
	done     bool
	status   rdma.WCStatus
	byteLen  uint32
	segs     [][]byte // RDMA_READ: where the response lands
}

// rqEntry is one posted receive.
type rqEntry struct {
	id  uint64
	sgl []rdma.SGE
}

type qp struct {
	num        uint32
	dev        *device
	pd         *pd
	scq, rcq   *cq
	maxSendSGE int
	maxRecvSGE int
	rnrRetry   uint8
	rnrTimer   time.Duration

	mu      sync.Mutex
	state   rdma.QPState
	sq      []sqEntry
	sqHead  int
	sqN     int
	sqPops  uint64 // entries drained from the send queue so far: a slot's position over time
	nextSeq uint64 // next request sequence number (from 1)
	// peerAck is an ack the peer sent for requests not yet written whole, held back until
	// they are (ackLocked).
	peerAck uint64
	acked   uint64 // highest of our requests the peer has answered
	ackReq  uint64 // seq of our last frame that asked for an ack
	rq      []rqEntry
	rqHead  int
	rqN     int
	placing bool // the responder loop is moving payload into the head SQ or RQ entry
	// errored mirrors state == QPSErr for the responder's placement of a peer's RDMA WRITE,
	// which holds placingWrite while it reads the payload into local memory: ToError takes
	// it (cutting a placement short), so no write lands through a QP once it is in error.
	errored      atomic.Bool
	placingWrite sync.Mutex
	dead         chan struct{}
	rqAvail      chan struct{}
	shutOnce     sync.Once
	segTmp       []seg    // PostSend scratch for resolved SGEs
	fences       []*qp    // PostSend: QPs found placing into a region it invalidated (fence)
	fenced       []uint64 // PostSend: their LOCAL_INVs, by position (sqPops + offset), done after
	// Initiator depth: READs on the wire whose response has not arrived, and the frames
	// waiting in order behind a READ that would pass maxRdAtomic.
	rdOut   int
	rdDepth int // maxRdAtomic
	held    []heldFrame

	// Set when the connection is established.
	conn   net.Conn
	br     *sockread.Reader
	w      *writer
	events chan rdma.CMEvent
	stop   chan struct{} // stops the flusher
	wg     sync.WaitGroup

	// batching is set while the reader runs completion handlers at the end of a burst: sends
	// they post on this QP wait for the reader's flush, so a burst's answers leave together,
	// except a large frame, which leaves at once (writer.flushLarge).
	batching atomic.Bool
	// plugs counts Plug calls not yet unplugged: posts leave their frames queued.
	plugs atomic.Int32

	// Responder state, owned by the reader goroutine (lastSeq is read by the writer).
	lastSeq  atomic.Uint64 // highest request executed
	ackAsked bool          // the peer asked for an ack it has not been sent
	rdSegs   [][]byte
	rspSeg   [1]seg // a READ response's payload
}

// heldFrame is a request frame waiting for the READ depth to allow it on the wire.
type heldFrame struct {
	h    frameHdr
	segs []seg
	read bool
}

var (
	_ rdma.QP      = (*qp)(nil)
	_ rdma.Plugger = (*qp)(nil)
)

func newQP(dev *device, p *pd, attr rdma.QPInitAttr) (*qp, error) {
	scq, ok1 := attr.SendCQ.(*cq)
	rcq, ok2 := attr.RecvCQ.(*cq)
	switch {
	case !ok1 || !ok2 || scq == nil || rcq == nil:
		return nil, fmt.Errorf("%w: QP needs soft CQs", rdma.ErrInvalid)
	case attr.MaxSendWR < 1 || attr.MaxSendWR > maxQPWR || attr.MaxRecvWR < 1 || attr.MaxRecvWR > maxQPWR:
		return nil, fmt.Errorf("%w: QP depth send %d recv %d (1..%d)", rdma.ErrInvalid, attr.MaxSendWR, attr.MaxRecvWR, maxQPWR)
	case attr.MaxSendSGE < 0 || attr.MaxSendSGE > maxSGE || attr.MaxRecvSGE < 0 || attr.MaxRecvSGE > maxSGE:
		return nil, fmt.Errorf("%w: QP SGEs send %d recv %d (0..%d)", rdma.ErrInvalid, attr.MaxSendSGE, attr.MaxRecvSGE, maxSGE)
	case p.dev != dev:
		return nil, fmt.Errorf("%w: PD of device %s for a connection on %s", rdma.ErrInvalid, p.dev.name, dev.name)
	}
	q := &qp{
		num: dev.qpn.Add(1), dev: dev, pd: p, scq: scq, rcq: rcq,
		maxSendSGE: max(attr.MaxSendSGE, 1), maxRecvSGE: max(attr.MaxRecvSGE, 1),
		rnrRetry: 7, rnrTimer: dev.prov.opts.RNRTimer,
		state: rdma.QPSInit, sq: make([]sqEntry, attr.MaxSendWR), rq: make([]rqEntry, attr.MaxRecvWR),
		nextSeq: 1, rdDepth: maxRdAtomic, dead: make(chan struct{}), rqAvail: make(chan struct{}, 1),
		events: make(chan rdma.CMEvent, 2), stop: make(chan struct{}),
	}
	for i := range q.sq {
		q.sq[i].segs = make([][]byte, 0, q.maxSendSGE)
	}
	for i := range q.rq {
		q.rq[i].sgl = make([]rdma.SGE, 0, q.maxRecvSGE)
	}
	q.segTmp = make([]seg, 0, q.maxSendSGE)
	q.rdSegs = make([][]byte, 0, max(q.maxRecvSGE, q.maxSendSGE))
	return q, nil
}

func (q *qp) Num() uint32 { return q.num }

func (q *qp) State() rdma.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.state
}

// start runs the queue pair over an established connection.
func (q *qp) start(conn net.Conn, br *sockread.Reader, rnrRetry uint8) {
	q.mu.Lock()
	q.conn, q.br = conn, br
	q.rnrRetry = min(rnrRetry, 7)
	q.w = newWriter(conn, &q.lastSeq, q.writeFailed)
	q.w.onSent = q.sentMoved
	if q.state == rdma.QPSInit {
		q.state = rdma.QPSRTS
	}
	q.mu.Unlock()
	q.wg.Add(2)
	go func() { defer q.wg.Done(); q.w.run(q.stop) }()
	go func() { defer q.wg.Done(); q.readLoop() }()
}

// notify runs the completion handlers of the QP's queues; called with no lock held after
// anything that may have queued completions.
func (q *qp) notify() {
	q.scq.runHandler()
	if q.rcq != q.scq {
		q.rcq.runHandler()
	}
}

// wireOp maps a send opcode to its frame opcode and completion opcode.
func wireOp(op rdma.Opcode) (frameOp, rdma.WCOpcode, bool) {
	switch op {
	case rdma.OpSend:
		return fSend, rdma.WCSend, true
	case rdma.OpSendWithImm:
		return fSendImm, rdma.WCSend, true
	case rdma.OpSendWithInv:
		return fSendInv, rdma.WCSend, true
	case rdma.OpRDMAWrite:
		return fWrite, rdma.WCRDMAWrite, true
	case rdma.OpRDMAWriteWithImm:
		return fWriteImm, rdma.WCRDMAWrite, true
	case rdma.OpRDMARead:
		return fReadReq, rdma.WCRDMARead, true
	}
	return 0, 0, false
}

func (q *qp) PostSend(wrs []rdma.SendWR) (int, error) {
	q.mu.Lock()
	if q.state != rdma.QPSRTS && q.state != rdma.QPSErr {
		st := q.state
		q.mu.Unlock()
		return 0, fmt.Errorf("%w: post send on a QP in state %v", rdma.ErrInvalid, st)
	}
	queued, failed := false, false
	for i := range wrs {
		wr := &wrs[i]
		if len(wr.SGList) > q.maxSendSGE {
			return q.endPost(queued, failed, i, fmt.Errorf("%w: %d SGEs, QP allows %d", rdma.ErrInvalid, len(wr.SGList), q.maxSendSGE))
		}
		fop, wcop, wire := wireOp(wr.Opcode)
		switch {
		case wire:
		case wr.Opcode == rdma.OpLocalInv:
			wcop = rdma.WCLocalInv
		case wr.Opcode == rdma.OpRegMR:
			wcop = rdma.WCRegMR
			if wr.MR == nil {
				return q.endPost(queued, failed, i, fmt.Errorf("%w: REG_MR without an MR", rdma.ErrInvalid))
			}
		default:
			return q.endPost(queued, failed, i, fmt.Errorf("%w: opcode %v", rdma.ErrInvalid, wr.Opcode))
		}
		if q.sqN == len(q.sq) {
			return q.endPost(queued, failed, i, fmt.Errorf("%w: send queue of %d full", rdma.ErrNoMem, len(q.sq)))
		}
		e := &q.sq[(q.sqHead+q.sqN)%len(q.sq)]
		q.sqN++
		*e = sqEntry{id: wr.ID, op: wcop, signaled: wr.Flags&rdma.SendSignaled != 0, segs: e.segs[:0]}
		if q.state == rdma.QPSErr {
			e.done, e.status = true, rdma.WCFlushErr
			continue
		}
		if !wire {
			if wr.Flags&rdma.SendSignaled != 0 && q.sqN > 1 && q.nextSeq-1 > q.acked && q.ackReq < q.nextSeq-1 {
				// Completions are reported in order: a signaled local operation behind
				// requests the peer has not acknowledged needs that acknowledgement to
				// complete, and no question asked so far covers all of them. (Unsignaled
				// ones report nothing; their slots come back with later completions.)
				q.ackReq = q.nextSeq - 1
				q.sendLocked(frameHdr{op: fAck, flags: flagAckReq}, nil, false)
				queued = true
			}
			e.done = true
			ok := false
			if wr.Opcode == rdma.OpLocalInv {
				var placers []*qp
				ok, placers = q.dev.invalidate(q.pd, nil, wr.InvRKey)
				if len(placers) > 0 {
					// Complete only once the placements are cut (endPost): no completion of
					// it may be seen while a byte can still land under the key.
					e.done = false
					q.fences = append(q.fences, placers...)
					q.fenced = append(q.fenced, q.sqPops+uint64(q.sqN-1))
				}
			} else {
				ok = q.dev.register(q.pd, q, wr.MR, wr.Key, wr.Access)
			}
			if !ok {
				e.status = rdma.WCLocProtErr
				q.errorLocked()
				failed = true
			}
			continue
		}
		if q.queueWire(e, wr, fop) {
			queued = true
		} else {
			q.errorLocked()
			failed = true
		}
	}
	return q.endPost(queued, failed, len(wrs), nil)
}

// endPost ends a PostSend that took n requests, all of them or those before one it refused
// with err: what was queued is written, a local error shuts the QP down, and the handlers run
// for the completions reported (a refusal's too: a flushed request's completion on a QP in
// error would otherwise wait for the next post).
func (q *qp) endPost(queued, failed bool, n int, err error) (int, error) {
	fences, fenced := q.fences, q.fenced
	q.fences, q.fenced = nil, nil
	q.finishPost(queued)
	if len(fences) > 0 {
		// A LOCAL_INV is complete once no write lands under its key: its entry is done now
		// (unless a flush has finished it meanwhile, or it has left the queue so).
		fence(fences)
		q.mu.Lock()
		for _, pos := range fenced {
			if pos >= q.sqPops {
				if e := &q.sq[(q.sqHead+int(pos-q.sqPops))%len(q.sq)]; !e.done {
					e.done = true
				}
			}
		}
		q.drainLocked()
		q.mu.Unlock()
	}
	if failed {
		// A local error kills the QP; the peer learns through the disconnect.
		q.shutdown(nil)
	}
	q.notify()
	return n, err
}

// queueWire resolves a request's local memory and queues its frame; false marks the entry
// failed (local protection or length error).
func (q *qp) queueWire(e *sqEntry, wr *rdma.SendWR, fop frameOp) bool {
	need := rdma.Access(0)
	if fop == fReadReq {
		need = rdma.AccessLocalWrite
	}
	segs := q.segTmp[:0]
	fail := func(st rdma.WCStatus) bool {
		releaseAll(segs)
		e.done, e.status = true, st
		return false
	}
	var total uint64
	for _, s := range wr.SGList {
		if fs, st, ok := q.dev.resolveFile(q.pd, s.LKey, s.Addr, s.Length); ok {
			// A file region is a source only: what lands in local memory needs memory.
			if st == rdma.WCSuccess && need != 0 {
				fs.release()
				st = rdma.WCLocProtErr
			}
			if st != rdma.WCSuccess {
				return fail(st)
			}
			segs = append(segs, fs)
			total += uint64(s.Length)
			continue
		}
		b, st := q.dev.resolve(q.pd, nil, s.LKey, s.Addr, s.Length, need)
		if st != rdma.WCSuccess {
			return fail(st)
		}
		segs = append(segs, seg{b: b})
		total += uint64(s.Length)
	}
	if total > maxMsgSize {
		return fail(rdma.WCLocLenErr)
	}
	e.wire, e.seq, e.byteLen = true, q.nextSeq, uint32(total)
	q.nextSeq++
	h := frameHdr{op: fop, len: uint32(total), seq: e.seq}
	if wr.Flags&rdma.SendSolicited != 0 {
		h.flags |= flagSolicited
	}
	// Ask for an ack when the poster wants a completion, or when half the send queue awaits
	// one (unsignaled requests free their slots through it); one such question at a time.
	if e.signaled || (e.seq-q.acked >= uint64(len(q.sq)/2) && q.ackReq <= q.acked) {
		h.flags |= flagAckReq
		q.ackReq = e.seq
	}
	switch fop {
	case fSendImm, fWriteImm:
		h.imm = wr.Imm
	case fSendInv:
		h.imm = wr.InvRKey
	}
	if fop == fWrite || fop == fWriteImm || fop == fReadReq {
		h.rkey, h.addr = wr.RKey, wr.RemoteAddr
	}
	if fop == fReadReq {
		for _, s := range segs {
			e.segs = append(e.segs, s.b)
		}
		segs = segs[:0]
	}
	q.sendLocked(h, segs, fop == fReadReq)
	clear(q.segTmp[:cap(q.segTmp)])
	return true
}

// sendLocked queues a request frame, or holds it while the READ depth is reached and behind
// frames already held; q.mu is held.
func (q *qp) sendLocked(h frameHdr, segs []seg, read bool) {
	if len(q.held) == 0 && (!read || q.rdOut < q.rdDepth) {
		if read {
			q.rdOut++
		}
		q.w.add(&h, segs)
		return
	}
	q.held = append(q.held, heldFrame{h: h, segs: append([]seg(nil), segs...), read: read})
}

// releaseHeldLocked queues the held frames the READ depth now allows; q.mu is held.
func (q *qp) releaseHeldLocked() {
	for len(q.held) > 0 {
		f := &q.held[0]
		if f.read && q.rdOut >= q.rdDepth {
			return
		}
		if f.read {
			q.rdOut++
		}
		q.w.add(&f.h, f.segs)
		q.held[0] = heldFrame{}
		q.held = q.held[1:]
	}
	q.held = nil
}

// finishPost reports local completions and writes the queued frames; it releases q.mu.
func (q *qp) finishPost(queued bool) {
	q.drainLocked()
	w := q.w
	q.mu.Unlock()
	// Enqueued before the flags are read: if the reader is still batching, its flush after
	// clearing the flag takes these frames along, and so does the last Unplug. A large frame
	// posted while the reader batches (by its handlers, or by any poster in that window)
	// leaves now, unless plugged.
	if queued && q.plugs.Load() == 0 {
		if !q.batching.Load() {
			w.flush()
		} else {
			w.flushLarge()
		}
	}
}

// Plug holds back the frames of later posts (rdma.Plugger).
func (q *qp) Plug() { q.plugs.Add(1) }

// Unplug ends a Plug; the last one sends what was held.
func (q *qp) Unplug() {
	if q.plugs.Add(-1) == 0 {
		if w := q.writer(); w != nil {
			w.flush()
		}
	}
}

func (q *qp) PostRecv(wrs []rdma.RecvWR) (int, error) {
	defer q.notify()
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state == rdma.QPSReset {
		return 0, fmt.Errorf("%w: post recv on a QP in state RESET", rdma.ErrInvalid)
	}
	for i := range wrs {
		wr := &wrs[i]
		if len(wr.SGList) > q.maxRecvSGE {
			return i, fmt.Errorf("%w: %d SGEs, QP allows %d", rdma.ErrInvalid, len(wr.SGList), q.maxRecvSGE)
		}
		if q.rqN == len(q.rq) {
			return i, fmt.Errorf("%w: receive queue of %d full", rdma.ErrNoMem, len(q.rq))
		}
		if q.state == rdma.QPSErr {
			q.rcq.push(rdma.WC{ID: wr.ID, Status: rdma.WCFlushErr, Opcode: rdma.WCRecv, QPNum: q.num})
			continue
		}
		e := &q.rq[(q.rqHead+q.rqN)%len(q.rq)]
		e.id = wr.ID
		e.sgl = append(e.sgl[:0], wr.SGList...)
		q.rqN++
	}
	select {
	case q.rqAvail <- struct{}{}:
	default:
	}
	return len(wrs), nil
}

// drainLocked reports, in order, the completions of finished send requests at the head.
func (q *qp) drainLocked() {
	for q.sqN > 0 {
		e := &q.sq[q.sqHead]
		if !e.done {
			return
		}
		if e.signaled || e.status != rdma.WCSuccess {
			q.scq.push(rdma.WC{ID: e.id, Status: e.status, Opcode: e.op, ByteLen: e.byteLen, QPNum: q.num})
		}
		clear(e.segs)
		q.sqHead = (q.sqHead + 1) % len(q.sq)
		q.sqN--
		q.sqPops++
	}
}

// errorLocked moves the QP to the error state and flushes its queues, unless the responder loop
// is placing data into a head entry: then it flushes when it is done.
func (q *qp) errorLocked() {
	if q.state == rdma.QPSErr {
		return
	}
	q.state = rdma.QPSErr
	q.errored.Store(true)
	close(q.dead)
	for _, f := range q.held {
		releaseAll(f.segs)
	}
	q.held = nil
	if !q.placing {
		q.flushLocked()
	}
}

// flushLocked completes every outstanding request with a flush error.
func (q *qp) flushLocked() {
	for i := 0; i < q.sqN; i++ {
		e := &q.sq[(q.sqHead+i)%len(q.sq)]
		if !e.done {
			e.done, e.status = true, rdma.WCFlushErr
		}
	}
	q.drainLocked()
	for q.rqN > 0 {
		e := &q.rq[q.rqHead]
		q.rcq.push(rdma.WC{ID: e.id, Status: rdma.WCFlushErr, Opcode: rdma.WCRecv, QPNum: q.num})
		q.rqHead = (q.rqHead + 1) % len(q.rq)
		q.rqN--
	}
}

// ToError moves the QP to error and tears the connection down. When it returns, no peer's
// RDMA WRITE lands in local memory through this QP any more, as on a real QP: RTRS fails the
// requests of a dead connection over to another path right after, and the memory they are
// answered in must not be written by the dead one's responder meanwhile.
func (q *qp) ToError() {
	q.mu.Lock()
	q.errorLocked()
	conn := q.conn
	q.mu.Unlock()
	if !q.placingWrite.TryLock() {
		// A placement is reading its payload: cut it short (the QP is in error, the rest
		// of the stream is dropped anyway) and wait for it to end.
		if conn != nil {
			_ = conn.SetReadDeadline(time.Now())
		}
		if !lockWithin(&q.placingWrite, discWriteTimeout) {
			// Out of the deadline's reach: TLS answering a KeyUpdate inside the read, on
			// a socket the peer does not read. Failing the writes and closing the
			// connection frees it, as Destroy would.
			if conn != nil {
				// The socket itself: a TLS close would first try to send close_notify
				// to the peer that does not read.
				raw := conn
				if tc, ok := conn.(interface{ NetConn() net.Conn }); ok {
					raw = tc.NetConn()
				}
				_ = raw.SetWriteDeadline(time.Now())
				_ = raw.Close()
			}
			q.placingWrite.Lock()
		}
	}
	q.placingWrite.Unlock()
	q.notify()
	q.shutdown(nil)
}

// lockWithin takes mu if it can within d, looking every millisecond (a teardown's rare
// wait, not worth a goroutine that would outlive a failure).
func lockWithin(mu *sync.Mutex, d time.Duration) bool {
	for t0 := time.Now(); !mu.TryLock(); time.Sleep(time.Millisecond) {
		if time.Since(t0) > d {
			return false
		}
	}
	return true
}

// shutdown ends the connection once: it sends term (if any) and a DISCONNECT, closes the write
// side and gives the peer discLinger to close its own before the reader gives up.
func (q *qp) shutdown(term *frameHdr) {
	q.mu.Lock()
	conn, w := q.conn, q.w
	q.mu.Unlock()
	if conn == nil {
		return
	}
	q.shutOnce.Do(func() {
		_ = conn.SetWriteDeadline(time.Now().Add(discWriteTimeout))
		if term != nil {
			w.add(term, nil)
		}
		w.add(&frameHdr{op: fDisc}, nil)
		w.flushSync()
		if cw, ok := conn.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite() // a TCP socket, or TLS (close_notify, then the socket's)
		}
		_ = conn.SetReadDeadline(time.Now().Add(discLinger))
	})
}

// writeFailed handles a failed socket write: the connection is gone.
func (q *qp) writeFailed(err error) {
	q.mu.Lock()
	q.errorLocked()
	conn := q.conn
	q.mu.Unlock()
	q.notify()
	_ = conn.Close() // wakes the reader
}

// errPeer marks protocol violations by the peer.
var errPeer = fmt.Errorf("soft-rdma: protocol violation by peer: %w", rdma.ErrPeerFault)

// readLoop is the responder and the requester's completion engine: it executes the peer's
// requests against local memory and completes ours from the peer's answers.
func (q *qp) readLoop() {
	var hb [hdrLen]byte
	var err error
	frames := 0
	for err == nil {
		if q.br.Buffered() == 0 || frames >= burstFrames {
			// End of what arrived together: run the handlers once for all of it.
			frames = 0
			q.endBurst()
		}
		if err = q.br.ReadFull(hb[:]); err != nil {
			break
		}
		frames++
		var h frameHdr
		if h, err = decodeHdr(hb[:]); err != nil {
			q.fatal(0, 0, err)
			break
		}
		raceAcquire(q.w.raceAddr)
		err = q.handle(&h)
		// What this frame wrote into memory is ordered before whatever is received later,
		// on any connection: a request failed over from a dying connection lands in the
		// same chunk through another one, after this.
		raceRelease(q.w.raceAddr)
	}
	q.mu.Lock()
	q.errorLocked()
	if q.placing {
		q.placing = false
		q.flushLocked()
	}
	q.mu.Unlock()
	q.notify()
	q.shutdown(nil)
	// What the peer sent after the frame we failed on is read and dropped until it closes
	// (or discLinger ends): closing a socket with unread data sends a reset, and a reset can
	// make the peer's kernel drop our TERMINATE before its reader sees it.
	_, _ = io.Copy(io.Discard, q.br)
	close(q.stop)
	_ = q.conn.Close()
	var ev rdma.CMEvent
	ev.Type = rdma.EventDisconnected
	if !errors.Is(err, errDisconnected) {
		ev.Err = err
	}
	q.events <- ev
}

// burstFrames bounds how many frames the reader executes before it runs the handlers.
const burstFrames = 64

// endBurst runs the completion handlers for what the reader executed since the last burst and
// writes what they posted on this QP in one go.
func (q *qp) endBurst() {
	q.batching.Store(true)
	q.notify()
	q.batching.Store(false)
	if q.ackAsked {
		// Also when the burst ends at a wait for a receive: the peer's completions of what
		// was executed before it must not wait for that receive (waitRecv).
		q.ackAsked = false
		q.w.requestAck()
	}
	q.w.flush()
}

// errDisconnected ends the read loop after an orderly disconnect.
var errDisconnected = errors.New("soft-rdma: disconnected")

func (q *qp) handle(h *frameHdr) error {
	q.mu.Lock()
	st := q.state
	var err error
	if h.ack > q.acked && st != rdma.QPSErr {
		err = q.ackLocked(h.ack)
	}
	q.mu.Unlock()
	if err != nil {
		return q.fatal(0, 0, err)
	}
	if h.flags&flagAckReq != 0 {
		q.ackAsked = true
	}
	if st == rdma.QPSErr {
		// Local disconnect or failure: discard until the peer closes.
		_, _ = io.Copy(io.Discard, q.br)
		return errDisconnected
	}
	switch h.op {
	case fSend, fSendImm, fSendInv, fWrite, fWriteImm, fReadReq:
		if last := q.lastSeq.Load(); h.seq != last+1 {
			return q.fatal(0, 0, fmt.Errorf("%w: request seq %d after %d", errPeer, h.seq, last))
		}
		if err := q.execute(h); err != nil {
			return err
		}
		q.lastSeq.Store(h.seq)
		return nil
	case fReadResp:
		return q.readResponse(h)
	case fAck:
		return nil
	case fTerminate:
		return q.terminated(h.seq, rdma.WCStatus(h.imm))
	case fDisc:
		return errDisconnected
	}
	return q.fatal(0, 0, fmt.Errorf("%w: unexpected %v frame", errPeer, h.op))
}

// execute runs one request of the peer.
func (q *qp) execute(h *frameHdr) error {
	switch h.op {
	case fWrite, fWriteImm:
		if h.op == fWriteImm {
			if err := q.waitRecv(h); err != nil {
				return err
			}
		}
		// A zero-length write touches no memory, so no key is checked (IB does the same;
		// RTRS heartbeats are such writes with rkey 0).
		var b []byte
		var m *mr
		st := rdma.WCSuccess
		if h.len > 0 {
			b, m, st = q.dev.resolvePlace(q.pd, q, h.rkey, h.addr, h.len, rdma.AccessRemoteWrite, true)
		}
		if st != rdma.WCSuccess {
			return q.fatal(h.seq, st, fmt.Errorf("%w: remote write to rkey %#x addr %#x len %d: %v", rdma.ErrPeerFault, h.rkey, h.addr, h.len, st))
		}
		if len(b) > 0 {
			q.placingWrite.Lock()
			err := errDisconnected // moved to error locally since the frame began
			if !q.errored.Load() {
				if err = q.br.ReadFull(b); err != nil && q.errored.Load() {
					err = errDisconnected // cut short by ToError
				}
			}
			q.placingWrite.Unlock()
			if m != nil {
				m.placed(q)
			}
			if err != nil {
				return err
			}
		}
		if h.op == fWriteImm {
			return q.finishRecv(rdma.WC{Opcode: rdma.WCRecvRDMAWithImm, Flags: rdma.WCWithImm, Imm: h.imm, ByteLen: h.len}, nil)
		}
		return nil
	case fReadReq:
		var b []byte
		st := rdma.WCSuccess
		if h.len > 0 {
			b, st = q.dev.resolve(q.pd, q, h.rkey, h.addr, h.len, rdma.AccessRemoteRead)
		}
		if st != rdma.WCSuccess {
			return q.fatal(h.seq, st, fmt.Errorf("%w: remote read of rkey %#x addr %#x len %d: %v", rdma.ErrPeerFault, h.rkey, h.addr, h.len, st))
		}
		if q.w.rsp.Load() >= maxRdAtomic {
			return q.fatal(h.seq, rdma.WCRemInvReqErr, fmt.Errorf("%w: READ seq %d with %d responses not yet read by the peer (responder resources %d)", errPeer, h.seq, q.w.rsp.Load(), maxRdAtomic))
		}
		q.rspSeg[0] = seg{b: b}
		q.w.addResponse(&frameHdr{op: fReadResp, len: h.len, seq: h.seq}, q.rspSeg[:])
		q.rspSeg[0] = seg{}
		q.w.flush()
		return nil
	}
	// SEND, SEND_WITH_IMM, SEND_WITH_INV.
	if err := q.waitRecv(h); err != nil {
		return err
	}
	wc := rdma.WC{Opcode: rdma.WCRecv, ByteLen: h.len}
	switch h.op {
	case fSendImm:
		wc.Flags, wc.Imm = rdma.WCWithImm, h.imm
	case fSendInv:
		if ok, _ := q.dev.invalidate(q.pd, q, h.imm); !ok {
			return q.fatal(h.seq, rdma.WCRemInvReqErr, fmt.Errorf("%w: send with invalidate of rkey %#x, which names no region open to remote invalidation", rdma.ErrPeerFault, h.imm))
		}
		wc.Flags, wc.InvRKey = rdma.WCWithInv, h.imm
	}
	return q.finishRecv(wc, h)
}

// waitRecv waits for a posted receive (receiver not ready: the peer's rnr retry count, 7 for
// ever) and marks the head receive as being placed into.
func (q *qp) waitRecv(h *frameHdr) error {
	retries := 0
	q.mu.Lock()
	if q.rqN == 0 {
		// The handlers may be about to re-post receives for completions of this burst.
		// What was executed before this frame is acknowledged now; this frame's own ask
		// stays for once it has been executed.
		q.mu.Unlock()
		q.endBurst()
		q.ackAsked = h.flags&flagAckReq != 0
		q.mu.Lock()
	}
	for q.rqN == 0 {
		q.mu.Unlock()
		if q.rnrRetry == 7 {
			select {
			case <-q.rqAvail:
			case <-q.dead:
			}
		} else {
			t := time.NewTimer(q.rnrTimer)
			select {
			case <-q.rqAvail:
			case <-q.dead:
			case <-t.C:
				if retries++; retries > int(q.rnrRetry) {
					t.Stop()
					return q.fatal(h.seq, rdma.WCRNRRetryExcErr, fmt.Errorf("receiver not ready for %v seq %d", h.op, h.seq))
				}
			}
			t.Stop()
		}
		q.mu.Lock()
		if q.state == rdma.QPSErr {
			q.mu.Unlock()
			return errDisconnected
		}
	}
	q.placing = true
	q.mu.Unlock()
	return nil
}

// finishRecv places a SEND's payload (h != nil) into the head receive and completes it.
func (q *qp) finishRecv(wc rdma.WC, h *frameHdr) error {
	q.mu.Lock()
	e := &q.rq[q.rqHead]
	wc.ID, wc.QPNum = e.id, q.num
	segs := q.rdSegs[:0]
	var room uint64
	st := rdma.WCSuccess
	if h != nil {
		for _, s := range e.sgl {
			b, s2 := q.dev.resolve(q.pd, nil, s.LKey, s.Addr, s.Length, rdma.AccessLocalWrite)
			if s2 != rdma.WCSuccess {
				st = s2
				break
			}
			segs = append(segs, b)
			room += uint64(len(b))
		}
		if st == rdma.WCSuccess && uint64(h.len) > room {
			st = rdma.WCLocLenErr
		}
	}
	q.mu.Unlock()
	if st != rdma.WCSuccess {
		q.mu.Lock()
		wc.Status = st
		q.rcq.push(wc)
		q.rqHead = (q.rqHead + 1) % len(q.rq)
		q.rqN--
		q.placing = false
		q.mu.Unlock()
		// The requester sees its SEND fail as an invalid request at the responder.
		return q.fatal(h.seq, rdma.WCRemInvReqErr, fmt.Errorf("%w: receive for %v seq %d: %v", rdma.ErrPeerFault, h.op, h.seq, st))
	}
	n := 0
	if h != nil {
		n = int(h.len)
	}
	err := q.place(segs, n)
	defer q.mu.Unlock()
	if err != nil {
		return err
	}
	q.rcq.push(wc)
	q.rqHead = (q.rqHead + 1) % len(q.rq)
	q.rqN--
	return nil
}

// place reads n payload bytes from the connection into segs, in order, and ends the
// placement begun under q.mu. It returns with q.mu held; if the QP failed meanwhile, everything
// outstanding (the entry placed into included) has been flushed and the error is returned.
func (q *qp) place(segs [][]byte, n int) error {
	var err error
	for _, b := range segs {
		if n == 0 {
			break
		}
		k := min(n, len(b))
		if err = q.br.ReadFull(b[:k]); err != nil {
			break
		}
		n -= k
	}
	clear(segs)
	q.mu.Lock()
	q.placing = false
	if q.state == rdma.QPSErr || err != nil {
		q.errorLocked()
		q.flushLocked()
		if err == nil {
			err = errDisconnected
		}
	}
	return err
}

// readResponse places an RDMA READ response. The response acknowledges every earlier request
// too (as in IB), so those complete first and the read is then the oldest outstanding request.
func (q *qp) readResponse(h *frameHdr) error {
	q.mu.Lock()
	if h.seq-1 > q.acked {
		// Checked against what was posted only: a response shows the peer had the read,
		// and an answer to a read never sent writes only into that read's own buffer.
		if h.seq-1 >= q.nextSeq {
			q.mu.Unlock()
			return q.fatal(0, 0, fmt.Errorf("%w: read response seq %d past what was sent (%d)", errPeer, h.seq, q.nextSeq-1))
		}
		if err := q.ackUpToLocked(h.seq - 1); err != nil {
			q.mu.Unlock()
			return q.fatal(0, 0, err)
		}
	}
	if q.sqN == 0 {
		q.mu.Unlock()
		return q.fatal(0, 0, fmt.Errorf("%w: read response seq %d with nothing outstanding", errPeer, h.seq))
	}
	e := &q.sq[q.sqHead]
	if e.done || !e.wire || e.op != rdma.WCRDMARead || e.seq != h.seq || e.byteLen != h.len {
		q.mu.Unlock()
		return q.fatal(0, 0, fmt.Errorf("%w: read response seq %d len %d does not match the oldest request", errPeer, h.seq, h.len))
	}
	segs := append(q.rdSegs[:0], e.segs...)
	q.placing = true
	q.mu.Unlock()
	err := q.place(segs, int(h.len))
	defer q.mu.Unlock()
	if err != nil {
		return err
	}
	e.done = true
	q.acked = h.seq
	q.rdOut--
	q.releaseHeldLocked()
	q.drainLocked()
	return nil
}

// ackLocked completes our requests up to seq, which the peer has executed. An ack of
// requests posted but not yet written whole is held back (peerAck) and taken as they are
// written (sentMoved): a peer that acks what it was never sent (it can count our requests:
// each heartbeat it sends is answered by one) would otherwise free send queue slots while
// reading nothing, and the frames queued for it would grow without bound. An honest peer's
// ack can overtake our note of a write only by microseconds.
func (q *qp) ackLocked(seq uint64) error {
	if seq < q.acked || seq >= q.nextSeq {
		return fmt.Errorf("%w: ack of seq %d (answered %d, sent %d)", errPeer, seq, q.acked, q.nextSeq-1)
	}
	if seq > q.w.sent.Load() {
		q.peerAck = max(q.peerAck, seq)
		q.w.ackWait.Store(true)
		// Read again once the wait is announced: a write that ended between the first read
		// and the announcement saw no wait, and would not call sentMoved (each side stores,
		// then loads what the other stores: one of them sees the other's).
		sent := q.w.sent.Load()
		if sent <= q.acked {
			return nil
		}
		seq = min(seq, sent)
	}
	return q.ackUpToLocked(seq)
}

// sentMoved takes the ack held back for requests that have now been written.
func (q *qp) sentMoved() {
	q.mu.Lock()
	if q.peerAck <= q.acked || q.state == rdma.QPSErr {
		q.w.ackWait.Store(q.peerAck > q.acked && q.state != rdma.QPSErr)
		q.mu.Unlock()
		return
	}
	seq := min(q.peerAck, q.w.sent.Load())
	if seq >= q.peerAck {
		q.w.ackWait.Store(false)
	}
	var err error
	if seq > q.acked {
		err = q.ackUpToLocked(seq)
	}
	q.mu.Unlock()
	if err != nil {
		_ = q.fatal(0, 0, err)
	}
}

// ackUpToLocked completes our requests up to seq, all of which have been written.
func (q *qp) ackUpToLocked(seq uint64) error {
	for i := 0; i < q.sqN; i++ {
		e := &q.sq[(q.sqHead+i)%len(q.sq)]
		if !e.wire || e.done {
			continue
		}
		if e.seq > seq {
			break
		}
		if e.op == rdma.WCRDMARead {
			// A read is answered by its response, which comes before any later ack.
			return fmt.Errorf("%w: ack of seq %d skips read seq %d", errPeer, seq, e.seq)
		}
		e.done = true
	}
	q.acked = seq
	q.drainLocked()
	return nil
}

// terminated handles the peer's report that our request seq failed with st.
func (q *qp) terminated(seq uint64, st rdma.WCStatus) error {
	q.mu.Lock()
	if seq <= q.acked || seq >= q.nextSeq || st == rdma.WCSuccess {
		q.mu.Unlock()
		return q.fatal(0, 0, fmt.Errorf("%w: terminate of seq %d status %d", errPeer, seq, st))
	}
	for i := 0; i < q.sqN; i++ {
		e := &q.sq[(q.sqHead+i)%len(q.sq)]
		if !e.wire || e.done {
			continue
		}
		if e.seq > seq {
			break
		}
		e.done = true
		if e.seq == seq {
			e.status = st
		}
	}
	q.drainLocked()
	q.errorLocked()
	q.mu.Unlock()
	return fmt.Errorf("soft-rdma: peer terminated request %d: %v", seq, st)
}

// fatal puts the QP in error and tells the peer which of its requests failed (seq 0: none,
// the peer violated the protocol). It returns err for the read loop to stop on.
func (q *qp) fatal(seq uint64, st rdma.WCStatus, err error) error {
	q.mu.Lock()
	q.errorLocked()
	q.mu.Unlock()
	q.notify()
	if seq != 0 {
		q.shutdown(&frameHdr{op: fTerminate, seq: seq, imm: uint32(st)})
	} else {
		q.shutdown(nil)
	}
	return err
}

// writer is the connection's writer (nil before the connection is established).
func (q *qp) writer() *writer {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.w
}
