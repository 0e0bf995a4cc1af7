package soft

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIOV bounds the iovecs of one writev (IOV_MAX on Linux).
const maxIOV = 1024

// seg is one queued piece of a frame: memory (a header from the arena, payload as a slice of
// MR memory), or n bytes of a file region from file offset off, which go out with sendfile:
// the socket takes the page cache's pages instead of a copy of them.
type seg struct {
	b   []byte
	f   *fileRef
	off int64
	n   int
	// cnt, when set, counts the frame this header begins until it has been written (the
	// responder's READ responses: see writer.rsp).
	cnt *atomic.Int32
	// endSeq, when not 0, is the sequence number of the request frame this piece ends: once
	// it is written, the peer may have the request (writer.sent).
	endSeq uint64
}

func (s *seg) len() int {
	if s.f != nil {
		return s.n
	}
	return len(s.b)
}

// advance drops n bytes from the front of s (n < s.len()).
func (s *seg) advance(n int) {
	if s.f != nil {
		s.off += int64(n)
		s.n -= n
		return
	}
	s.b = s.b[n:]
}

// release drops what s holds: a file piece's reference on its file.
func (s *seg) release() {
	if s.f != nil {
		s.f.put()
	}
	if s.cnt != nil {
		s.cnt.Add(-1)
	}
	*s = seg{}
}

// releaseAll releases every piece of segs.
func releaseAll(segs []seg) {
	for i := range segs {
		segs[i].release()
	}
}

// writer sends frames on a QP's connection. Frames are queued as pieces and go out in
// vectored writes (a file piece with a sendfile of its own), so frames queued while a write
// is in progress leave together in the next one.
//
// Nobody but the flusher goroutine ever blocks on the socket. Posters, the responder loop and
// completion handlers call flush, which writes without waiting for the socket; whatever the
// socket does not take is left to the flusher goroutine. So a send costs a system call in the
// poster's goroutine, and a responder never stops reading because its peer stopped reading
// (two such responders would deadlock).
type writer struct {
	conn net.Conn
	raw  syscall.RawConn

	mu     sync.Mutex
	idle   *sync.Cond // signalled when busy clears
	busy   bool       // the flusher goroutine is in a blocking write
	failed bool
	pend   []seg
	large  atomic.Bool // pend holds a piece of at least handOff bytes (read without mu by flushLarge)
	arena  []byte
	spend  []seg // spare piece list, swapped with pend per blocking batch
	sarena []byte
	batch  []seg  // owned by the busy flusher
	gbuf   []byte // the flusher's gathering buffer for a connection that is not a socket

	// Scratch iovecs: iov for non-blocking writes under mu, biov for the busy flusher;
	// the write callbacks are bound once and report through werr and berr.
	iov     []unix.Iovec
	biov    []unix.Iovec
	werr    error
	berr    error
	writeFn func(fd uintptr) bool
	batchFn func(fd uintptr) bool

	kick   chan struct{}
	onFail func(error)

	// ack is the responder's highest executed request; every frame carries it. ackSent is
	// the highest value queued so far. wantAck asks for an ACK frame, made when the next
	// write starts: so a peer that asks for acks and does not read its socket gets one
	// waiting ACK, not one per request.
	ack     *atomic.Uint64
	ackSent uint64
	wantAck bool

	// rsp counts the READ responses queued and not yet written: the responder resources a
	// peer holds (an HCA's max_dest_rd_atomic).
	rsp atomic.Int32

	// sent is the last request whose frame has been written whole: the most the peer can
	// have executed, so the most it may acknowledge (qp.ackLocked). A peer that acked what
	// it was never sent would free send queue slots while it reads nothing, and frames
	// would pile up here without bound. ackWait, set by the QP when it held an ack back
	// for that, has the writer call onSent when sent moves.
	sent    atomic.Uint64
	ackWait atomic.Bool
	onSent  func()

	raceAddr unsafe.Pointer // see race_on.go
}

func newWriter(conn net.Conn, ack *atomic.Uint64, onFail func(error)) *writer {
	w := &writer{
		conn:   conn,
		pend:   make([]seg, 0, 64),
		spend:  make([]seg, 0, 64),
		arena:  make([]byte, 0, 64*hdrLen),
		sarena: make([]byte, 0, 64*hdrLen),
		iov:    make([]unix.Iovec, 0, maxIOV),
		biov:   make([]unix.Iovec, 0, maxIOV),
		kick:   make(chan struct{}, 1),
		onFail: onFail,
		ack:    ack,
	}
	if sc, ok := conn.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			w.raw = raw
		}
	}
	w.writeFn, w.batchFn = w.rawWrite, w.rawBatch
	w.raceAddr = raceAddrOf(conn)
	w.idle = sync.NewCond(&w.mu)
	return w
}

