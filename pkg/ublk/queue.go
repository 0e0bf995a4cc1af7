package ublk

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/errno"
	"github.com/rtrs-go/rtrs/internal/lib/uring"
)

// Handler serves a device's requests. Serve runs on the queue's loop and must not block
// on the request: it starts it and returns, and the request's Done is called once, from
// any goroutine, when it is over.
type Handler interface {
	Serve(r *Request)
}

// BufferProvider is a Handler that provides a queue's buffers: depth × maxIO bytes, a tag's
// buffer at tag × maxIO. Its IO path may have registered them for RDMA, so that requests go
// out from them and land in them without a copy. QueueBuffers returns nil to let the queue
// map its own; free runs once the queue's loop has ended and its handlers have returned.
// Provided buffers are never given back while idle (registered pages are pinned, and a
// registration would not follow pages dropped and faulted in again).
type BufferProvider interface {
	QueueBuffers(queue, depth, maxIO int) (bufs []byte, free func())
}

// FailureReporter is a Handler told when one of the device's queue loops ends on an error
// of its ring: that queue's requests then wait until the device is stopped.
type FailureReporter interface {
	QueueFailed(queue int, err error)
}

// Request is one block request: an op (OpRead, OpWrite, OpFlush, OpDiscard,
// OpWriteZeroes) on Len bytes at Off, with its UBLK_IO_F_* flags. Buf holds the data of a
// read (to fill) or a write (to send). A Request is reused once Done is called.
type Request struct {
	Op    uint8
	Flags uint32
	Off   int64
	Len   int
	Buf   []byte
	Queue int

	q   *queue
	tag uint16
}

// Done completes the request: err nil, or an error whose errno the block layer gets.
func (r *Request) Done(err error) {
	res := int32(0)
	if err != nil {
		res = int32(errno.Neg(err))
	} else if r.Op == OpRead || r.Op == OpWrite {
		res = int32(r.Len)
	}
	r.q.complete(r.tag, res)
}

// user_data of the queue's ring entries: the tag, or the wake-up read.
const udWake = 1 << 32

// waitSlice bounds one wait of a queue loop so it notices a quit.
const waitSlice = time.Second

type completion struct {
	tag uint16
	res int32
}

// queue is one hardware queue: its ring, its descriptor array (shared with the driver) and
// a buffer per tag, served by one goroutine locked to its thread (the driver takes a
// queue's commands from one task only).
type queue struct {
	d     *Device
	id    int
	depth int
	maxIO int
	h     Handler
	descs []byte // mmap of /dev/ublkc<n>: IODesc per tag
	bufs  []byte // anonymous mmap, or the handler's (BufferProvider): maxIO per tag
	// freeBufs gives the handler's buffers back; nil when the queue mapped its own.
	freeBufs func()
	reqs     []Request
	bell     *uring.Doorbell // handlers wake the loop with it

	mu   sync.Mutex
	done []completion
	quit atomic.Bool

	// Only the loop touches these.
	aborted, inflight int
	refused           int32 // the first commit the driver refused (a negative errno other than abort's)
	ring              *uring.Ring
	leakBufs          bool // drain gave up: a handler may still write to bufs
	deferred          bool // the ring runs the driver's work only when the loop enters it
	idle              int  // waits in a row that ran out with no request in flight
	touched           bool // a request has used bufs since they were last given back
}

// refuseFetch, set by a test, sends queue 0's first fetch for a queue the device lacks:
// the driver refuses it, as it would any fetch it cannot take.
var refuseFetch bool

// refuseCommit, set by a test, sends the next commit of a write, in any queue, for a queue
// the device lacks: the driver refuses it, which fails that queue.
var refuseCommit atomic.Bool

// idleWaits is how many empty waits (waitSlice each) a queue with no request in flight lets
// pass before it gives its buffers' pages back.
var idleWaits = 2

// failQueueSetup, set by a test, is a queue whose setup fails (-1: none).
var failQueueSetup = -1

// errSetupInjected is the failure failQueueSetup injects.
var errSetupInjected = errors.New("ublk: queue setup failed (test switch)")

