package ublk

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/internal/lib/uring"
)

// ControlPath is the driver's control device.
const ControlPath = "/dev/ublk-control"

// ctrlTimeout bounds one control command. START_DEV and END_USER_RECOVERY wait for every
// queue to have fetched and then scan the new disk's partitions, which reads from it; a
// variable for the tests.
var ctrlTimeout = 30 * time.Second

// maxAbandoned is how many rings a Ctrl leaves behind, each with a command the kernel never
// completed, before it gives up.
const maxAbandoned = 4

// maxCtrlInFlight bounds the control commands a Ctrl has in flight at once: each holds a
// ring and its descriptor, and while it waits in the kernel (START_DEV behind a partition
// scan, STOP_DEV behind the requests a daemon holds) a worker thread of io_uring.
const maxCtrlInFlight = 8

// maxCtrlIdle is how many rings without a command a Ctrl keeps for the next ones.
const maxCtrlIdle = 2

// ErrNoDriver says the kernel has no ublk (module not loaded, or not built: Debian's 6.1).
var ErrNoDriver = errors.New("no ublk driver: " + ControlPath + " is missing (modprobe ublk_drv; Linux 6.5 or later)")

// Ctrl is /dev/ublk-control: the device commands. Safe for concurrent use, and concurrent
// commands run at once, each on a ring of its own, so that a device whose START_DEV waits
// (for its queues, or for its partition scan on kernels that scan within it) or whose
// STOP_DEV waits for its requests does not hold up what other devices ask. The driver still
// orders some of them: ADD_DEV and DEL_DEV take one lock for all devices, which a DEL_DEV
// holds while it waits to stop its device. Callers must not overlap commands for one device:
// the driver does not order all of those (START_USER_RECOVERY resets what START_DEV and
// END_USER_RECOVERY wait on).
type Ctrl struct {
	features uint64
	slots    chan struct{} // one per command in flight

	mu     sync.Mutex
	closed bool
	idle   []*ctrlRing
}

// abandoned holds, for every Ctrl of the process, the rings (with their descriptors and
// buffers) of commands that did not complete in time or whose wait failed: the kernel may
// still complete them and write their buffers, so they stay open and reachable, never freed,
// even once their Ctrl is closed and dropped. maxAbandoned of them at once make every Ctrl
// refuse commands until some complete.
var abandoned struct {
	mu    sync.Mutex
	rings []*ctrlRing
	last  error // why the last was left
}

// ctrlRing is a control descriptor and a ring, for one command at a time.
type ctrlRing struct {
	f    *os.File
	ring *uring.Ring
	buf  ctrlBuf // the command's in/out buffer, in the heap: the kernel writes to it
	seq  uint64  // the last command's user data
}

// ctrlBuf holds whatever a control command reads or writes.
type ctrlBuf struct {
	info     DevInfo
	params   Params
	features uint64
}

func newCtrlRing() (*ctrlRing, error) {
	f, err := os.OpenFile(ControlPath, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, ErrNoDriver
	}
	if err != nil {
		return nil, err
	}
	// io_uring runs each command that may sleep (all but the queries, on 7.2; all of them
	// before) in a worker of the submitting thread's, and caps a thread's workers by the
	// entries of its first ring: as many entries as commands in flight.
	r, err := uring.New(maxCtrlInFlight, uring.SetupSQE128)
	if err != nil {
		f.Close()
		return nil, err
	}
	return &ctrlRing{f: f, ring: r}, nil
}

func (r *ctrlRing) close() {
	_ = r.ring.Close()
	_ = r.f.Close()
}

// ioctlArch says whether this architecture encodes ioctl numbers as ioc does (the
// generic _IOC: 2 direction bits, 14 size bits) and is little-endian, as the command
// encoding here assumes: ppc64, mips and sparc lay _IOC out otherwise, and s390x would store
// the command's opcode in the wrong half of its field.
func ioctlArch(arch string) bool {
	switch arch {
	case "amd64", "386", "arm", "arm64", "riscv64", "loong64":
		return true
	}
	return false
}

