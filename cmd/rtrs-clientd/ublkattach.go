package main

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/ublk"
)

// ublkMark is what rtrs-clientd leaves in its ublk devices' ublksrv_flags ("rtrs"): a
// restarted daemon recovers only devices that carry it.
const ublkMark = 0x72747273

// ublkRecoverWait bounds how long an attach waits for the driver to quiesce a device whose
// server died (it notices at once when the process exits; this covers a slow exit).
const ublkRecoverWait = 30 * time.Second

// ublkAttacher attaches mapped devices to /dev/ublkbN (map_device's ublk= token,
// -ublk-attach its default): the second control.Attacher of the daemon. Its devices have
// user recovery: a daemon that dies leaves them waiting, and one started again with the
// same declarations (the write-back records ublk=<N>) takes them back.
type ublkAttacher struct {
	def    control.Attach // AttachNone or AttachAuto
	queues string         // "cpus", "paths" or a number
	depth  int
	paths  func(*rnbd.Device) int // the device's session's paths, for queues "paths"
	ctx    context.Context        // the daemon's: IO of the devices ends with it
	lg     *log.Entry

	mu     sync.Mutex
	ctrl   *ublk.Ctrl // opened at the first attach
	closed bool
	devs   map[*rnbd.Device]*ublk.Device
	tokens map[*rnbd.Device]control.Attach
}

// newUblkAttacher is the daemon's ublk front end as its settings say; IO of its devices ends
// with ctx.
func newUblkAttacher(ctx context.Context, c *config, r *resolved, rc *rnbd.Client, lg *log.Entry) *ublkAttacher {
	return &ublkAttacher{def: r.ublkDefault, queues: c.UblkQueues, depth: c.UblkDepth, ctx: ctx, lg: lg,
		paths: func(dev *rnbd.Device) int {
			if s := rc.Session(dev.Session()); s != nil {
				return len(s.Paths())
			}
			return 1
		},
		devs: map[*rnbd.Device]*ublk.Device{}, tokens: map[*rnbd.Device]control.Attach{}}
}

func parseUblkQueues(v string) error {
	if v == "cpus" || v == "paths" {
		return nil
	}
	if n, err := strconv.Atoi(v); err != nil || n < 1 || n > 64 {
		return fmt.Errorf("-ublk-queues %q: cpus, paths or 1 to 64", v)
	}
	return nil
}

// nqueues is how many queues a device of d gets.
func (u *ublkAttacher) nqueues(d *rnbd.Device) int {
	switch u.queues {
	case "cpus":
		return min(runtime.NumCPU(), 64)
	case "paths":
		return min(max(u.paths(d), 1), 64)
	}
	n, _ := strconv.Atoi(u.queues)
	return n
}

func (u *ublkAttacher) control() (*ublk.Ctrl, error) {
	if u.ctrl != nil {
		return u.ctrl, nil
	}
	c, err := ublk.OpenCtrl()
	if errors.Is(err, ublk.ErrNoDriver) {
		return nil, fmt.Errorf("%w: %w", err, syscall.ENODEV)
	}
	if err != nil {
		return nil, err
	}
	u.ctrl = c
	return c, nil
}

// ublkParams are d's limits as the server gave them in OPEN_RSP, for the ublk device.
func ublkParams(d *rnbd.Device, maxIO int) ublk.Params {
	g := d.Geometry()
	shift := func(n uint16) uint8 {
		if n < 512 {
			n = 512
		}
		return uint8(bits.TrailingZeros16(n))
	}
	lbs := shift(g.LogicalBlockSize)
	pbs := max(shift(g.PhysicalBlockSize), lbs)
	p := ublk.Params{Types: ublk.ParamTypeBasic, Basic: ublk.ParamBasic{LogicalBSShift: lbs, PhysicalBSShift: pbs,
		IOMinShift: pbs, IOOptShift: pbs, MaxSectors: uint32(maxIO >> 9), DevSectors: g.NSectors}}
	if g.CachePolicy&rnbd.CacheWriteback != 0 {
		p.Basic.Attrs |= ublk.AttrVolatileCache
		if g.CachePolicy&rnbd.CacheFUA != 0 {
			p.Basic.Attrs |= ublk.AttrFUA
		}
	}
	if d.AccessMode() == rnbd.AccessRO {
		p.Basic.Attrs |= ublk.AttrReadOnly
	}
	if g.MaxDiscardSectors != 0 || g.MaxWriteZeroesSectors != 0 {
		p.Types |= ublk.ParamTypeDiscard
		p.Discard = ublk.ParamDiscard{DiscardGranularity: max(g.DiscardGranularity, uint32(1)<<lbs),
			MaxDiscardSectors: g.MaxDiscardSectors, MaxWriteZeroesSectors: g.MaxWriteZeroesSectors}
		if g.DiscardAlignment < p.Discard.DiscardGranularity {
			p.Discard.DiscardAlignment = g.DiscardAlignment
		}
		if g.MaxDiscardSectors != 0 {
			p.Discard.MaxDiscardSegments = 1
		}
	}
	return p
}