// addLocked queues one frame; w.mu is held. The frame's file pieces pass their references
// to the queue (released when written or dropped). A frame with cnt set is counted in it
// until written.
func (w *writer) addLocked(h *frameHdr, payload []seg, cnt *atomic.Int32) {
	if w.failed {
		releaseAll(payload)
		return
	}
	n := len(w.arena)
	if cap(w.arena)-n < hdrLen {
		// A new arena; headers already queued keep pointing into the old one.
		na := make([]byte, n, 2*cap(w.arena)+hdrLen)
		copy(na, w.arena)
		w.arena = na
	}
	w.arena = w.arena[:n+hdrLen]
	hb := w.arena[n : n+hdrLen : n+hdrLen]
	if h.op != fConnReq && h.op != fConnAcc && h.op != fConnRej && h.op != fConnRTU {
		// Loaded under w.mu after the responder queued the answers to the requests it
		// acknowledges, so an ack never overtakes a READ response.
		h.ack = w.ack.Load()
		w.ackSent = h.ack
	}
	h.encode(hb)
	raceRelease(w.raceAddr)
	if cnt != nil {
		cnt.Add(1)
	}
	w.pend = append(w.pend, seg{b: hb, cnt: cnt})
	for _, p := range payload {
		if p.len() > 0 {
			w.pend = append(w.pend, p)
			if p.len() >= handOff {
				w.large.Store(true)
			}
		} else {
			p.release()
		}
	}
	if h.op.isRequest() {
		w.pend[len(w.pend)-1].endSeq = h.seq
	}
}

// noteSent records that the request frame ending with a piece of endSeq has been written.
// Frames go out in the order of their sequence numbers.
func (w *writer) noteSent(endSeq uint64) {
	if endSeq != 0 {
		w.sent.Store(endSeq)
	}
}

// sentMoved calls onSent if the QP waits for sent to move and it has moved past before;
// never with w.mu held (onSent takes the QP's lock, which is taken before w.mu).
func (w *writer) sentMoved(before uint64) {
	if w.ackWait.Load() && w.sent.Load() > before && w.onSent != nil {
		w.onSent()
	}
}

// handOff: a frame with a piece this large is written by the flusher goroutine, not by the
// poster (but see flushLarge: the reader's burst handlers write theirs themselves). Its copy into the socket takes long enough (tens of µs per 128 KiB) that the
// poster, often the goroutine that reads the next request, is better off going back to
// reading while another CPU copies: the two copies of a byte a forwarding process makes
// (read in, send on) then overlap instead of taking turns.
const handOff = 64 << 10

// add queues one frame.
func (w *writer) add(h *frameHdr, payload []seg) {
	w.mu.Lock()
	w.addLocked(h, payload, nil)
	w.mu.Unlock()
}

// addResponse queues a READ response, counted in w.rsp until written.
func (w *writer) addResponse(h *frameHdr, payload []seg) {
	w.mu.Lock()
	w.addLocked(h, payload, &w.rsp)
	w.mu.Unlock()
}

// flushLarge writes the queue now, without waiting for the socket, if it holds a large piece
// and the flusher is idle; the rest is left to the flusher. A reader running a burst's
// handlers calls it as each posts: a server answering a burst of large READs then sends each
// response as it is made, and its peer copies and completes them while the next one is read
// from the export, where flushing at the burst's end moved all of them in one convoy
// (docs/benchmarks.md). Written by the reader itself: a hand-off to the flusher per
// response costs a wake-up each.
func (w *writer) flushLarge() {
	if !w.large.Load() {
		return // the common case, without the lock
	}
	w.mu.Lock()
	if !w.large.Load() || w.busy || w.failed || w.raw == nil {
		w.mu.Unlock()
		return
	}
	w.large.Store(false)
	w.writeNowUnlock()
}

// requestAck asks for an ACK frame if the peer has not been sent an ack of everything
// executed. The frame is made when the next write starts and carries the ack of that moment;
// one request stands for any number.
func (w *writer) requestAck() {
	w.mu.Lock()
	if !w.failed && w.ackSent < w.ack.Load() {
		w.wantAck = true
	}
	w.mu.Unlock()
}

