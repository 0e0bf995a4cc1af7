//go:build verbs

package verbs

// #include "glue.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// pollBatch is how many completions one ibv_poll_cq call takes.
const pollBatch = 32

// cq is a completion queue with a completion channel of its own. The channel's descriptor
// (a duplicate, non-blocking) waits in Go's poller, so a waiting CQ holds no thread.
type cq struct {
	dev *device
	cq  *C.struct_ibv_cq
	ch  *C.struct_ibv_comp_channel
	fd  *os.File
	rc  syscall.RawConn

	// mu guards polling: the C buffers and pending, the completions Wait took out of
	// the queue before anyone asked for them.
	mu      sync.Mutex
	wc      *C.struct_ibv_wc
	out     *C.struct_gwc
	pending []rdma.WC
	drained bool // pending holds all arm found, fewer than a batch: the queue was empty then
	dead    bool
	// The QP of the last completion and the device's QP generation it was found in: a CQ
	// mostly serves one QP, whose completions then skip the device's lock and map.
	lastQP  *qp
	lastGen uint64

	// calls counts this CQ's calls into C on the data path (Provider.DataPathCalls).
	calls atomic.Uint64

	hmu     sync.Mutex // handler changes
	stop    chan struct{}
	stopped chan struct{}
}

func (d *device) CreateCQ(cqe int) (rdma.CQ, error) {
	if cqe <= 0 || d.attr.MaxCQE > 0 && cqe > d.attr.MaxCQE {
		return nil, fmt.Errorf("%w: CQ of %d entries (at most %d)", rdma.ErrInvalid, cqe, d.attr.MaxCQE)
	}
	ch, err := C.ibv_create_comp_channel(d.ctx)
	if ch == nil {
		return nil, fmt.Errorf("verbs: ibv_create_comp_channel: %w", errOr(err))
	}
	c := &cq{dev: d, ch: ch}
	fail := func(err error) (rdma.CQ, error) {
		if c.fd != nil {
			_ = c.fd.Close()
		}
		if c.cq != nil {
			C.ibv_destroy_cq(c.cq)
		}
		C.ibv_destroy_comp_channel(ch)
		return nil, err
	}
	if c.fd, c.rc, err = pollable(C.rtrs_comp_fd(ch), "ibv_comp_channel"); err != nil {
		return fail(err)
	}
	q, err := C.ibv_create_cq(d.ctx, C.int(cqe), nil, ch, 0)
	if q == nil {
		return fail(fmt.Errorf("verbs: ibv_create_cq of %d: %w", cqe, errOr(err)))
	}
	c.cq = q
	c.wc = (*C.struct_ibv_wc)(C.calloc(pollBatch, C.sizeof_struct_ibv_wc))
	c.out = (*C.struct_gwc)(C.calloc(pollBatch, C.sizeof_struct_gwc))
	d.addCQ(c)
	return c, nil
}

// Poll moves completions into wc: first those Wait took, then the queue's.
func (c *cq) Poll(wc []rdma.WC) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return 0
	}
	n := copy(wc, c.pending)
	c.pending = c.pending[:copy(c.pending, c.pending[n:])]
	if n > 0 && len(c.pending) == 0 && c.drained {
		// What arm found, which left the queue empty: the next Poll looks (one call into
		// C fewer per completion event).
		c.drained = false
		return n
	}
	c.drained = false
	for n < len(wc) {
		want := min(len(wc)-n, pollBatch)
		got := c.pollLocked(wc[n : n+want])
		n += got
		// Fewer than asked for: the queue was empty, and another ibv_poll_cq now would
		// only find it so again (one more cgo call per Poll that found work).
		if got < want {
			break
		}
	}
	return n
}

// PollBusy is Poll spinning in C while the queue is empty (rdma.BusyPoller): under an
// emulated CPU a cgo call costs ten times an ibv_poll_cq, so a Go loop of Polls would notice a
// completion a call late on average.
func (c *cq) PollBusy(wc []rdma.WC, spins int) int {
	c.mu.Lock()
	if c.dead || len(c.pending) > 0 || len(wc) == 0 {
		c.mu.Unlock()
		return c.Poll(wc)
	}
	c.calls.Add(1)
	got := c.convert(wc, int(C.rtrs_poll_busy(handle(c.cq), handle(c.wc), handle(c.out), C.int(min(len(wc), pollBatch)), C.int(max(spins, 1)))))
	c.mu.Unlock()
	return got
}

// pollLocked takes up to min(len(wc), pollBatch) completions from the queue.
func (c *cq) pollLocked(wc []rdma.WC) int {
	c.calls.Add(1)
	return c.convert(wc, int(C.rtrs_poll(handle(c.cq), handle(c.wc), handle(c.out), C.int(min(len(wc), pollBatch)))))
}

// convert moves got completions that the glue left in c.out into wc (under c.mu).
func (c *cq) convert(wc []rdma.WC, got int) int {
	if got <= 0 {
		return 0
	}
	for i, g := range unsafe.Slice(c.out, got) {
		wc[i] = c.dev.completion(&g, c.qpFor(uint32(g.qp_num)))
	}
	return got
}