func (u *ublkAttacher) Attach(ctx context.Context, d *rnbd.Device, at control.Attach) error {
	tok := at
	if at == control.AttachDefault {
		at = u.def
	}
	// The lock is not held while the device starts (up to half a minute): reading
	// ctl/ublk_devices must not wait for it.
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		return fmt.Errorf("rtrs-clientd is stopping: %w", syscall.ESHUTDOWN)
	}
	if at == control.AttachNone {
		if tok != control.AttachDefault {
			u.tokens[d] = tok
		}
		u.mu.Unlock()
		return nil
	}
	c, err := u.control()
	u.mu.Unlock()
	if err != nil {
		return fmt.Errorf("ublk=%v: %w", at, err)
	}
	name := d.Session() + "/" + control.DeviceFileName(d.Path())
	h := &ublkHandler{d: d, ctx: u.ctx}
	var dev *ublk.Device
	recovered := false
	if at >= 0 {
		dev, recovered, err = u.recoverOwn(c, d, int(at), h)
	}
	if err == nil && dev == nil {
		maxIO := d.MaxIO() &^ 4095
		maxIO = min(maxIO, 1<<20)
		id := -1
		if at >= 0 {
			id = int(at)
		}
		dev, err = ublk.Create(c, ublk.Options{ID: id, Queues: u.nqueues(d), Depth: u.depth, MaxIO: maxIO,
			Params: ublkParams(d, maxIO), SrvFlags: ublkMark}, h)
	}
	if err != nil {
		return fmt.Errorf("%s: ublk=%v: %w", name, at, err)
	}
	u.mu.Lock()
	if u.closed || d.State() == rnbd.StateUnmapped {
		u.mu.Unlock()
		_ = dev.Stop()
		return fmt.Errorf("%s went away while it was attached: %w", name, syscall.ENODEV)
	}
	u.devs[d] = dev
	u.tokens[d] = tok
	u.mu.Unlock()
	how := "attached to"
	if recovered {
		how = "recovered"
	}
	u.lg.Infof("%s %s %s (%d queues × %d, max IO %d KiB)", name, how, dev.BlockPath(), dev.Info().NrHWQueues, dev.Info().QueueDepth, dev.Info().MaxIOBufBytes>>10)
	return nil
}

// recoverOwn takes device id back if it is one of ours whose server died, of d's size;
// (nil, false, nil) if there is no device id.
func (u *ublkAttacher) recoverOwn(c *ublk.Ctrl, d *rnbd.Device, id int, h ublk.Handler) (*ublk.Device, bool, error) {
	info, err := c.DevInfo(uint32(id))
	if errors.Is(err, syscall.ENODEV) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	if info.SrvFlags != ublkMark {
		return nil, false, fmt.Errorf("/dev/ublkb%d exists and is not rtrs-clientd's: %w", id, syscall.EEXIST)
	}
	p, err := c.Params(uint32(id))
	if err != nil {
		return nil, false, err
	}
	if want := uint64(d.Size() >> 9); p.Basic.DevSectors != want {
		return nil, false, fmt.Errorf("/dev/ublkb%d has %d sectors, the device %d: not its device: %w", id, p.Basic.DevSectors, want, syscall.EEXIST)
	}
	dev, err := ublk.Recover(c, id, h, ublkRecoverWait)
	return dev, err == nil, err
}

