package ublk

import (
	"errors"
	"fmt"
	"os"
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

// ErrNoDriver says the kernel has no ublk (module not loaded, or not built: Debian's 6.1).
var ErrNoDriver = errors.New("no ublk driver: " + ControlPath + " is missing (modprobe ublk_drv; Linux 6.0 or later)")

// Ctrl is /dev/ublk-control with its ring: the device commands. Safe for concurrent use.
type Ctrl struct {
	mu       sync.Mutex
	f        *os.File
	ring     *uring.Ring
	features uint64
	buf      *ctrlBuf // the command's in/out buffer, in the heap: the kernel writes to it
	seq      uint64   // the last command's user data
	// abandoned are the rings (with their descriptors and buffers) of commands that did not
	// complete in time or whose submission failed: the kernel may still complete them, so
	// they stay open and reachable, never freed, and the Ctrl goes on with a new ring.
	abandoned []abandonedRing
	broken    error // too many of them: the Ctrl refuses every command
}

type abandonedRing struct {
	f    *os.File
	ring *uring.Ring
	buf  *ctrlBuf
}

// ctrlBuf holds whatever a control command reads or writes.
type ctrlBuf struct {
	info     DevInfo
	params   Params
	features uint64
}

// OpenCtrl opens the control device and reads the driver's features.
func OpenCtrl() (*Ctrl, error) {
	f, err := os.OpenFile(ControlPath, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, ErrNoDriver
	}
	if err != nil {
		return nil, err
	}
	r, err := uring.New(4, uring.SetupSQE128)
	if err != nil {
		f.Close()
		return nil, err
	}
	c := &Ctrl{f: f, ring: r, buf: new(ctrlBuf)}
	if err := c.do(cmdGetFeatures, CtrlCmd{DevID: ^uint32(0), QueueID: 0xffff, Len: 8, Addr: addr(&c.buf.features)}); err != nil {
		c.Close()
		return nil, fmt.Errorf("ublk GET_FEATURES (Linux 6.5 or later wanted): %w", err)
	}
	c.features = c.buf.features
	if c.features&featuresNeeded != featuresNeeded {
		c.Close()
		return nil, fmt.Errorf("ublk driver features %#x lack %#x (user recovery with reissue, ioctl-encoded commands): %w",
			c.features, featuresNeeded&^c.features, syscall.EOPNOTSUPP)
	}
	return c, nil
}

// Features is the driver's UBLK_F_* set.
func (c *Ctrl) Features() uint64 { return c.features }

// Close closes the control device (the abandoned rings stay: see Ctrl).
func (c *Ctrl) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return os.ErrClosed
	}
	_ = c.ring.Close()
	c.ring = nil
	return c.f.Close()
}

// abandon leaves the current ring to a command the kernel may still complete and goes on
// with a new one; err is what the command returns.
func (c *Ctrl) abandon(err error) error {
	c.abandoned = append(c.abandoned, abandonedRing{c.f, c.ring, c.buf})
	c.ring, c.f, c.buf = nil, nil, nil
	if len(c.abandoned) >= maxAbandoned {
		c.broken = fmt.Errorf("ublk control: %d commands never completed, the last: %w", len(c.abandoned), err)
		return err
	}
	c.renew(err)
	return err
}

// renew opens a new descriptor and ring after err, or marks the Ctrl broken.
func (c *Ctrl) renew(after error) {
	f, err := os.OpenFile(ControlPath, os.O_RDWR, 0)
	if err != nil {
		c.broken = fmt.Errorf("ublk control: reopening after %v: %w", after, err)
		return
	}
	r, err := uring.New(4, uring.SetupSQE128)
	if err != nil {
		f.Close()
		c.broken = fmt.Errorf("ublk control: a new ring after %v: %w", after, err)
		return
	}
	c.f, c.ring, c.buf = f, r, new(ctrlBuf)
}

// reap closes the abandoned rings whose command has completed since.
func (c *Ctrl) reap() {
	kept := c.abandoned[:0]
	for _, a := range c.abandoned {
		if a.ring.Completions(func(uring.CQE) {}) > 0 {
			_ = a.ring.Close()
			_ = a.f.Close()
			continue
		}
		kept = append(kept, a)
	}
	clear(c.abandoned[len(kept):])
	c.abandoned = kept
}

func addr[T any](p *T) uint64 { return uint64(uintptr(unsafe.Pointer(p))) }

// do runs one control command and waits for it, up to ctrlTimeout.
func (c *Ctrl) do(nr uint32, cmd CtrlCmd) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.doLocked(nr, cmd)
}

// unusable is why a Ctrl without a ring takes no command.
func (c *Ctrl) unusable() error {
	if c.broken != nil {
		return c.broken
	}
	return os.ErrClosed
}

