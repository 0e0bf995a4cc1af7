package main

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/bits"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/membudget"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/ublk"
)

// ublkMark is what rtrs-clientd leaves in the low half of its ublk devices' ublksrv_flags
// ("rtrs"); the high half names the mapping (ublkOwner). A restarted daemon recovers only a
// device that carries both for the mapping that asks: waiting IO and open file systems must
// not resume against another volume.
const ublkMark = 0x72747273

// ublkOwner is the mark of a mapping's device: ublkMark, and a hash of the mapping's session
// and device path. (Daemons before 2026-11-26 left ublkMark alone; their devices are
// recovered on the size alone.)
func ublkOwner(sess, path string) uint64 {
	h := fnv.New32a()
	h.Write([]byte(sess))
	h.Write([]byte{0})
	h.Write([]byte(path))
	return uint64(max(h.Sum32(), 1))<<32 | ublkMark
}

// ublkRecoverWait bounds how long an attach waits for the driver to quiesce a device whose
// server died: at once when the process exits, but on 6.12 a queue whose every tag the dead
// server held waits for the block layer's request timeout (30 s), which this outlasts.
const ublkRecoverWait = time.Minute

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
	// regMem bounds the queues' registered buffers over all devices (-ublk-registered-memory).
	regMem    *membudget.Budget
	regRefuse log.Limiter

	mu      sync.Mutex
	ctrl    *ublk.Ctrl // opened at the first attach
	closed  bool
	busy    sync.WaitGroup // attaches and detaches under way, which detachAll waits for
	devs    map[*rnbd.Device]*ublk.Device
	failIO  map[*rnbd.Device]context.CancelFunc // ends the context of a device's IO (force)
	tokens  map[*rnbd.Device]control.Attach
	pending map[int]bool // device numbers an attach is taking
	// stopping are the devices a detach is stopping: their numbers are not to be used.
	stopping map[*ublk.Device]bool

	// started, set by a test, is called with each device an attach has started, before the
	// attach looks for an unmap begun meanwhile: the window that check closes.
	started func(*ublk.Device)
}

// newUblkAttacher is the daemon's ublk front end as its settings say; IO of its devices ends
// with ctx.
func newUblkAttacher(ctx context.Context, c *config, r *resolved, rc *rnbd.Client, lg *log.Entry) *ublkAttacher {
	return &ublkAttacher{def: r.ublkDefault, queues: c.UblkQueues, depth: c.UblkDepth, ctx: ctx, lg: lg, regMem: membudget.New(r.ublkRegMemory),
		paths: func(dev *rnbd.Device) int {
			if s := rc.Session(dev.Session()); s != nil {
				return len(s.Paths())
			}
			return 1
		},
		devs: map[*rnbd.Device]*ublk.Device{}, failIO: map[*rnbd.Device]context.CancelFunc{},
		tokens: map[*rnbd.Device]control.Attach{}, pending: map[int]bool{}, stopping: map[*ublk.Device]bool{}}
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
	return ublkParamsOf(d.Geometry(), d.AccessMode() == rnbd.AccessRO, maxIO)
}