// qpFor is the QP of number num, nil if the device has none (under c.mu).
func (c *cq) qpFor(num uint32) *qp {
	// The generation is read before the lookup: a QP removed after it moves it on.
	gen := c.dev.qpGen.Load()
	if q := c.lastQP; q != nil && q.num == num && c.lastGen == gen {
		return q
	}
	q := c.dev.qp(num)
	c.lastQP, c.lastGen = q, gen
	return q
}

// arm requests an event for the next completion and reports whether the queue already
// holds one, which the event would not announce.
func (c *cq) arm() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return false
	}
	if len(c.pending) > 0 {
		return true
	}
	c.calls.Add(1)
	var buf [pollBatch]rdma.WC
	n := c.convert(buf[:], int(C.rtrs_arm_poll(handle(c.cq), handle(c.wc), handle(c.out), C.int(pollBatch))))
	c.pending = append(c.pending, buf[:n]...)
	// Fewer than a batch: the queue was empty after them, and what comes next raises the
	// event just requested. Poll need not look again before handing these out.
	c.drained = n < pollBatch
	return n > 0
}

// waitEvent blocks until the channel has an event (and takes it), the deadline passes or the
// descriptor is closed.
func (c *cq) waitEvent(deadline time.Time) error {
	if err := c.fd.SetReadDeadline(deadline); err != nil {
		return err
	}
	var cerr error
	err := c.rc.Read(func(uintptr) bool {
		c.calls.Add(1)
		rc := C.rtrs_get_cq_event(c.ch)
		if rc < 0 {
			cerr = syscall.Errno(-rc)
		}
		return rc != 0
	})
	if err == nil {
		err = cerr
	}
	return err
}

func (c *cq) Wait(ctx context.Context) error {
	for {
		if c.arm() {
			return nil
		}
		c.mu.Lock()
		dead := c.dead
		c.mu.Unlock()
		if dead {
			return rdma.ErrClosed
		}
		dl, ok := ctx.Deadline()
		if !ok {
			// Wake now and then to notice ctx ending without a deadline.
			dl = time.Now().Add(100 * time.Millisecond)
		}
		if err := c.waitEvent(dl); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			if errors.Is(err, os.ErrClosed) {
				return rdma.ErrClosed
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// SetHandler runs fn on a goroutine of the queue's: armed, fn drains, then the goroutine
// sleeps in the poller until the next completion event.
func (c *cq) SetHandler(fn func()) {
	c.hmu.Lock()
	defer c.hmu.Unlock()
	if c.stop != nil {
		close(c.stop)
		// Wake the goroutine from its wait. It sets its own (lack of a) deadline each time it
		// goes to wait, which may be just after this one: so until it is gone.
		for stopped := false; !stopped; {
			_ = c.fd.SetReadDeadline(time.Now())
			select {
			case <-c.stopped:
				stopped = true
			case <-time.After(5 * time.Millisecond):
			}
		}
		c.stop, c.stopped = nil, nil
	}
	if fn == nil {
		return
	}
	c.mu.Lock()
	dead := c.dead
	c.mu.Unlock()
	if dead {
		return
	}
	stop, stopped := make(chan struct{}), make(chan struct{})
	c.stop, c.stopped = stop, stopped
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			c.arm()
			fn()
			err := c.waitEvent(time.Time{})
			select {
			case <-stop:
				return
			default:
			}
			if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				return // the queue is gone
			}
		}
	}()
}

func (c *cq) Destroy() error {
	c.SetHandler(nil)
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		return rdma.ErrClosed
	}
	c.dead = true
	c.mu.Unlock()
	_ = c.fd.Close() // wakes waiters
	var err error
	if rc := C.ibv_destroy_cq(c.cq); rc != 0 {
		err = fmt.Errorf("verbs: ibv_destroy_cq: %w", errnoOf(rc))
	}
	if rc := C.ibv_destroy_comp_channel(c.ch); rc != 0 && err == nil {
		err = fmt.Errorf("verbs: ibv_destroy_comp_channel: %w", errnoOf(rc))
	}
	C.free(unsafe.Pointer(c.wc))
	C.free(unsafe.Pointer(c.out))
	// After the handler (stopped above) and with the descriptor closed: no more calls.
	c.dev.retire(c)
	return err
}

// completion turns a C completion into the API's, through the records of what q (the QP
// of its number, nil if none) posted.
func (d *device) completion(g *C.struct_gwc, q *qp) rdma.WC {
	w := rdma.WC{Status: rdma.WCStatus(g.status), ByteLen: uint32(g.byte_len), QPNum: uint32(g.qp_num)}
	if g.flags&C.IBV_WC_WITH_IMM != 0 {
		w.Flags |= rdma.WCWithImm
		w.Imm = uint32(g.imm)
	}
	if g.flags&C.IBV_WC_WITH_INV != 0 {
		w.Flags |= rdma.WCWithInv
		w.InvRKey = uint32(g.imm)
	}
	if q == nil {
		w.ID = uint64(g.wr_id)
		return w
	}
	q.complete(&w, uint64(g.wr_id), uint32(g.opcode))
	return w
}