func (c *Ctrl) doLocked(nr uint32, cmd CtrlCmd) error {
	if c.ring == nil {
		return c.unusable()
	}
	c.reap()
	s := c.ring.GetSQE()
	c.seq++
	seq := c.seq
	s.Opcode, s.Fd, s.Off, s.UserData = uring.OpURingCmd, int32(c.f.Fd()), uint64(ctrlOp(nr)), seq
	*(*CtrlCmd)(unsafe.Pointer(&c.ring.Cmd(s)[0])) = cmd
	deadline := time.Now().Add(ctrlTimeout)
	var res *int32
	submitted := false
	for res == nil {
		left := time.Until(deadline)
		if left <= 0 {
			// The command still holds c.buf and a ring entry: the ring is left to it.
			return c.abandon(fmt.Errorf("ublk control command %#x on device %d did not complete in %v: %w", nr, cmd.DevID, ctrlTimeout, syscall.ETIMEDOUT))
		}
		n, err := c.ring.Submit(1, left)
		if err != nil {
			err = fmt.Errorf("ublk control command %#x on device %d: %w", nr, cmd.DevID, err)
			if submitted {
				return c.abandon(err) // only the wait failed: the command is the kernel's
			}
			// The kernel took nothing, but the entry is still in the ring, to go with the
			// next submission: this ring (nothing of it in use) is closed for a new one.
			_ = c.ring.Close()
			_ = c.f.Close()
			c.ring, c.f = nil, nil
			c.renew(err)
			return err
		}
		submitted = submitted || n > 0
		c.ring.Completions(func(cq uring.CQE) {
			if cq.UserData == seq {
				r := cq.Res
				res = &r
			}
		})
	}
	if *res < 0 {
		return syscall.Errno(-*res)
	}
	return nil
}

// AddDev adds a device (ADD_DEV); info.DevID ^0 asks the driver for any free id. The
// driver fills in the rest of info, which is returned.
func (c *Ctrl) AddDev(info DevInfo) (DevInfo, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return DevInfo{}, c.unusable()
	}
	b := c.buf
	b.info = info
	err := c.doLocked(cmdAddDev, CtrlCmd{DevID: info.DevID, QueueID: 0xffff, Len: uint16(unsafe.Sizeof(info)), Addr: addr(&b.info)})
	return b.info, err
}

// DevInfo reads device id's info (GET_DEV_INFO); ENODEV when there is no such device.
func (c *Ctrl) DevInfo(id uint32) (DevInfo, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return DevInfo{}, c.unusable()
	}
	b := c.buf
	b.info = DevInfo{}
	err := c.doLocked(cmdGetDevInfo, CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(unsafe.Sizeof(DevInfo{})), Addr: addr(&b.info)})
	return b.info, err
}

// SetParams sets a device's parameters before START_DEV.
func (c *Ctrl) SetParams(id uint32, p Params) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return c.unusable()
	}
	p.Len = uint32(unsafe.Sizeof(p))
	c.buf.params = p
	return c.doLocked(cmdSetParams, CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(p.Len), Addr: addr(&c.buf.params)})
}

// Params reads a device's parameters (GET_PARAMS).
func (c *Ctrl) Params(id uint32) (Params, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return Params{}, c.unusable()
	}
	b := c.buf
	b.params = Params{Len: uint32(unsafe.Sizeof(Params{}))}
	err := c.doLocked(cmdGetParams, CtrlCmd{DevID: id, QueueID: 0xffff, Len: uint16(b.params.Len), Addr: addr(&b.params)})
	return b.params, err
}

// simple runs a command whose only argument is the device and, in data[0], our pid.
func (c *Ctrl) simple(nr, id uint32) error {
	return c.do(nr, CtrlCmd{DevID: id, QueueID: 0xffff, Data: uint64(os.Getpid())})
}

// StartDev starts a device whose queues have all fetched: /dev/ublkb<id> appears.
func (c *Ctrl) StartDev(id uint32) error { return c.simple(cmdStartDev, id) }

// StopDev stops a device: its disk goes, and every queue's fetches end with
// UBLK_IO_RES_ABORT (or, for a device with user recovery, IO waits for a new server).
func (c *Ctrl) StopDev(id uint32) error { return c.simple(cmdStopDev, id) }

// DelDev deletes a stopped device without waiting for its last opener (DEL_DEV_ASYNC):
// DEL_DEV would block until every process that has /dev/ublkb<id> open closes it, and a
// daemon stopping under a mounted file system must not. The number is free again once the
// last opener is gone. Kernels before 6.11 know only DEL_DEV, which is used there.
func (c *Ctrl) DelDev(id uint32) error {
	err := c.simple(cmdDelDevAsync, id)
	if errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.EOPNOTSUPP) {
		err = c.simple(cmdDelDev, id)
	}
	return err
}

// StartUserRecovery begins taking over a device whose server died (state quiesced).
func (c *Ctrl) StartUserRecovery(id uint32) error { return c.simple(cmdStartUserRecovery, id) }

// EndUserRecovery ends it once every queue has fetched: waiting IO resumes.
func (c *Ctrl) EndUserRecovery(id uint32) error { return c.simple(cmdEndUserRecovery, id) }
