package soft

import (
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIOV bounds the iovecs of one writev (IOV_MAX on Linux).
const maxIOV = 1024

// writer sends frames on a QP's connection. Frames are queued as iovecs (header from an
// arena, payload as slices of MR memory) and go out in vectored writes, so frames queued while
// a write is in progress leave together in the next one.
//
// Nobody but the flusher goroutine ever blocks on the socket. Posters, the responder loop and
// completion handlers call flush, which makes one non-blocking writev attempt; whatever the
// socket does not take is left to the flusher goroutine. So a send costs one syscall in the
// poster's goroutine, and a responder never stops reading because its peer stopped reading
// (two such responders would deadlock).
type writer struct {
	conn net.Conn
	raw  syscall.RawConn

	mu     sync.Mutex
	idle   *sync.Cond // signalled when busy clears
	busy   bool       // the flusher goroutine is in a blocking write
	failed bool
	pend   net.Buffers
	arena  []byte
	spend  net.Buffers // spare iovec list, swapped with pend per blocking batch
	sarena []byte
	batch  net.Buffers // owned by the busy flusher

	// Non-blocking write state, used under mu by tryWrite and rawWrite.
	iov     []unix.Iovec
	wn      int
	werr    syscall.Errno
	writeFn func(fd uintptr) bool

	kick   chan struct{}
	onFail func(error)

	// ack is the responder's highest executed request; every frame carries it. ackSent is
	// the highest value queued so far.
	ack     *atomic.Uint64
	ackSent uint64

	raceAddr unsafe.Pointer // see race_on.go
}

func newWriter(conn net.Conn, ack *atomic.Uint64, onFail func(error)) *writer {
	w := &writer{
		conn:   conn,
		pend:   make(net.Buffers, 0, 64),
		spend:  make(net.Buffers, 0, 64),
		arena:  make([]byte, 0, 64*hdrLen),
		sarena: make([]byte, 0, 64*hdrLen),
		iov:    make([]unix.Iovec, 0, maxIOV),
		kick:   make(chan struct{}, 1),
		onFail: onFail,
		ack:    ack,
	}
	if sc, ok := conn.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			w.raw = raw
		}
	}
	w.writeFn = w.rawWrite
	w.raceAddr = raceAddrOf(conn)
	w.idle = sync.NewCond(&w.mu)
	return w
}

// addLocked queues one frame; w.mu is held.
func (w *writer) addLocked(h *frameHdr, payload [][]byte) {
	if w.failed {
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
	w.pend = append(w.pend, hb)
	for _, p := range payload {
		if len(p) > 0 {
			w.pend = append(w.pend, p)
		}
	}
}

// add queues one frame.
func (w *writer) add(h *frameHdr, payload [][]byte) {
	w.mu.Lock()
	w.addLocked(h, payload)
	w.mu.Unlock()
}

// ackOwed reports whether the peer has not yet been sent an ack of everything executed.
func (w *writer) ackOwed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.failed && w.ackSent < w.ack.Load()
}

// flush writes what is queued without blocking: one non-blocking writev, the rest to the
// flusher goroutine. While the flusher is writing it only leaves the frames to it.
func (w *writer) flush() {
	w.mu.Lock()
	if w.busy || len(w.pend) == 0 || w.failed {
		w.mu.Unlock()
		return
	}
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
	}
}

// tryWrite makes one non-blocking writev of the head of pend and drops what was written;
// w.mu is held.
func (w *writer) tryWrite() error {
	if w.raw == nil {
		return nil // not a socket: the flusher does blocking writes
	}
	w.iov = w.iov[:0]
	for _, b := range w.pend {
		if len(w.iov) == maxIOV {
			break
		}
		w.iov = append(w.iov, unix.Iovec{Base: &b[0], Len: uint64(len(b))})
	}
	w.wn, w.werr = 0, 0
	err := w.raw.Write(w.writeFn)
	clear(w.iov)
	if err == nil && w.werr != 0 && w.werr != syscall.EAGAIN && w.werr != syscall.EINTR {
		err = w.werr
	}
	if err != nil {
		w.failLocked()
		return err
	}
	w.consume(w.wn)
	return nil
}

// rawWrite is the RawConn callback: one writev, and never wait for writability.
func (w *writer) rawWrite(fd uintptr) bool {
	n, _, e := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&w.iov[0])), uintptr(len(w.iov)))
	if e == 0 {
		w.wn = int(n)
	}
	w.werr = e
	return true
}

// consume drops n written bytes from the head of pend.
func (w *writer) consume(n int) {
	i := 0
	for i < len(w.pend) && n >= len(w.pend[i]) {
		n -= len(w.pend[i])
		w.pend[i] = nil
		i++
	}
	if i < len(w.pend) && n > 0 {
		w.pend[i] = w.pend[i][n:]
	}
	if i == len(w.pend) {
		// Everything went: both the list and the header arena start again.
		w.pend = w.pend[:0]
		w.arena = w.arena[:0]
		return
	}
	left := copy(w.pend, w.pend[i:])
	clear(w.pend[left:])
	w.pend = w.pend[:left]
}

func (w *writer) failLocked() {
	w.failed = true
	clear(w.pend)
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
	err := w.flushLocked()
	w.mu.Unlock()
	if err != nil {
		w.onFail(err)
	}
}

// flushLocked writes batches with blocking writes until the queue is empty; w.mu is held and
// w.busy set on entry, and busy is cleared on return.
func (w *writer) flushLocked() error {
	var err error
	for len(w.pend) > 0 && !w.failed {
		w.batch, w.pend = w.pend, w.spend[:0]
		barena := w.arena
		w.arena = w.sarena[:0]
		keep := w.batch
		w.mu.Unlock()
		_, err = w.batch.WriteTo(w.conn)
		clear(keep) // drop references to MR memory
		w.mu.Lock()
		w.spend, w.sarena = keep[:0], barena[:0]
		if err != nil {
			w.failLocked()
		}
	}
	w.busy = false
	w.idle.Broadcast()
	return err
}

// run is the flusher goroutine: it finishes, with blocking writes, what the non-blocking
// attempts left.
func (w *writer) run(done <-chan struct{}) {
	for {
		select {
		case <-w.kick:
			w.mu.Lock()
			if w.busy || w.failed || len(w.pend) == 0 {
				w.mu.Unlock()
				continue
			}
			w.busy = true
			err := w.flushLocked()
			w.mu.Unlock()
			if err != nil {
				w.onFail(err)
			}
		case <-done:
			return
		}
	}
}