// OpenCtrl opens the control device and reads the driver's features.
func OpenCtrl() (*Ctrl, error) {
	if !ioctlArch(runtime.GOARCH) {
		return nil, fmt.Errorf("ublk on %s: its ioctl encoding or byte order is not this package's: %w", runtime.GOARCH, syscall.EOPNOTSUPP)
	}
	r, err := newCtrlRing()
	if err != nil {
		return nil, err
	}
	c := &Ctrl{slots: make(chan struct{}, maxCtrlInFlight), idle: []*ctrlRing{r}}
	var features uint64
	err = c.do(cmdGetFeatures, ^uint32(0), func(b *ctrlBuf) CtrlCmd {
		return CtrlCmd{DevID: ^uint32(0), QueueID: 0xffff, Len: 8, Addr: addr(&b.features)}
	}, func(b *ctrlBuf) { features = b.features })
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("ublk GET_FEATURES (Linux 6.5 or later wanted): %w", err)
	}
	c.features = features
	if c.features&featuresNeeded != featuresNeeded {
		c.Close()
		return nil, fmt.Errorf("ublk driver features %#x lack %#x (user recovery with reissue, ioctl-encoded commands): %w",
			c.features, featuresNeeded&^c.features, syscall.EOPNOTSUPP)
	}
	return c, nil
}

// Features is the driver's UBLK_F_* set.
func (c *Ctrl) Features() uint64 { return c.features }

// Close closes the control device; a command still running closes its ring when it ends
// (the abandoned rings stay: see Ctrl).
func (c *Ctrl) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return os.ErrClosed
	}
	c.closed = true
	for _, r := range c.idle {
		r.close()
	}
	c.idle = nil
	return nil
}

// get takes an idle ring, or opens one.
func (c *Ctrl) get() (*ctrlRing, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, os.ErrClosed
	}
	if err := reapAbandoned(); err != nil {
		return nil, err
	}
	if n := len(c.idle); n > 0 {
		r := c.idle[n-1]
		c.idle[n-1] = nil
		c.idle = c.idle[:n-1]
		return r, nil
	}
	r, err := newCtrlRing()
	if err != nil {
		return nil, fmt.Errorf("ublk control: a ring for the command: %w", err)
	}
	return r, nil
}

// ringFate is what becomes of a ring after its command.
type ringFate int

const (
	ringReuse   ringFate = iota // the command completed: the ring is free
	ringDiscard                 // the kernel took nothing, but the entry is still queued: close it
	ringAbandon                 // the kernel may still complete the command: leave it the ring
)

