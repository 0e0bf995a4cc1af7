package rnbd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/aio"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// directIO serves a block device export's READs and WRITEs as the kernel's server sends
// bios: O_DIRECT, so no page cache stands between the client and the device (no second copy
// of the data in the server's memory, and a WRITE is at the device when it is answered), and
// through Linux AIO, so no thread waits per IO. The transport's goroutine submits the
// requests of its receive burst itself, in one io_submit at the burst's end and with
// RWF_NOWAIT, so it does not wait for the device (but for a driver whose queue function
// sleeps, as nbd's, which runs in the submitter) and no other thread is woken to submit; one
// goroutine (the reaper) answers the completions, and submits, blocking, what could not go
// without waiting. Each request's completion signals an eventfd the reaper waits on in Go's
// netpoller, so an idle device holds no thread (a reaper blocked in io_getevents held one;
// the two measured even). io_uring would need a thread of its own per ring and a wake-up of it per
// burst (docs/design.md).
type directIO struct {
	fd     int // the device, opened O_DIRECT
	align  uintptr
	answer func(r *transport.SrvRequest, err error)
	ctx    *aio.Context
	// bell is an eventfd that every request's completion signals (aio.FlagResFd) and wake
	// writes; the reaper waits on it in the netpoller.
	bell   *os.File
	bellC  syscall.RawConn
	bellFd uint32      // its descriptor (File.Fd would make it blocking)
	rung   atomic.Bool // wake wrote the bell and the reaper has not read it since
	// quiet is closed once the device is closing and none of the session's IO is queued or at
	// the device (the open's late probe may be); ended once nothing is, and the reaper is gone.
	quiet chan struct{}
	ended chan struct{}

	mu        sync.Mutex
	queued    []dioOp // not yet submitted
	scheduled bool    // a burst's end will submit what is queued
	ops       []dioOp // taken for submission or at the device, by slot
	cbs       []aio.IOCB
	free      []uint16
	inflight  int // slots taken
	closing   bool
	late      bool   // the open's probe read had not come back by dioProbeTimeout
	probeOut  bool   // and is still at the device (a slot, counted in inflight)
	probeBuf  []byte // its buffer (mapped), let go when it comes back
	quieted   bool   // quiet is closed
	broken    bool   // submission failed for good: submit refuses, and the caller uses the page cache
	err       error  // why
	blocking  bool   // the device refuses RWF_NOWAIT: only the reaper submits
}

// dioOp is one READ or WRITE, or what is left of it after a short transfer.
type dioOp struct {
	r          *transport.SrvRequest
	write, fua bool
	buf        []byte
	off        int64
	nowait     bool // submitted with RWF_NOWAIT
}

const (
	// dioEntries is the AIO context's size: a slot per IO in flight. More requests than
	// that wait in the queue, bounded by the chunks of the sessions' paths, which the
	// server sizes.
	dioEntries = 128
	// dioStuckTimeout bounds how long the reaper keeps trying requests the kernel refuses
	// for want of resources, with nothing at the device to free them, before it gives up.
	dioStuckTimeout = 10 * time.Second
)

// dioHandOff is the size from which the transport's goroutine leaves a request's
// submission to the reaper: building the bios of a large IO (its pages pinned) costs more
// than the wake-up, and runs beside the transport's next receives.
const dioHandOff = 64 << 10

// dioWaitSlice bounds one wait of the reaper for its bell; a variable for the tests, which
// show that nothing waits for it.
var dioWaitSlice = time.Second

// dioProbeTimeout bounds how long an open waits for its probe read; a variable for the
// tests.
var dioProbeTimeout = 10 * time.Second

// dioDrainTimeout bounds how long a close waits for IO in flight before it leaves the reaper
// running (and the descriptors open) rather than hang: a device that stopped answering. A
// variable for the tests.
var dioDrainTimeout = 30 * time.Second

// dioSubmit and dioReady are the context's calls; variables for the tests, which make
// them fail.
var (
	dioSubmit = (*aio.Context).Submit
	dioReady  = (*aio.Context).Ready
)

