package rnbd

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/uring"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// directIO serves a block device export's READs and WRITEs as the kernel's server sends
// bios: O_DIRECT, so no page cache stands between the client and the device (no second copy
// of the data in the server's memory, and a WRITE is at the device when it is answered), and
// through an io_uring, so no thread waits per IO. One goroutine, locked to its thread, owns
// the ring: the transport's goroutines queue requests and ring its doorbell; it submits them
// in batches, reaps their completions and answers them.
type directIO struct {
	fd     int // the device, opened O_DIRECT
	align  uintptr
	answer func(r *transport.SrvRequest, err error)
	bell   *uring.Doorbell
	ended  chan struct{} // closed when the loop has ended

	mu      sync.Mutex
	queued  []dioOp // not yet submitted
	closing bool
	broken  bool // the ring failed: submit refuses, and the caller uses the page cache

	// Only the loop touches these.
	ring     *uring.Ring
	ops      []dioOp  // in flight, by slot
	free     []uint16 // free slots
	round    []uint64 // the user data of the entries the kernel has not taken yet, in order
	inflight int
}

// dioOp is one READ or WRITE, or what is left of it after a short transfer.
type dioOp struct {
	r          *transport.SrvRequest
	write, fua bool
	buf        []byte
	off        int64
}

const (
	// dioEntries is the ring's size: a slot per IO in flight, one entry for the doorbell.
	// More requests than that wait in the queue, bounded by the chunks of the sessions'
	// paths, which the server sizes.
	dioEntries = 128
	udBell     = 1 << 32
	// dioWaitSlice bounds one wait of the loop, so it notices a close however it was woken.
	dioWaitSlice = time.Second
)

// dioDrainTimeout bounds how long a close waits for IO in flight before it leaves the loop
// running (and the descriptors open) rather than hang: a device that stopped answering. A
// variable for the tests.
var dioDrainTimeout = 30 * time.Second

// newDirectIO opens the block device at path O_DIRECT (writable or not) and starts its
// loop; answer is called once per request, on the loop's thread, when it is done.
func newDirectIO(path string, writable bool, lbs int, answer func(*transport.SrvRequest, error)) (*directIO, error) {
	flags := unix.O_RDONLY
	if writable {
		flags = unix.O_RDWR
	}
	fd, err := unix.Open(path, flags|unix.O_DIRECT|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s O_DIRECT: %w", path, err)
	}
	if err := probeDirect(fd, lbs); err != nil {
		unix.Close(fd)
		return nil, err
	}
	bell, err := uring.NewDoorbell()
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	d := &directIO{fd: fd, align: uintptr(lbs), answer: answer, bell: bell, ended: make(chan struct{}),
		ops: make([]dioOp, dioEntries-1)}
	for i := range d.ops {
		d.free = append(d.free, uint16(i))
	}
	ready := make(chan error, 1)
	go d.run(ready)
	if err := <-ready; err != nil {
		<-d.ended
		bell.Close()
		unix.Close(fd)
		return nil, err
	}
	return d, nil
}

// probeDirect reads the device's first block with O_DIRECT into a page-aligned buffer, as the
// chunks are: a device that takes the open but not the IO (or wants more alignment than a
// page) is found here, at open, rather than failing a client's IO. An empty device reads
// nothing and passes.
func probeDirect(fd, lbs int) error {
	buf, err := unix.Mmap(-1, 0, lbs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	for {
		_, err = unix.Pread(fd, buf, 0)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("an O_DIRECT read of %d bytes: %w", lbs, err)
	}
	return nil
}

// submit queues a READ (into buf) or a WRITE (of buf, durable before it is answered with
// fua) at off; false if O_DIRECT cannot take buf (not aligned to the logical block), which
// the caller then serves through the page cache. The caller holds the device open: close
// comes after every submit.
func (d *directIO) submit(r *transport.SrvRequest, write, fua bool, buf []byte, off int64) bool {
	if len(buf) == 0 {
		d.answer(r, nil)
		return true
	}
	if uintptr(unsafe.Pointer(&buf[0]))%d.align != 0 || uintptr(len(buf))%d.align != 0 || uintptr(off)%d.align != 0 {
		return false
	}
	d.mu.Lock()
	if d.broken {
		d.mu.Unlock()
		return false
	}
	d.queued = append(d.queued, dioOp{r: r, write: write, fua: fua, buf: buf, off: off})
	d.mu.Unlock()
	d.bell.Ring()
	return true
}

// close waits for the IO queued and in flight to be answered, ends the loop and closes the
// device; after dioDrainTimeout it gives up with EBUSY and leaves both to finish on their
// own: release, once ended is closed, lets the descriptors go.
func (d *directIO) close() error {
	d.mu.Lock()
	d.closing = true
	d.mu.Unlock()
	d.bell.Wake()
	select {
	case <-d.ended:
	case <-time.After(dioDrainTimeout):
		return fmt.Errorf("direct IO still in flight after %v: %w", dioDrainTimeout, syscall.EBUSY)
	}
	return d.release()
}

// release closes the doorbell and the device once the loop has ended.
func (d *directIO) release() error {
	d.bell.Close()
	return unix.Close(d.fd)
}

// run is the loop: submit what is queued, wait for completions or the doorbell, answer.
func (d *directIO) run(ready chan<- error) {
	stranded := false
	defer func() {
		if !stranded {
			close(d.ended)
		}
	}()
	// Never unlocked: the thread ends with the loop, and the ring's deferred work with it.
	runtime.LockOSThread()
	ring, err := uring.New(dioEntries, uring.SetupCoopTaskrun|uring.SetupSingleIssuer|uring.SetupDeferTaskrun)
	if errors.Is(err, unix.EINVAL) { // before 6.1
		ring, err = uring.New(dioEntries, 0)
	}
	if err != nil {
		ready <- err
		return
	}
	defer ring.Close()
	d.ring = ring
	d.arm()
	ready <- nil
	var stuck time.Time // since when the kernel has refused the entries, or zero
	for {
		took, closing := d.take()
		if closing && !took && d.inflight == 0 {
			return
		}
		wait := uint32(0)
		if !took && !closing {
			d.bell.Sleep()
			if took, _ = d.take(); took {
				d.bell.Awake()
			} else {
				wait = 1
			}
		} else if !took {
			wait = 1 // closing: wait for what is in flight
		}
		n, err := dioEnter(ring, wait, dioWaitSlice)
		if err != nil {
			if !transientEnter(err) || !stuck.IsZero() && time.Since(stuck) > dioStuckTimeout {
				// IO the kernel took before may still reach the device (and the
				// chunks): the device is then never let go (ended stays open), so
				// its access mode keeps counting and its descriptors stay open.
				stranded = d.inflight > d.notTaken()
				d.fail(fmt.Errorf("io_uring: %w", err))
				return
			}
			// The kernel took none of the entries for now (no memory for its requests,
			// or completions it could not post): they stay in the ring, and what is done
			// is answered before the next try.
			if stuck.IsZero() {
				stuck = time.Now()
			}
			d.bell.Awake()
			ring.Completions(d.completion)
			time.Sleep(time.Millisecond)
			continue
		}
		stuck = time.Time{}
		// The kernel takes entries in order and may take only some: the rest stay in
		// the ring for the next call, and in round.
		d.round = d.round[:copy(d.round, d.round[min(n, len(d.round)):])]
		d.bell.Awake()
		ring.Completions(d.completion)
	}
}

// dioEnter submits the loop's entries and waits; a variable for the tests, which make it
// fail.
var dioEnter = (*uring.Ring).Submit

// dioStuckTimeout bounds how long the loop keeps trying entries the kernel refuses for want
// of memory or room before it gives the ring up (fail).
const dioStuckTimeout = 10 * time.Second

// transientEnter: io_uring_enter's refusals that pass (EAGAIN, ENOMEM: no memory for the
// requests; EBUSY: completions waiting for room).
func transientEnter(err error) bool {
	return errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EBUSY)
}