// put gives a ring back after its command, as fate says.
func (c *Ctrl) put(r *ctrlRing, fate ringFate, err error) {
	if fate == ringAbandon {
		abandoned.mu.Lock()
		abandoned.rings = append(abandoned.rings, r)
		abandoned.last = err
		abandoned.mu.Unlock()
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if fate == ringReuse && !c.closed && len(c.idle) < maxCtrlIdle {
		c.idle = append(c.idle, r)
		return
	}
	r.close()
}

// reapAbandoned closes the abandoned rings whose command has completed since; an error if
// maxAbandoned are still waiting.
func reapAbandoned() error {
	abandoned.mu.Lock()
	defer abandoned.mu.Unlock()
	kept := abandoned.rings[:0]
	for _, a := range abandoned.rings {
		if a.ring.Completions(func(uring.CQE) {}) > 0 {
			a.close()
			continue
		}
		kept = append(kept, a)
	}
	clear(abandoned.rings[len(kept):])
	abandoned.rings = kept
	if len(kept) >= maxAbandoned {
		return fmt.Errorf("ublk control: %d commands have not completed, the last: %w", len(kept), abandoned.last)
	}
	return nil
}

func addr[T any](p *T) uint64 { return uint64(uintptr(unsafe.Pointer(p))) }

// do runs one control command on device id and waits for it, up to ctrlTimeout once it is
// sent: prep fills the ring's buffer and returns the command, out reads the buffer after a
// command that succeeded. When maxCtrlInFlight commands are running, it first waits up to
// ctrlTimeout for one of them to end, then fails with EAGAIN (never ETIMEDOUT: the
// command was not sent).
func (c *Ctrl) do(nr, id uint32, prep func(*ctrlBuf) CtrlCmd, out func(*ctrlBuf)) error {
	return c.command(nr, id, 0, prep, out)
}

// command is do, and if interruptAfter > 0, a command still running that long after it was
// sent is cancelled: io_uring signals the worker running it, which ends the driver's
// interruptible waits (EINTR), and the command's completion is still waited for.
func (c *Ctrl) command(nr, id uint32, interruptAfter time.Duration, prep func(*ctrlBuf) CtrlCmd, out func(*ctrlBuf)) error {
	t := time.NewTimer(ctrlTimeout)
	select {
	case c.slots <- struct{}{}:
		t.Stop()
	case <-t.C:
		return fmt.Errorf("ublk control command %#x on device %d: %d others still running after %v: %w", nr, id, maxCtrlInFlight, ctrlTimeout, syscall.EAGAIN)
	}
	defer func() { <-c.slots }()
	r, err := c.get()
	if err != nil {
		return err
	}
	res, fate, err := r.run(nr, id, prep(&r.buf), interruptAfter)
	if err == nil && res >= 0 && out != nil {
		out(&r.buf)
	}
	c.put(r, fate, err)
	if err != nil {
		return err
	}
	if res < 0 {
		return syscall.Errno(-res)
	}
	return nil
}

// cancelTag marks the user data of a cancel's own completion, which run passes over.
const cancelTag = 1 << 63

// run submits cmd on the ring and waits for its completion, up to ctrlTimeout; past
// interruptAfter (if > 0) it cancels the command once and goes on waiting.
func (r *ctrlRing) run(nr, id uint32, cmd CtrlCmd, interruptAfter time.Duration) (int32, ringFate, error) {
	s := r.ring.GetSQE()
	r.seq++
	seq := r.seq
	s.Opcode, s.Fd, s.Off, s.UserData = uring.OpURingCmd, int32(r.f.Fd()), uint64(ctrlOp(nr)), seq
	*(*CtrlCmd)(unsafe.Pointer(&r.ring.Cmd(s)[0])) = cmd
	start := time.Now()
	deadline := start.Add(ctrlTimeout)
	submitted, cancelled := false, false
	for {
		left := time.Until(deadline)
		if left <= 0 {
			// The command still holds the buffer and a ring entry: the ring is left to it.
			return 0, ringAbandon, fmt.Errorf("ublk control command %#x on device %d did not complete in %v: %w", nr, id, ctrlTimeout, syscall.ETIMEDOUT)
		}
		wait := left
		if interruptAfter > 0 && !cancelled {
			if submitted && time.Since(start) >= interruptAfter {
				c := r.ring.GetSQE()
				*c = uring.SQE{Opcode: uring.OpAsyncCancel, Fd: -1, Addr: seq, UserData: seq | cancelTag}
				cancelled = true
			} else {
				wait = min(left, max(interruptAfter-time.Since(start), time.Millisecond))
			}
		}
		n, err := r.ring.Submit(1, wait)
		if err != nil {
			err = fmt.Errorf("ublk control command %#x on device %d: %w", nr, id, err)
			if submitted {
				return 0, ringAbandon, err // only the wait failed: the command is the kernel's
			}
			return 0, ringDiscard, err
		}
		submitted = submitted || n > 0
		var res *int32
		r.ring.Completions(func(cq uring.CQE) {
			if cq.UserData == seq {
				v := cq.Res
				res = &v
			}
		})
		if res != nil {
			return *res, ringReuse, nil
		}
	}
}

// AddDev adds a device (ADD_DEV); info.DevID ^0 asks the driver for any free id. The
// driver fills in the rest of info, which is returned.
func (c *Ctrl) AddDev(info DevInfo) (DevInfo, error) {
	var got DevInfo
	err := c.do(cmdAddDev, info.DevID, func(b *ctrlBuf) CtrlCmd {
		b.info = info
		return CtrlCmd{DevID: info.DevID, QueueID: 0xffff, Len: uint16(unsafe.Sizeof(info)), Addr: addr(&b.info)}
	}, func(b *ctrlBuf) { got = b.info })
	return got, err
}

// DevInfo reads device id's info (GET_DEV_INFO); ENODEV when there is no such device.
func (c *Ctrl) DevInfo(id uint32) (DevInfo, error) {
	var got DevInfo
	err := c.do(cmdGetDevInfo, id, func(b *ctrlBuf) CtrlCmd {
		b.info = DevInfo{}
		return CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(unsafe.Sizeof(DevInfo{})), Addr: addr(&b.info)}
	}, func(b *ctrlBuf) { got = b.info })
	return got, err
}

// SetParams sets a device's parameters before START_DEV.
func (c *Ctrl) SetParams(id uint32, p Params) error {
	p.Len = uint32(unsafe.Sizeof(p))
	return c.do(cmdSetParams, id, func(b *ctrlBuf) CtrlCmd {
		b.params = p
		return CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(p.Len), Addr: addr(&b.params)}
	}, nil)
}