// newDirectIO opens the block device at path O_DIRECT (writable or not), probes it and starts
// its reaper; answer is called once per request when it is done, on the reaper's goroutine
// or, for a request refused at submission, on the submitter's.
func newDirectIO(path string, writable bool, lbs int, answer func(*transport.SrvRequest, error)) (*directIO, error) {
	flags := unix.O_RDONLY
	if writable {
		flags = unix.O_RDWR
	}
	flags |= unix.O_DIRECT | unix.O_CLOEXEC | unix.O_NOCTTY
	// No access time to update on the transport's goroutine at each READ; only the owner
	// (or CAP_FOWNER) may ask.
	fd, err := unix.Open(path, flags|unix.O_NOATIME, 0)
	if err == unix.EPERM {
		fd, err = unix.Open(path, flags, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("open %s O_DIRECT: %w", path, err)
	}
	d := &directIO{fd: fd, align: uintptr(lbs), answer: answer, quiet: make(chan struct{}), ended: make(chan struct{}),
		ops: make([]dioOp, dioEntries), cbs: make([]aio.IOCB, dioEntries)}
	for i := range d.ops {
		d.free = append(d.free, uint16(i))
	}
	if d.ctx, err = aio.New(dioEntries); err != nil {
		unix.Close(fd)
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		_ = d.ctx.Destroy()
		unix.Close(fd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	d.bell, d.bellFd = os.NewFile(uintptr(efd), "direct IO bell"), uint32(efd) // non-blocking: in the netpoller
	if d.bellC, err = d.bell.SyscallConn(); err != nil {
		_ = d.release()
		return nil, err
	}
	if d.late, err = d.probe(lbs); err != nil {
		_ = d.release()
		return nil, err
	}
	go d.run()
	return d, nil
}

// probe reads the device's first block into a page-aligned buffer, as the chunks are, through
// the context: a device that takes the open but not the IO (or wants more alignment than a
// page) is found here, at open, rather than failing a client's IO. An empty device reads
// nothing and passes. The read is submitted with RWF_NOWAIT, again while the device has no
// request free, so that io_submit does not sleep either. A device that has not answered
// after dioProbeTimeout is taken as it is (late), as the kernel's server opens a device
// without reading it: the read, if the device took it, stays there (probeOut) and the reaper
// takes its completion; the OPEN, and the session's control requests behind it, no longer
// wait for a device that may never answer.
func (d *directIO) probe(lbs int) (late bool, err error) {
	if d.probeBuf, err = unix.Mmap(-1, 0, lbs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		return false, fmt.Errorf("an O_DIRECT read of %d bytes: %w", lbs, err)
	}
	deadline := time.Now().Add(dioProbeTimeout)
	slot := d.free[len(d.free)-1] // before the reaper: nothing else takes slots yet
	nowait := true
	var ev [1]aio.Event
	for {
		d.mu.Lock()
		d.ops[slot] = dioOp{buf: d.probeBuf, nowait: nowait} // no request: the reaper answers nobody
		d.prep(slot)
		d.mu.Unlock()
		took, err := dioSubmit(d.ctx, []*aio.IOCB{&d.cbs[slot]})
		switch {
		case nowait && errors.Is(err, unix.EOPNOTSUPP):
			nowait = false // the device cannot say it would wait: ask as the reaper would
			continue
		case err != nil && !errors.Is(err, unix.EAGAIN):
			return fail(err)
		case err != nil || took == 0:
			// No request free at the device: again shortly, until the deadline.
			if time.Now().After(deadline) {
				return true, nil
			}
			time.Sleep(time.Millisecond)
			continue
		}
		d.mu.Lock()
		d.free = d.free[:len(d.free)-1]
		d.inflight++
		d.probeOut = true
		d.mu.Unlock()
		res, done := d.probeWait(deadline, ev[:])
		if !done {
			return true, nil // the reaper takes it
		}
		d.probeDone(slot)
		switch {
		case nowait && (res == -int64(unix.EAGAIN) || res == -int64(unix.EOPNOTSUPP)):
			nowait = nowait && res == -int64(unix.EAGAIN)
			if time.Now().After(deadline) {
				return true, nil
			}
			if nowait {
				time.Sleep(time.Millisecond)
			}
		case res < 0:
			return fail(unix.Errno(-res))
		default:
			return false, nil
		}
	}
}

// probeWait waits until deadline for the probe's completion and returns its result; not done
// if it is still at the device, or the context or the bell failed (which the reaper then
// meets too, and stops with the read counted).
func (d *directIO) probeWait(deadline time.Time, ev []aio.Event) (res int64, done bool) {
	for {
		n, err := dioReady(d.ctx, ev)
		if err != nil {
			return 0, false
		}
		if n == 1 {
			return ev[0].Res, true
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			return 0, false
		}
		if err := d.waitBell(wait); err != nil {
			return 0, false
		}
	}
}

// probeDone gives the probe's slot back once its read has come back (under no lock).
func (d *directIO) probeDone(slot uint16) {
	d.mu.Lock()
	d.ops[slot] = dioOp{}
	d.free = append(d.free, slot)
	d.inflight--
	d.probeOut = false
	d.mu.Unlock()
}

// wake has the reaper look at the queue and the closing flag, which the caller set before.
func (d *directIO) wake() {
	if d.rung.CompareAndSwap(false, true) {
		var one [8]byte
		binary.LittleEndian.PutUint64(one[:], 1)
		_ = d.bellC.Write(func(fd uintptr) bool {
			_, err := unix.Write(int(fd), one[:])
			return err != unix.EAGAIN // only at a count of 2^64-2: the bell rings already
		})
	}
}

// waitBell waits up to wait for the bell (a completion, or wake) and clears it; at once when
// it rang since the last call. An error is one that would recur at every wait.
func (d *directIO) waitBell(wait time.Duration) error {
	if err := d.bell.SetReadDeadline(time.Now().Add(wait)); err != nil {
		return err
	}
	var b [8]byte
	var rerr error
	err := d.bellC.Read(func(fd uintptr) bool {
		_, rerr = unix.Read(int(fd), b[:])
		return rerr != unix.EAGAIN
	})
	// Cleared after the read: a wake between the two is seen by the look at the queue and
	// the closing flag that follows; one after it writes again.
	d.rung.Store(false)
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil
	case err != nil:
		return err
	case rerr != nil && rerr != unix.EINTR:
		return rerr
	}
	return nil
}

// submit queues a READ (into buf) or a WRITE (of buf, durable before it is answered with
// fua) at off. inBurst says the caller is the transport's goroutine handing up r in a
// receive burst: the request is then submitted at the burst's end, with the burst's others;
// any other caller may wait, and submits it at once. False if O_DIRECT cannot take buf (not
// aligned to the logical block), or submission failed for good, which the caller then
// serves through the page cache. The caller holds the device open: close comes after every
// submit.
func (d *directIO) submit(r *transport.SrvRequest, write, fua bool, buf []byte, off int64, inBurst bool) bool {
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
	if !inBurst {
		d.mu.Unlock()
		d.push(false)
		return true
	}
	if d.blocking || len(buf) >= dioHandOff {
		d.mu.Unlock()
		d.wake()
		return true
	}
	sched := !d.scheduled
	d.scheduled = true
	d.mu.Unlock()
	if sched && !r.AtBurstEnd(d.flush) {
		d.flush()
	}
	return true
}

// flush submits what is queued without waiting for the device (RWF_NOWAIT); what the kernel
// does not take goes to the reaper.
func (d *directIO) flush() {
	d.mu.Lock()
	d.scheduled = false
	d.mu.Unlock()
	d.push(true)
}

// push submits the queued operations that have a free slot and reports whether it left any
// in the queue: the kernel did not take them (with nowait, they would have waited; without,
// it is short of resources) or no slot was free. The reaper is woken for those a nowait
// push leaves. A submission that fails for good answers what it did not submit with the
// error, and later requests go through the page cache.
func (d *directIO) push(nowait bool) (left bool) {
	d.mu.Lock()
	if d.broken {
		d.mu.Unlock()
		return false
	}
	if nowait && d.blocking {
		// Found out since the burst's end was asked for: the reaper submits.
		d.mu.Unlock()
		d.wake()
		return true
	}
	n := min(len(d.queued), len(d.free))
	if n == 0 {
		left = len(d.queued) > 0
		d.mu.Unlock()
		return left
	}
	slots := make([]uint16, n)
	cbs := make([]*aio.IOCB, n)
	for i, op := range d.queued[:n] {
		slot := d.free[len(d.free)-1]
		d.free = d.free[:len(d.free)-1]
		op.nowait = nowait
		d.ops[slot] = op
		d.prep(slot)
		slots[i], cbs[i] = slot, &d.cbs[slot]
	}
	k := copy(d.queued, d.queued[n:])
	clear(d.queued[k:]) // no answered request stays reachable from the tail
	d.queued = d.queued[:k]
	d.inflight += n
	d.mu.Unlock()

	took, err := dioSubmit(d.ctx, cbs)
	if errors.Is(err, unix.EAGAIN) {
		took, err = 0, nil
	}

	d.mu.Lock()
	var back []dioOp
	for _, slot := range slots[took:] {
		back = append(back, d.ops[slot])
		d.ops[slot] = dioOp{}
		d.free = append(d.free, slot)
	}
	d.inflight -= n - took
	var fails []dioOp
	if err != nil {
		fails = append(back, d.queued...)
		d.queued, d.broken, d.err = nil, true, err
	} else if len(back) > 0 {
		d.queued = append(back, d.queued...)
	}
	left = len(d.queued) > 0
	d.mu.Unlock()
	d.fail(fails, err)
	if left && nowait {
		d.wake()
	}
	return left
}

// prep fills the IOCB for the operation in slot.
func (d *directIO) prep(slot uint16) {
	op := &d.ops[slot]
	cb := &d.cbs[slot]
	*cb = aio.IOCB{Data: uint64(slot), Opcode: aio.CmdPread, Fd: uint32(d.fd),
		Buf: uint64(uintptr(unsafe.Pointer(&op.buf[0]))), Nbytes: uint64(len(op.buf)), Offset: op.off,
		Flags: aio.FlagResFd, ResFd: d.bellFd}
	if op.write {
		cb.Opcode = aio.CmdPwrite
		if op.fua {
			cb.RWFlags |= unix.RWF_DSYNC // REQ_FUA on the write's bios
		}
	}
	if op.nowait {
		cb.RWFlags |= unix.RWF_NOWAIT
	}
}

// errProbeOut is close's answer when the session's IO has ended but the open's late probe
// read is still at the device.
var errProbeOut = errors.New("the open's probe read is still at the device")

// close waits for the IO queued and in flight to be answered, ends the reaper and closes the
// device. After dioDrainTimeout it gives up with EBUSY and leaves both to finish on their
// own; when only the open's late probe is left it does not wait for it (errProbeOut). In
// both cases release, once ended is closed, lets the descriptors go.
func (d *directIO) close() error {
	d.mu.Lock()
	d.closing = true
	d.mu.Unlock()
	d.wake()
	timeout := time.NewTimer(dioDrainTimeout)
	defer timeout.Stop()
	select {
	case <-d.quiet:
	case <-timeout.C:
		return fmt.Errorf("direct IO still in flight after %v: %w", dioDrainTimeout, syscall.EBUSY)
	}
	d.mu.Lock()
	probe := d.probeOut
	d.mu.Unlock()
	if probe {
		return errProbeOut
	}
	select {
	case <-d.ended:
	case <-timeout.C:
		return fmt.Errorf("direct IO still in flight after %v: %w", dioDrainTimeout, syscall.EBUSY)
	}
	return d.release()
}

// release tears the context down, and closes the bell and the device, once nothing is at
// the device.
func (d *directIO) release() error {
	_ = d.ctx.Destroy()
	_ = d.bell.Close()
	if d.probeBuf != nil {
		_ = unix.Munmap(d.probeBuf)
	}
	return unix.Close(d.fd)
}

// run is the reaper: answer the completions there are, submit what is queued, wait for the
// bell.
func (d *directIO) run() {
	stranded := false
	defer func() {
		if !stranded {
			close(d.ended)
		}
	}()
	events := make([]aio.Event, dioEntries)
	var stuck time.Time // since when the kernel has refused requests with nothing in flight
	// A round: the completions there are, then the queue and the closing flag, which they
	// may change (a slot freed, IO to go again, the last IO ended), then the bell. Each
	// completion rings it after its event is in the ring, so one that comes after the look
	// has the wait return at once.
	for {
		for {
			n, err := dioReady(d.ctx, events)
			if err != nil {
				d.stop(&stranded, fmt.Errorf("io_getevents: %w", err))
				return
			}
			for _, ev := range events[:n] {
				d.completion(ev)
			}
			if n < len(events) {
				break
			}
		}
		left := d.push(false)
		d.mu.Lock()
		idle := d.closing && d.inflight == 0 && len(d.queued) == 0
		if d.closing && !d.quieted && len(d.queued) == 0 && (d.inflight == 0 || d.inflight == 1 && d.probeOut) {
			d.quieted = true
			close(d.quiet)
		}
		starved := left && d.inflight == 0
		d.mu.Unlock()
		if idle {
			return
		}
		wait := dioWaitSlice
		if starved {
			// Refused for want of resources, and nothing at the device to free them:
			// try again shortly, for a while.
			if stuck.IsZero() {
				stuck = time.Now()
			} else if time.Since(stuck) > dioStuckTimeout {
				d.giveUp(fmt.Errorf("io_submit refused the requests for %v: %w", dioStuckTimeout, syscall.EAGAIN))
				continue
			}
			wait = time.Millisecond
		} else {
			stuck = time.Time{}
		}
		if err := d.waitBell(wait); err != nil {
			d.stop(&stranded, fmt.Errorf("the reaper's bell: %w", err))
			return
		}
	}
}

// stop ends the reaper for err: what is queued is answered with it, and later requests go
// through the page cache. What is at the device may still reach it (and the chunks): the
// device is then never let go (ended stays open), so its access mode keeps counting and its
// descriptors stay open.
func (d *directIO) stop(stranded *bool, err error) {
	d.mu.Lock()
	*stranded = d.inflight > 0
	d.mu.Unlock()
	d.giveUp(err)
}

// giveUp answers what is queued with err; later requests go through the page cache.
func (d *directIO) giveUp(err error) {
	d.mu.Lock()
	q := d.queued
	d.queued, d.broken, d.err = nil, true, err
	d.mu.Unlock()
	d.fail(q, err)
}

// fail answers ops with err.
func (d *directIO) fail(ops []dioOp, err error) {
	for _, op := range ops {
		d.answer(op.r, err)
	}
}

// completion handles an operation's completion.
func (d *directIO) completion(ev aio.Event) {
	slot := uint16(ev.Data)
	d.mu.Lock()
	op := d.ops[slot]
	d.ops[slot] = dioOp{}
	d.free = append(d.free, slot)
	d.inflight--
	if op.r == nil {
		// The open's probe, come back late: nobody waits for it. (Its result is not acted
		// on: the device's errors reach the requests that meet them.)
		d.probeOut = false
		_ = unix.Munmap(d.probeBuf)
		d.probeBuf = nil
		d.mu.Unlock()
		return
	}
	var err error
	switch {
	case d.broken && (op.nowait && (ev.Res == -int64(unix.EAGAIN) || ev.Res == -int64(unix.EOPNOTSUPP)) ||
		ev.Res > 0 && ev.Res < int64(len(op.buf))):
		// It would go again, but nothing is submitted any more.
		err = d.err
	case op.nowait && (ev.Res == -int64(unix.EAGAIN) || ev.Res == -int64(unix.EOPNOTSUPP)):
		// It would have waited (no request free at the device), or the device does not
		// take RWF_NOWAIT at all: the reaper submits it again, blocking.
		d.blocking = d.blocking || ev.Res == -int64(unix.EOPNOTSUPP)
		d.queued = append(d.queued, op)
		d.mu.Unlock()
		return
	case ev.Res < 0:
		err = unix.Errno(-ev.Res)
	case ev.Res == 0:
		err = fmt.Errorf("%s at %d beyond the device's end: %w", opName(op.write), op.off, syscall.EIO)
	case ev.Res < int64(len(op.buf)):
		// A short transfer (the device shrank, or split the IO): the rest again.
		op.buf, op.off = op.buf[ev.Res:], op.off+ev.Res
		d.queued = append(d.queued, op)
		d.mu.Unlock()
		return
	}
	d.mu.Unlock()
	d.answer(op.r, err)
}

func opName(write bool) string {
	if write {
		return "write"
	}
	return "read"
}