func (u *ublkAttacher) Busy(d *rnbd.Device) error {
	u.mu.Lock()
	dev := u.devs[d]
	u.mu.Unlock()
	if dev == nil || !dev.Busy() {
		return nil
	}
	if pids := ublk.Openers(dev.BlockPath()); len(pids) > 0 {
		return fmt.Errorf("%s is open (pid %v): %w", dev.BlockPath(), pids, syscall.EBUSY)
	}
	return fmt.Errorf("%s is in use (mounted?): %w", dev.BlockPath(), syscall.EBUSY)
}

func (u *ublkAttacher) Detach(_ context.Context, d *rnbd.Device) error {
	if err := u.Busy(d); err != nil {
		return err
	}
	u.mu.Lock()
	dev := u.devs[d]
	delete(u.devs, d)
	delete(u.tokens, d)
	u.mu.Unlock()
	if dev == nil {
		return nil
	}
	if err := dev.Stop(); err != nil {
		u.lg.WithError(err).Warnf("detaching %s", dev.BlockPath())
		return err
	}
	u.lg.Infof("%s detached", dev.BlockPath())
	return nil
}

func (u *ublkAttacher) Attached(d *rnbd.Device) string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if dev := u.devs[d]; dev != nil {
		return dev.BlockPath()
	}
	return ""
}

// Token is the device's number once attached, whatever ublk= said: a restart must find
// that device to recover it.
func (u *ublkAttacher) Token(d *rnbd.Device) control.Attach {
	u.mu.Lock()
	defer u.mu.Unlock()
	if dev := u.devs[d]; dev != nil {
		return control.Attach(dev.ID())
	}
	if t, ok := u.tokens[d]; ok {
		return t
	}
	return control.AttachDefault
}

func (u *ublkAttacher) count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.devs)
}

// detachAll stops every device, in use or not (the daemon stops), and refuses further
// attaches.
func (u *ublkAttacher) detachAll() {
	u.mu.Lock()
	u.closed = true
	all := u.devs
	u.devs = map[*rnbd.Device]*ublk.Device{}
	c := u.ctrl
	u.mu.Unlock()
	var wg sync.WaitGroup
	for _, dev := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := dev.Stop(); err != nil {
				u.lg.WithError(err).Warnf("detaching %s", dev.BlockPath())
			} else {
				u.lg.Infof("%s detached", dev.BlockPath())
			}
		}()
	}
	wg.Wait()
	if c != nil {
		c.Close()
	}
}

// ublkHandler serves a ublk device's requests from its RNBD device.
type ublkHandler struct {
	d   *rnbd.Device
	ctx context.Context
}

// Serve starts the request: reads and writes asynchronously, the rest in a goroutine.
func (h *ublkHandler) Serve(r *ublk.Request) {
	if (r.Op == ublk.OpRead || r.Op == ublk.OpWrite) && len(r.Buf) != r.Len {
		r.Done(fmt.Errorf("ublk request of %d bytes beyond the buffers: %w", r.Len, syscall.EIO))
		return
	}
	switch r.Op {
	case ublk.OpRead:
		h.d.ReadAsync(h.ctx, r.Buf, r.Off, r.Done)
	case ublk.OpWrite:
		h.d.WriteAsync(h.ctx, r.Buf, r.Off, r.Flags&ublk.IOFlagFUA != 0, r.Done)
	case ublk.OpFlush:
		go func() { r.Done(h.d.Flush(h.ctx)) }()
	case ublk.OpDiscard:
		go func() { r.Done(h.d.Discard(h.ctx, r.Off, int64(r.Len))) }()
	case ublk.OpWriteZeroes:
		go func() { r.Done(h.d.WriteZeroes(h.ctx, r.Off, int64(r.Len), r.Flags&ublk.IOFlagNoUnmap != 0)) }()
	default:
		r.Done(fmt.Errorf("ublk op %d: %w", r.Op, syscall.EOPNOTSUPP))
	}
}