// Params reads a device's parameters (GET_PARAMS).
func (c *Ctrl) Params(id uint32) (Params, error) {
	var got Params
	err := c.do(cmdGetParams, id, func(b *ctrlBuf) CtrlCmd {
		b.params = Params{Len: uint32(unsafe.Sizeof(Params{}))}
		return CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(b.params.Len), Addr: addr(&b.params)}
	}, func(b *ctrlBuf) { got = b.params })
	return got, err
}

// simple runs a command whose only argument is the device and, in data[0], our pid.
func (c *Ctrl) simple(nr, id uint32) error { return c.do(nr, id, simpleCmd(id), nil) }

// simpleCmd prepares a command with no buffer for device id.
func simpleCmd(id uint32) func(*ctrlBuf) CtrlCmd {
	return func(*ctrlBuf) CtrlCmd { return CtrlCmd{DevID: id, QueueID: 0xffff, Data: uint64(os.Getpid())} }
}

// StartDev starts a device whose queues have all fetched: /dev/ublkb<id> appears.
func (c *Ctrl) StartDev(id uint32) error { return c.simple(cmdStartDev, id) }

// StopDev stops a device: its disk goes, and every queue's fetches end with
// UBLK_IO_RES_ABORT (or, for a device with user recovery, IO waits for a new server).
func (c *Ctrl) StopDev(id uint32) error { return c.simple(cmdStopDev, id) }

// TryStopDev stops a device nothing has open, in one step with the check (TRY_STOP_DEV,
// where the driver has FlagSafeStopDev: 7.x): EBUSY while the disk has an opener, and once
// it goes ahead no new open is let in. EOPNOTSUPP on drivers without it.
func (c *Ctrl) TryStopDev(id uint32) error {
	if c.features&FlagSafeStopDev == 0 {
		return syscall.EOPNOTSUPP
	}
	return c.simple(cmdTryStopDev, id)
}

// DelDev deletes a stopped device without waiting for its last opener (DEL_DEV_ASYNC):
// DEL_DEV would block until every process that has /dev/ublkb<id> open closes it, and a
// daemon stopping under a mounted file system must not. The number is free again once the
// last opener is gone. Kernels before 6.11 know only DEL_DEV: there it is cancelled if it
// still runs after delDevGrace, which ends only its wait for the openers (the driver has
// removed the device by then and frees the number with the last of them): the same result,
// a second later. A cancel that finds the command still queued, not yet run (ECANCELED),
// sends it once more.
func (c *Ctrl) DelDev(id uint32) error {
	var err error = syscall.EOPNOTSUPP
	if !noDelDevAsync {
		err = c.simple(cmdDelDevAsync, id)
	}
	if !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.EOPNOTSUPP) {
		return err
	}
	for try := 0; try < 2; try++ {
		err = c.command(cmdDelDev, id, delDevGrace, simpleCmd(id), nil)
		if errors.Is(err, syscall.EINTR) {
			return nil // removed; the number waits for the last opener
		}
		if !errors.Is(err, syscall.ECANCELED) {
			return err
		}
	}
	return fmt.Errorf("ublk DEL_DEV of device %d cancelled twice before the driver ran it: %w", id, syscall.EAGAIN)
}

// delDevGrace is how long a DEL_DEV (kernels before 6.11) may wait for the device's openers
// before it is cancelled; without openers it completes in far less.
const delDevGrace = time.Second

// noDelDevAsync makes DelDev use DEL_DEV alone, as on kernels before 6.11 (a test switch).
var noDelDevAsync = false

// UpdateSize gives a started device sectors sectors (UPDATE_SIZE): the disk's capacity
// changes at once and the block layer tells its users. EOPNOTSUPP on drivers without
// FlagUpdateSize (6.12 among them).
func (c *Ctrl) UpdateSize(id uint32, sectors uint64) error {
	if c.features&FlagUpdateSize == 0 {
		return syscall.EOPNOTSUPP
	}
	return c.do(cmdUpdateSize, id, func(*ctrlBuf) CtrlCmd { return CtrlCmd{DevID: id, QueueID: 0xffff, Data: sectors} }, nil)
}

// StartUserRecovery begins taking over a device whose server died (state quiesced).
func (c *Ctrl) StartUserRecovery(id uint32) error { return c.simple(cmdStartUserRecovery, id) }

// EndUserRecovery ends it once every queue has fetched: waiting IO resumes.
func (c *Ctrl) EndUserRecovery(id uint32) error { return c.simple(cmdEndUserRecovery, id) }
