package soft

import (
	"net"
	"sync"
	"sync/atomic"
)

// writer sends frames on a QP's connection. Frames are queued as iovecs (header from an
// arena, payload as slices of MR memory) and written with one vectored write per batch: whoever
// finds the writer idle writes everything queued so far, so frames queued while a write is in
// progress go out together in the next one.
//
// Two kinds of callers: posters (PostSend) write inline in their own goroutine, which keeps the
// latency of a send at one syscall; the responder loop must never block on the socket (both
// peers' readers blocked on full send buffers would deadlock), so it only queues and kicks the
// flusher goroutine.
type writer struct {
	conn net.Conn

	mu     sync.Mutex
	idle   *sync.Cond // signalled when busy clears
	busy   bool
	failed bool
	pend   net.Buffers
	arena  []byte
	spend  net.Buffers // spare iovec list, swapped with pend per batch
	sarena []byte
	batch  net.Buffers // owned by the busy writer

	kick   chan struct{}
	onFail func(error)

	// ack is the responder's highest executed request; every frame carries it. ackSent is
	// the highest value queued so far.
	ack     *atomic.Uint64
	ackSent uint64
}

func newWriter(conn net.Conn, ack *atomic.Uint64, onFail func(error)) *writer {
	w := &writer{
		conn:   conn,
		pend:   make(net.Buffers, 0, 64),
		spend:  make(net.Buffers, 0, 64),
		arena:  make([]byte, 0, 64*hdrLen),
		sarena: make([]byte, 0, 64*hdrLen),
		kick:   make(chan struct{}, 1),
		onFail: onFail,
		ack:    ack,
	}
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

// addAsync queues one frame and makes sure somebody writes it without blocking the caller.
func (w *writer) addAsync(h *frameHdr, payload [][]byte) {
	w.mu.Lock()
	w.addLocked(h, payload)
	busy := w.busy
	w.mu.Unlock()
	if !busy {
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
}

// flush writes what is queued unless another goroutine is already writing (it will pick the
// frames up).
func (w *writer) flush() {
	w.mu.Lock()
	if w.busy || len(w.pend) == 0 || w.failed {
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

// flushSync waits for the current writer, then writes everything queued. It returns once the
// queue is empty (or the connection failed).
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

// flushLocked writes batches until the queue is empty; w.mu is held and w.busy set on entry,
// and busy is cleared on return.
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
			w.failed = true
			clear(w.pend)
			w.pend = w.pend[:0]
		}
	}
	w.busy = false
	w.idle.Broadcast()
	return err
}

// run is the flusher goroutine: it writes what the responder loop queues.
func (w *writer) run(done <-chan struct{}) {
	for {
		select {
		case <-w.kick:
			w.flush()
		case <-done:
			return
		}
	}
}