// take moves queued operations into free slots and their entries; it reports whether it
// took any and whether the device is closing.
func (d *directIO) take() (took, closing bool) {
	d.mu.Lock()
	n := min(len(d.queued), len(d.free))
	batch := d.queued[:n]
	closing = d.closing
	for _, op := range batch {
		slot := d.free[len(d.free)-1]
		d.free = d.free[:len(d.free)-1]
		d.ops[slot] = op
		d.round = append(d.round, uint64(slot))
		d.prep(slot)
	}
	d.queued = d.queued[:copy(d.queued, d.queued[n:])]
	d.mu.Unlock()
	d.inflight += n
	return n > 0, closing
}

// prep fills the ring's next entry for the operation in slot.
func (d *directIO) prep(slot uint16) {
	op := &d.ops[slot]
	s := d.ring.GetSQE()
	s.Opcode, s.Fd, s.Off, s.UserData = uring.OpRead, int32(d.fd), uint64(op.off), uint64(slot)
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&op.buf[0]))), uint32(len(op.buf))
	if op.write {
		s.Opcode = uring.OpWrite
		if op.fua {
			s.OpFlags = unix.RWF_DSYNC // REQ_FUA on the write's bios
		}
	}
}

// arm queues the doorbell's read.
func (d *directIO) arm() {
	d.bell.Arm(d.ring, udBell)
	d.round = append(d.round, udBell)
}

// notTaken is how many operations the kernel has not taken from the ring yet.
func (d *directIO) notTaken() int {
	n := 0
	for _, ud := range d.round {
		if ud != udBell {
			n++
		}
	}
	return n
}

// completion handles one of the ring's completions: the doorbell's read, or an operation's.
func (d *directIO) completion(c uring.CQE) {
	if c.UserData == udBell {
		d.arm()
		return
	}
	slot := uint16(c.UserData)
	op := d.ops[slot]
	d.ops[slot] = dioOp{}
	d.free = append(d.free, slot)
	d.inflight--
	var err error
	switch {
	case c.Res < 0:
		err = uring.Errno(c.Res)
	case c.Res == 0:
		err = fmt.Errorf("%s at %d beyond the device's end: %w", opName(op.write), op.off, syscall.EIO)
	case int(c.Res) < len(op.buf):
		// A short transfer (the device shrank, or split the IO): the rest again.
		op.buf, op.off = op.buf[c.Res:], op.off+int64(c.Res)
		d.mu.Lock()
		d.queued = append(d.queued, op)
		d.mu.Unlock()
		return
	}
	d.answer(op.r, err)
}

// fail is for a ring that broke (never seen): later requests go through the page cache,
// those queued or in the ring but not taken by the kernel (a Submit that fails takes none,
// an earlier one may have taken only some) are answered with err, and those in flight are
// left unanswered, since the device may still write into their chunks: the transport's
// close gives up on them.
func (d *directIO) fail(err error) {
	d.mu.Lock()
	q := d.queued
	d.queued, d.broken = nil, true
	d.mu.Unlock()
	for _, ud := range d.round {
		if ud != udBell {
			q = append(q, d.ops[ud])
		}
	}
	for _, op := range q {
		d.answer(op.r, err)
	}
}

func opName(write bool) string {
	if write {
		return "write"
	}
	return "read"
}