func newQueue(d *Device, id int, h Handler) (*queue, error) {
	if id == failQueueSetup {
		return nil, errSetupInjected
	}
	depth, maxIO := int(d.info.QueueDepth), int(d.info.MaxIOBufBytes)
	q := &queue{d: d, id: id, depth: depth, maxIO: maxIO, h: h}
	var err error
	if bp, ok := h.(BufferProvider); ok {
		if b, free := bp.QueueBuffers(id, depth, maxIO); len(b) == depth*maxIO {
			q.bufs, q.freeBufs = b, free
		} else if free != nil {
			free() // not the size asked for: the queue's own serve
		}
	}
	if q.bufs == nil {
		q.bufs, err = unix.Mmap(-1, 0, depth*maxIO, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	}
	if err != nil {
		q.release()
		return nil, fmt.Errorf("ublk queue %d: buffers: %w", id, err)
	}
	if q.bell, err = uring.NewDoorbell(); err != nil {
		q.release()
		return nil, fmt.Errorf("ublk queue %d: eventfd: %w", id, err)
	}
	q.reqs = make([]Request, depth)
	for i := range q.reqs {
		q.reqs[i] = Request{Queue: id, q: q, tag: uint16(i)}
	}
	return q, nil
}

// mapDescs maps the queue's request descriptors from the char device, open by now.
func (q *queue) mapDescs() error {
	page := os.Getpagesize()
	stride := roundUp(maxQueueDepth*ioDescSize, page)
	var err error
	q.descs, err = unix.Mmap(int(q.d.cdev.Fd()), ioDescBufOffset+int64(q.id*stride), roundUp(q.depth*ioDescSize, page),
		unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		q.descs = nil
		return fmt.Errorf("ublk queue %d: mmap of the descriptors: %w", q.id, err)
	}
	return nil
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// release frees what newQueue took; the loop has ended.
func (q *queue) release() {
	if q.descs != nil {
		_ = unix.Munmap(q.descs)
		q.descs = nil
	}
	if q.bufs != nil && !q.leakBufs {
		if q.freeBufs != nil {
			q.freeBufs()
		} else {
			_ = unix.Munmap(q.bufs)
		}
		q.bufs = nil
	}
	if q.bell != nil {
		q.bell.Close()
	}
}

// complete hands a finished request to the loop, waking it if it sleeps.
func (q *queue) complete(tag uint16, res int32) {
	q.mu.Lock()
	q.done = append(q.done, completion{tag, res})
	q.mu.Unlock()
	q.bell.Ring()
}

// run is the queue's loop: fetch every tag, then serve requests and commit their results
// until the driver aborts every fetch (the device stopped) or quit is set.
func (q *queue) run(ready chan<- error, fetch <-chan bool) {
	defer q.d.wg.Done()
	// The thread is the queue's daemon task for the driver, and it ends with the loop
	// (never unlocked): a task that exits runs what io_uring still had queued for it, so
	// the char device is released at once even when the loop quit on its own.
	runtime.LockOSThread()
	// One thread submits and waits: the kernel need not interrupt it to run a completion's
	// work, and runs that work in batches when the loop enters to wait. 6.0 lacks
	// DEFER_TASKRUN and refuses the set: then a ring without them.
	ring, err := uring.New(uint32(q.depth+1), uring.SetupCoopTaskrun|uring.SetupSingleIssuer|uring.SetupDeferTaskrun)
	q.deferred = err == nil
	if errors.Is(err, unix.EINVAL) {
		ring, err = uring.New(uint32(q.depth+1), 0)
	}
	if err != nil {
		ready <- fmt.Errorf("ublk queue %d: %w", q.id, err)
		return
	}
	q.ring = ring
	defer ring.Close()
	// Set up: the fetches wait for Device.begin (false: no fetch, the device is given up).
	ready <- nil
	if !<-fetch {
		return
	}
	for tag := range q.depth {
		c := q.cmd(ioFetchReq, uint16(tag), 0)
		if refuseFetch && q.id == 0 && tag == 0 {
			c.QID = 0xffff
		}
	}
	q.bell.Arm(ring, udWake)
	if _, err := ring.Submit(0, 0); err != nil {
		ready <- fmt.Errorf("ublk queue %d: submitting the fetches: %w", q.id, err)
		return
	}
	// A fetch the driver refuses is answered within the submit. The device cannot start
	// then: START_DEV and END_USER_RECOVERY wait for every tag's fetch.
	var refused int32
	ring.Completions(func(c uring.CQE) {
		if c.UserData != udWake && c.Res < 0 && refused == 0 {
			refused = c.Res
		}
		q.completion(c)
	})
	if refused != 0 {
		ready <- fmt.Errorf("ublk queue %d: the driver refused a fetch: %w", q.id, unix.Errno(-refused))
		return
	}
	ready <- nil
	for !q.quit.Load() && (q.aborted < q.depth || q.inflight > 0) {
		wait := uint32(0)
		if !q.commit() {
			q.bell.Sleep()
			if q.commit() {
				q.bell.Awake()
			} else {
				wait = 1
			}
		}
		if _, err := ring.Submit(wait, waitSlice); err != nil {
			q.bell.Awake()
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EBUSY) {
				// Short of memory, or completions to take before more can be submitted:
				// take them and go again.
				ring.Completions(q.completion)
				time.Sleep(time.Millisecond)
				continue
			}
			q.fail(err)
			break
		}
		q.bell.Awake()
		n := ring.Completions(q.completion)
		if q.refused != 0 {
			// The driver and this loop disagree on a tag's state: serving on would be on
			// guesses. The queue's requests wait until the device is stopped.
			q.fail(fmt.Errorf("the driver refused a commit: %w", unix.Errno(-q.refused)))
			break
		}
		q.reclaim(wait > 0 && n == 0)
	}
	q.drain()
}

// fail ends the loop on err: the handler hears of it, and the device's Stop closes the
// char device first (see Device.stop).
func (q *queue) fail(err error) {
	// Marked before the handler hears: a Stop it starts must find the mark.
	q.d.queueFailed.Store(true)
	q.quit.Store(true)
	if fr, ok := q.h.(FailureReporter); ok {
		fr.QueueFailed(q.id, err)
	}
}

// reclaim gives the buffers' pages back once the queue has been idle for idleWaits waits:
// depth × max IO per queue (about 16 MiB at 128 × 124 KiB) would otherwise stay resident for as
// long as the device exists, used or not. It is safe only between entries of a ring that
// defers the driver's work to them: a write's data is copied into a buffer by that work,
// and its completion is taken in the same entry; with nothing in flight and nothing
// committed this round, no buffer holds data anyone still needs.
func (q *queue) reclaim(emptyWait bool) {
	// A commit the kernel has not taken yet (a submit that took only some entries) still
	// has its read's data to copy out of the buffer.
	if !emptyWait || q.inflight > 0 || q.ring.Unsubmitted() > 0 {
		q.idle = 0
		return
	}
	if q.idle++; q.idle < idleWaits || !q.touched || !q.deferred || q.freeBufs != nil {
		return
	}
	// The pages read as zeroes when the driver next touches them; a failure keeps them.
	if unix.Madvise(q.bufs, unix.MADV_DONTNEED) == nil {
		q.touched = false
	}
}

// drainTimeout bounds how long a queue that quits waits for its requests' handlers (a var:
// a test whose handler holds a request for ever shortens it).
var drainTimeout = 30 * time.Second

// drain waits for the handlers of requests still in flight (they write to the buffers):
// the buffers are kept, not unmapped, if some never finish.
func (q *queue) drain() {
	for t0 := time.Now(); q.inflight > 0; time.Sleep(10 * time.Millisecond) {
		q.mu.Lock()
		q.inflight -= len(q.done)
		q.done = nil
		q.mu.Unlock()
		if q.inflight > 0 && time.Since(t0) > drainTimeout {
			q.leakBufs = true
			return
		}
	}
}

// commit queues a COMMIT_AND_FETCH for every finished request; false if there were none.
func (q *queue) commit() bool {
	q.mu.Lock()
	done := q.done
	q.done = nil
	q.mu.Unlock()
	for _, c := range done {
		q.inflight--
		cmd := q.cmd(ioCommitAndFetchReq, c.tag, c.res)
		if q.reqs[c.tag].Op == OpWrite && refuseCommit.CompareAndSwap(true, false) {
			cmd.QID = 0xffff
		}
	}
	return len(done) > 0
}

// cmd queues an IO command for tag, returned until the next submit; there is always room
// (one entry per tag, one for the wake-up read).
func (q *queue) cmd(op uint32, tag uint16, res int32) *ioCmd {
	s := q.ring.GetSQE()
	s.Opcode, s.Fd, s.Off, s.UserData = uring.OpURingCmd, int32(q.d.cdev.Fd()), uint64(ioOp(op)), uint64(tag)
	c := (*ioCmd)(unsafe.Pointer(&q.ring.Cmd(s)[0]))
	*c = ioCmd{QID: uint16(q.id), Tag: tag, Result: res, Addr: uint64(uintptr(unsafe.Pointer(&q.bufs[int(tag)*q.maxIO])))}
	return c
}

// completion handles one completion of the ring: a request fetched, a fetch aborted, or
// the wake-up read.
func (q *queue) completion(c uring.CQE) {
	if c.UserData == udWake {
		q.bell.Arm(q.ring, udWake)
		return
	}
	tag := uint16(c.UserData)
	if c.Res != 0 {
		// UBLK_IO_RES_ABORT: the device is stopping; anything else: the driver refused the
		// command, and the tag is lost to this queue all the same.
		q.aborted++
		if c.Res != ioResAbort && q.refused == 0 {
			q.refused = c.Res
		}
		return
	}
	desc := (*IODesc)(unsafe.Pointer(&q.descs[int(tag)*ioDescSize]))
	r := &q.reqs[tag]
	r.Op, r.Flags = uint8(desc.OpFlags), desc.OpFlags&^0xff
	r.Off, r.Len = int64(desc.StartSector)<<9, int(desc.NrSectors)<<9
	if r.Op == OpFlush {
		r.Off = 0 // the block layer's flush requests have no sector (it shows as -1)
	}
	r.Buf = nil
	if (r.Op == OpRead || r.Op == OpWrite) && r.Len <= q.maxIO {
		r.Buf = q.bufs[int(tag)*q.maxIO : int(tag)*q.maxIO+r.Len]
	}
	q.inflight++
	q.touched = true
	q.h.Serve(r)
}