// takeAckLocked turns a requested ACK into a frame at the end of the queue; w.mu is held.
func (w *writer) takeAckLocked() {
	if w.wantAck {
		w.wantAck = false
		if w.ackSent < w.ack.Load() {
			w.addLocked(&frameHdr{op: fAck}, nil, nil)
		}
	}
}

// flush writes what is queued without blocking; the rest goes to the flusher goroutine.
// While the flusher is writing it only leaves the frames to it.
func (w *writer) flush() {
	w.mu.Lock()
	if !w.busy {
		w.takeAckLocked()
	}
	if w.busy || len(w.pend) == 0 || w.failed {
		w.mu.Unlock()
		return
	}
	if w.large.Load() && w.raw != nil {
		w.large.Store(false)
		select {
		case w.kick <- struct{}{}:
		default:
		}
		w.mu.Unlock()
		return
	}
	w.writeNowUnlock()
}

// writeNowUnlock writes what the socket takes now and leaves the rest to the flusher
// goroutine; w.mu is held on entry and released.
func (w *writer) writeNowUnlock() {
	before := w.sent.Load()
	err := w.tryWrite()
	if err == nil && len(w.pend) > 0 {
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
	w.mu.Unlock()
	if err != nil {
		w.onFail(err)
		return
	}
	w.sentMoved(before)
}

// tryWrite writes the head of pend until the socket would block and drops what was
// written; w.mu is held.
func (w *writer) tryWrite() error {
	if w.raw == nil {
		return nil // not a socket: the flusher does blocking writes
	}
	w.werr = nil
	err := w.raw.Write(w.writeFn)
	if err == nil && w.werr != nil && w.werr != syscall.EAGAIN {
		err = w.werr
	}
	if err != nil {
		w.failLocked()
		return err
	}
	if len(w.pend) == 0 {
		// Everything went: the header arena starts again.
		w.arena = w.arena[:0]
	}
	return nil
}

// rawWrite is tryWrite's callback: write what the socket takes now, never wait.
func (w *writer) rawWrite(fd uintptr) bool {
	w.pend, w.werr = writeSegs(int(fd), w.pend, &w.iov, w.noteSent)
	return true
}

// rawBatch is writeBatch's callback: write, and wait while the socket is full.
func (w *writer) rawBatch(fd uintptr) bool {
	w.batch, w.berr = writeSegs(int(fd), w.batch, &w.biov, w.noteSent)
	return w.berr != syscall.EAGAIN
}

// writeSegs writes segs to the non-blocking socket fd until they are all written, the socket
// would block (EAGAIN) or a write fails, and returns the pieces not written, moved to the
// front of the same array. iov is scratch; sent is told each request frame written whole.
//
// The system calls are raw (no entersyscall): they never wait, and a P seen in a system call
// by the runtime's monitor is handed to another thread — at IO rates on a small machine a
// stream of thread wake-ups and context switches for calls that take microseconds.
func writeSegs(fd int, segs []seg, iov *[]unix.Iovec, sent func(uint64)) ([]seg, error) {
	var err error
	i := 0 // segs[:i] are written
	for i < len(segs) && err == nil {
		var n int
		if s := &segs[i]; s.f != nil {
			off := s.off
			r, _, e := syscall.RawSyscall6(syscall.SYS_SENDFILE, uintptr(fd), uintptr(s.f.fd), uintptr(unsafe.Pointer(&off)), uintptr(s.n), 0, 0)
			n = int(r)
			if e != 0 {
				n, err = 0, e
			}
			if err == nil && n == 0 {
				// End of file inside a registered range: the file shrank. The frame's
				// header promised bytes that do not exist, so the connection must go.
				err = fmt.Errorf("soft-rdma: file region shrank under a send: %w", io.ErrUnexpectedEOF)
			}
		} else {
			*iov = (*iov)[:0]
			for _, s := range segs[i:] {
				if s.f != nil || len(*iov) == maxIOV {
					break
				}
				*iov = append(*iov, unix.Iovec{Base: &s.b[0], Len: uint64(len(s.b))})
			}
			r, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&(*iov)[0])), uintptr(len(*iov)))
			clear(*iov)
			n = int(r)
			if e != 0 {
				n, err = 0, e
			}
		}
		if err == syscall.EINTR {
			err = nil
		}
		if n < 0 {
			n = 0
		}
		i = consume(segs, i, n, sent)
		// A short write goes round again: only the system call's own EAGAIN says the socket
		// is full (a wait for writability on a socket with room would never end), and a
		// short sendfile may be the end of the file, which the next one reports.
	}
	left := copy(segs, segs[i:])
	clear(segs[left:])
	return segs[:left], err
}