// ublkParamsOf is ublkParams of an OPEN_RSP g, a read-only mapping or not.
func ublkParamsOf(g rnbd.MsgOpenRsp, ro bool, maxIO int) ublk.Params {
	shift := func(n uint16) uint8 {
		if n < 512 {
			n = 512
		}
		return uint8(bits.TrailingZeros16(n))
	}
	lbs := shift(g.LogicalBlockSize)
	pbs := max(shift(g.PhysicalBlockSize), lbs)
	// io_opt is the largest IO a request carries, as the kernel's client sets it (ublk takes
	// a power of two: the largest not above it).
	opt := max(uint8(bits.Len(uint(maxIO))-1), pbs)
	p := ublk.Params{Types: ublk.ParamTypeBasic, Basic: ublk.ParamBasic{LogicalBSShift: lbs, PhysicalBSShift: pbs,
		IOMinShift: pbs, IOOptShift: opt, MaxSectors: uint32(maxIO >> 9), DevSectors: g.NSectors}}
	if g.CachePolicy&rnbd.CacheWriteback != 0 {
		p.Basic.Attrs |= ublk.AttrVolatileCache
		if g.CachePolicy&rnbd.CacheFUA != 0 {
			p.Basic.Attrs |= ublk.AttrFUA
		}
	}
	if ro {
		p.Basic.Attrs |= ublk.AttrReadOnly
	}
	// Limits in whole blocks: one of less than a block is none (no request could keep to it).
	per := uint32(1) << lbs >> 9
	disc, wz := g.MaxDiscardSectors-g.MaxDiscardSectors%per, g.MaxWriteZeroesSectors-g.MaxWriteZeroesSectors%per
	if disc != 0 || wz != 0 {
		p.Types |= ublk.ParamTypeDiscard
		p.Discard = ublk.ParamDiscard{DiscardGranularity: max(g.DiscardGranularity, uint32(1)<<lbs),
			MaxDiscardSectors: disc, MaxWriteZeroesSectors: wz}
		if g.DiscardAlignment < p.Discard.DiscardGranularity {
			p.Discard.DiscardAlignment = g.DiscardAlignment
		}
		if disc != 0 {
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
	if at >= 0 {
		if u.pending[int(at)] {
			u.mu.Unlock()
			return fmt.Errorf("ublk=%v: another mapping is being attached to /dev/ublkb%d: %w", at, at, syscall.EBUSY)
		}
		u.pending[int(at)] = true
		defer func() {
			u.mu.Lock()
			delete(u.pending, int(at))
			u.mu.Unlock()
		}()
	}
	c, err := u.control()
	if err != nil {
		u.mu.Unlock()
		return fmt.Errorf("ublk=%v: %w", at, err)
	}
	u.busy.Add(1)
	defer u.busy.Done()
	u.mu.Unlock()
	name := d.Session() + "/" + control.DeviceFileName(d.Path())
	// The device's IO has a context of its own, which a force unmap ends (failIO).
	ioCtx, failIO := context.WithCancel(u.ctx)
	h := &ublkHandler{u: u, d: d, ctx: ioCtx, name: name, lg: u.lg}
	var dev *ublk.Device
	recovered := false
	if at >= 0 {
		dev, recovered, err = u.recoverOwn(c, d, int(at), h)
	}
	if err == nil && dev == nil {
		maxIO := ublkMaxIO(d)
		id := -1
		if at >= 0 {
			id = int(at)
		}
		dev, err = ublk.Create(c, ublk.Options{ID: id, Queues: u.nqueues(d), Depth: u.depth, MaxIO: maxIO,
			Params: ublkParams(d, maxIO), SrvFlags: ublkOwner(d.Session(), d.Path())}, h)
	}
	if err != nil {
		failIO()
		return fmt.Errorf("%s: ublk=%v: %w", name, at, err)
	}
	if u.started != nil {
		u.started(dev)
	}
	// An unmap that began meanwhile found no ublk device to detach: it is this one's to stop.
	// Looked at under u.mu, which the unmap's Detach takes after BeginUnmap: either that
	// Detach finds the device stored here, or this finds the unmap begun.
	u.mu.Lock()
	if u.closed || d.Unmapping() {
		u.mu.Unlock()
		failIO()
		_ = dev.Stop()
		return fmt.Errorf("%s was unmapped while it was attached: %w", name, syscall.ENODEV)
	}
	u.devs[d] = dev
	u.failIO[d] = failIO
	u.tokens[d] = tok
	u.mu.Unlock()
	how := "attached to"
	if recovered {
		how = "recovered"
	}
	u.lg.Infof("%s %s %s (%d queues × %d, max IO %d KiB)", name, how, dev.BlockPath(), dev.Info().NrHWQueues, dev.Info().QueueDepth, dev.Info().MaxIOBufBytes>>10)
	return nil
}

// recoverOwn takes device id back if it is d's (its mark, and its size) and its server
// died; (nil, false, nil) if there is no device id, or there was one of d's that never
// started (dead: no IO waits on it), which is deleted for d's to be created.
func (u *ublkAttacher) recoverOwn(c *ublk.Ctrl, d *rnbd.Device, id int, h ublk.Handler) (*ublk.Device, bool, error) {
	info, err := c.DevInfo(uint32(id))
	if errors.Is(err, syscall.ENODEV) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	p, err := c.Params(uint32(id))
	if err != nil {
		return nil, false, err
	}
	switch act, err := ublkClaim(info, p, d.Session(), d.Path(), ublkParams(d, ublkMaxIO(d))); act {
	case claimRefuse:
		return nil, false, fmt.Errorf("/dev/ublkb%d: %w", id, err)
	case claimLegacy:
		u.lg.Warnf("/dev/ublkb%d carries the mark of an older rtrs-clientd, which does not name its mapping: recovered for %s %s on its size alone", id, d.Session(), d.Path())
	case claimDelete:
		if err := c.DelDev(uint32(id)); err != nil && !errors.Is(err, syscall.ENODEV) {
			return nil, false, fmt.Errorf("/dev/ublkb%d, left added but not started: deleting it: %w", id, err)
		}
		u.lg.Infof("/dev/ublkb%d was left added but not started: deleted, to be created again", id)
		return nil, false, nil
	}
	dev, err := ublk.Recover(c, id, h, ublkRecoverWait)
	if err != nil {
		return nil, false, err
	}
	if have, want := p.Basic.DevSectors, uint64(d.Size()/rnbd.SectorSize); have != want {
		// Resized on the server meanwhile. A driver that cannot follow (6.12) keeps the
		// old size: IO past a smaller end fails, a larger end is not seen.
		if err := dev.Resize(want); err != nil {
			u.lg.WithError(err).Warnf("/dev/ublkb%d keeps %d sectors; %s %s now has %d", id, have, d.Session(), d.Path(), want)
		} else {
			u.lg.Infof("/dev/ublkb%d resized from %d to %d sectors, as %s %s now is", id, have, want, d.Session(), d.Path())
		}
	}
	return dev, true, nil
}

// claim is what an attach does with an existing ublk device it was told to take.
type claim int

const (
	claimRecover claim = iota // d's: take it over
	claimLegacy               // marked by an older daemon, of d's size: take it over
	claimDelete               // d's, never started: delete it and create d's
	claimRefuse               // not d's
)

// ublkMaxIO is the largest request of d's ublk device, in whole pages: the driver rounds its
// buffers down to its page size.
func ublkMaxIO(d *rnbd.Device) int {
	m := min(d.MaxIO(), 1<<20)
	return m - m%os.Getpagesize()
}

// ublkClaim decides what an attach of the mapping of sess and path, whose device would have
// the parameters want, does with an existing device of that info and those parameters p:
// only a device that carries the mapping's mark (or an older daemon's) and has its size,
// logical block and read-only mode is its own to take over (its file systems and waiting IO
// were made for those); one with the mark that never started is its own to delete.
func ublkClaim(info ublk.DevInfo, p ublk.Params, sess, path string, want ublk.Params) (claim, error) {
	act := claimRecover
	switch {
	case info.SrvFlags == ublkOwner(sess, path):
	case info.SrvFlags == ublkMark:
		act = claimLegacy
	case uint32(info.SrvFlags) == ublkMark:
		return claimRefuse, fmt.Errorf("rtrs-clientd's device for another mapping: %w", syscall.EEXIST)
	default:
		return claimRefuse, fmt.Errorf("exists and is not rtrs-clientd's: %w", syscall.EEXIST)
	}
	if info.State == ublk.StateDead {
		// No disk and no IO waiting: whatever size it was given (none, when its daemon died
		// before SET_PARAMS), nothing can resume against it.
		return claimDelete, nil
	}
	// The mark names the mapping; an older daemon's names none, and the size is all that
	// says the device is this volume's. A marked device may have another size: the export
	// was resized on the server while no daemon served it (recoverOwn resizes it after).
	if act == claimLegacy && p.Basic.DevSectors != want.Basic.DevSectors {
		return claimRefuse, fmt.Errorf("%d sectors, the device %d: not its device: %w", p.Basic.DevSectors, want.Basic.DevSectors, syscall.EEXIST)
	}
	if p.Basic.LogicalBSShift != want.Basic.LogicalBSShift {
		return claimRefuse, fmt.Errorf("logical blocks of %d bytes, the device's now %d: %w", 1<<p.Basic.LogicalBSShift, 1<<want.Basic.LogicalBSShift, syscall.EEXIST)
	}
	if ro := p.Basic.Attrs&ublk.AttrReadOnly != 0; ro != (want.Basic.Attrs&ublk.AttrReadOnly != 0) {
		return claimRefuse, fmt.Errorf("read-only %v, the mapping's %v: %w", ro, !ro, syscall.EEXIST)
	}
	return act, nil
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

func (u *ublkAttacher) Detach(_ context.Context, d *rnbd.Device, force bool) error {
	if err := u.Busy(d); err != nil && !force {
		return err
	}
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		return fmt.Errorf("rtrs-clientd is stopping: %w", syscall.ESHUTDOWN)
	}
	dev := u.devs[d]
	if dev == nil {
		delete(u.tokens, d)
		u.mu.Unlock()
		return nil
	}
	failIO := u.failIO[d]
	u.busy.Add(1)
	defer u.busy.Done()
	u.stopping[dev] = true
	defer func() {
		u.mu.Lock()
		delete(u.stopping, dev)
		u.mu.Unlock()
	}()
	u.mu.Unlock()
	if force && failIO != nil {
		// STOP_DEV waits for the requests this daemon holds, and one waiting for a session
		// that lost its paths would hold it up to the IO timeout, as long as a control
		// command may take: forced, they fail now.
		failIO()
	}
	// Forgotten only once stopped: a device a failed Stop leaves behind stays listed, in
	// the write-back too, and the unmap that failed may be tried again.
	// Not forced: the driver's own check where it has one (7.x), against an open that
	// lands after Busy's.
	stop := dev.StopIfUnused
	if force {
		stop = dev.Stop
	}
	if err := stop(); err != nil {
		u.lg.WithError(err).Warnf("detaching %s", dev.BlockPath())
		return err
	}
	u.mu.Lock()
	if u.devs[d] == dev {
		delete(u.devs, d)
		if failIO != nil {
			failIO()
		}
		delete(u.failIO, d)
	}
	delete(u.tokens, d)
	u.mu.Unlock()
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

// Resize tells d's /dev/ublkbN, if it has one, its new size: EOPNOTSUPP on a driver
// without UPDATE_SIZE (6.12).
func (u *ublkAttacher) Resize(_ context.Context, d *rnbd.Device, size int64) error {
	// Not a device being stopped: the command goes by number, which its delete hands on.
	u.mu.Lock()
	defer u.mu.Unlock()
	dev := u.devs[d]
	if dev == nil {
		return nil
	}
	if u.stopping[dev] {
		return fmt.Errorf("%s is being detached: %w", dev.BlockPath(), syscall.EBUSY)
	}
	if err := dev.Resize(uint64(size / rnbd.SectorSize)); err != nil {
		return err
	}
	u.lg.Infof("%s resized to %d bytes", dev.BlockPath(), size)
	return nil
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

// inUse lists the attached devices something holds (a mounted file system, an opener).
func (u *ublkAttacher) inUse() []string {
	u.mu.Lock()
	var all []*ublk.Device
	for _, dev := range u.devs {
		all = append(all, dev)
	}
	u.mu.Unlock()
	var out []string
	for _, dev := range all {
		if dev.Busy() {
			out = append(out, dev.BlockPath())
		}
	}
	return out
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
	u.mu.Unlock()
	// An attach under way stops its own device when it sees closed; the control device
	// must stay open until it has.
	u.busy.Wait()
	u.mu.Lock()
	all := u.devs
	u.devs = map[*rnbd.Device]*ublk.Device{}
	// The daemon's context has ended, and with it the devices' IO: what waits fails.
	for _, f := range u.failIO {
		f()
	}
	u.failIO = map[*rnbd.Device]context.CancelFunc{}
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
	u    *ublkAttacher
	d    *rnbd.Device
	ctx  context.Context
	name string
	lg   *log.Entry
}

// QueueFailed logs a queue loop that ended on an error (ublk.FailureReporter).
func (h *ublkHandler) QueueFailed(q int, err error) {
	h.lg.WithError(err).Errorf("%s: ublk queue %d stopped; the device's requests wait until it is unmapped (force)", h.name, q)
}

// QueueBuffers gives a queue memory registered on the session's paths where they stage data
// (verbs): its requests then go out from it and land in it without the copy through the
// stage (ublk.BufferProvider). Elsewhere, past -ublk-registered-memory, or if that fails,
// the queue maps its own.
func (h *ublkHandler) QueueBuffers(q, depth, maxIO int) ([]byte, func()) {
	n := int64(depth) * int64(maxIO)
	if h.u.regMem.Limit() < 0 {
		return nil, nil // off: the queue maps its own
	}
	if !h.u.regMem.Reserve(n) {
		h.u.regRefuse.Warn(h.lg, "ublk registered memory", h.name, fmt.Sprintf("ublk queue %d: the queues' registered buffers hold %d MiB, the bound (-ublk-registered-memory %d MiB): its data is copied through the transport's stage", q, h.u.regMem.Used()>>20, h.u.regMem.Limit()>>20))
		return nil, nil
	}
	b, free, err := h.d.AllocIOBuffers(depth*maxIO, maxIO)
	if err != nil || b == nil {
		h.u.regMem.Cancel(n)
		if err != nil {
			h.lg.WithError(err).Warnf("%s: ublk queue %d: buffers not registered, its requests are staged", h.name, q)
		}
		return nil, nil
	}
	return b, func() { h.u.regMem.ReleaseWhen(n, free()) }
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