// consume marks n more bytes written from segs[i]: it releases the pieces that are whole,
// telling sent of each request frame they end, and returns the index of the first one that
// is not.
func consume(segs []seg, i, n int, sent func(uint64)) int {
	for i < len(segs) && n >= segs[i].len() {
		n -= segs[i].len()
		sent(segs[i].endSeq)
		segs[i].release()
		i++
	}
	if i < len(segs) && n > 0 {
		segs[i].advance(n)
	}
	return i
}

func (w *writer) failLocked() {
	w.failed = true
	releaseAll(w.pend)
	w.pend = w.pend[:0]
}

// flushSync waits for the flusher, then writes everything queued, blocking. It returns once
// the queue is empty or the connection failed. Only teardown uses it, with a write deadline.
func (w *writer) flushSync() {
	w.mu.Lock()
	for w.busy {
		w.idle.Wait()
	}
	if w.failed || len(w.pend) == 0 {
		w.mu.Unlock()
		return
	}
	w.busy = true
	before := w.sent.Load()
	err := w.flushLocked()
	w.mu.Unlock()
	if err != nil {
		w.onFail(err)
		return
	}
	w.sentMoved(before)
}

// flushLocked writes batches with blocking writes until the queue is empty; w.mu is held and
// w.busy set on entry, and busy is cleared on return.
func (w *writer) flushLocked() error {
	var err error
	for w.takeAckLocked(); len(w.pend) > 0 && !w.failed; w.takeAckLocked() {
		w.batch, w.pend = w.pend, w.spend[:0]
		w.large.Store(false)
		barena := w.arena
		w.arena = w.sarena[:0]
		w.mu.Unlock()
		err = w.writeBatch()
		releaseAll(w.batch) // what a failed write left
		w.mu.Lock()
		w.spend, w.sarena = w.batch[:0], barena[:0]
		w.batch = nil
		if err != nil {
			w.failLocked()
		}
	}
	w.busy = false
	w.idle.Broadcast()
	return err
}

// writeBatch writes w.batch, waiting for the socket as needed (and as its write deadline
// allows); the flusher owns the batch and w.mu is not held.
func (w *writer) writeBatch() error {
	if w.raw == nil {
		return w.writeBatchConn()
	}
	w.berr = nil
	if err := w.raw.Write(w.batchFn); err != nil {
		return err
	}
	return w.berr
}

// writeBatchConn writes w.batch to a connection that is not a socket (TLS, and pipes in
// tests): small pieces gathered into one write (one TLS record instead of one per header),
// file pieces read into memory first.
func (w *writer) writeBatchConn() error {
	const gather = 64 << 10
	for i := 0; i < len(w.batch); {
		s := &w.batch[i]
		if s.f == nil && len(s.b) < gather {
			buf := w.gbuf[:0]
			j := i
			for ; j < len(w.batch) && w.batch[j].f == nil && len(buf)+len(w.batch[j].b) <= gather; j++ {
				buf = append(buf, w.batch[j].b...)
			}
			if _, err := w.conn.Write(buf); err != nil {
				return err
			}
			w.gbuf = buf[:0]
			for ; i < j; i++ {
				w.noteSent(w.batch[i].endSeq)
				w.batch[i].release()
			}
			continue
		}
		b := s.b
		if s.f != nil {
			b = make([]byte, s.n)
			if n, err := unix.Pread(s.f.fd, b, s.off); err != nil || n < len(b) {
				return fmt.Errorf("soft-rdma: file region read: %d of %d bytes: %w", max(n, 0), len(b), errors.Join(err, io.ErrUnexpectedEOF))
			}
		}
		if _, err := w.conn.Write(b); err != nil {
			return err
		}
		w.noteSent(s.endSeq)
		s.release()
		i++
	}
	w.batch = w.batch[:0]
	return nil
}

// run is the flusher goroutine: it finishes, with blocking writes, what the non-blocking
// attempts left.
func (w *writer) run(done <-chan struct{}) {
	for {
		select {
		case <-w.kick:
			w.mu.Lock()
			if w.busy || w.failed || len(w.pend) == 0 && !w.wantAck {
				w.mu.Unlock()
				continue
			}
			w.busy = true
			before := w.sent.Load()
			err := w.flushLocked()
			w.mu.Unlock()
			if err != nil {
				w.onFail(err)
				continue
			}
			w.sentMoved(before)
		case <-done:
			return
		}
	}
}
