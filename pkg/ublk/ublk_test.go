package ublk

import (
	"bytes"
	"errors"
	"math/rand"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// The block layer's ioctls the tests issue (linux/fs.h).
const (
	blkDiscard = 0x1277 // BLKDISCARD
	blkZeroOut = 0x127f // BLKZEROOUT
)

// memHandler serves requests from memory, each in its own goroutine, counting ops.
type memHandler struct {
	mu  sync.Mutex
	mem []byte
	ops map[uint8]int
	fua int
	// failAt, when not negative, fails every request that covers it with failErr.
	failAt  int64
	failErr error
	// holdAt, when not negative, holds the first request that starts there: never done,
	// it goes to held (a server that dies with it).
	holdAt int64
	held   chan *Request
}

func newMem(size int) *memHandler {
	return &memHandler{mem: make([]byte, size), ops: map[uint8]int{}, failAt: -1, holdAt: -1, held: make(chan *Request, 1)}
}

func (m *memHandler) set(f func(m *memHandler)) { m.mu.Lock(); f(m); m.mu.Unlock() }

func (m *memHandler) Serve(r *Request) {
	go func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		m.ops[r.Op]++
		if r.Flags&IOFlagFUA != 0 {
			m.fua++
		}
		if r.Off < 0 || r.Off+int64(r.Len) > int64(len(m.mem)) || (r.Op == OpFlush && (r.Off != 0 || r.Len != 0)) {
			r.Done(syscall.EIO)
			return
		}
		if m.holdAt >= 0 && r.Off == m.holdAt {
			m.holdAt = -1
			m.held <- r
			return
		}
		if m.failAt >= r.Off && m.failAt < r.Off+int64(r.Len) {
			r.Done(m.failErr)
			return
		}
		switch r.Op {
		case OpRead:
			copy(r.Buf, m.mem[r.Off:])
		case OpWrite:
			copy(m.mem[r.Off:], r.Buf)
		case OpDiscard, OpWriteZeroes:
			clear(m.mem[r.Off : r.Off+int64(r.Len)])
		case OpFlush:
		default:
			r.Done(syscall.EOPNOTSUPP)
			return
		}
		r.Done(nil)
	}()
}

func (m *memHandler) count(op uint8) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ops[op]
}

// ctrlOrSkip opens the control device; without the driver (the host, Debian's 6.1) the
// tests skip, saying so, and the VM suite that runs them on 6.12 and 7.2 fails on a skip.
func ctrlOrSkip(t *testing.T) *Ctrl {
	t.Helper()
	c, err := OpenCtrl()
	if errors.Is(err, ErrNoDriver) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

const testSize = 64 << 20

func testOptions() Options {
	return Options{ID: -1, Queues: 2, Depth: 32, MaxIO: 128 << 10, Params: Params{
		Types: ParamTypeBasic | ParamTypeDiscard,
		Basic: ParamBasic{Attrs: AttrVolatileCache | AttrFUA, LogicalBSShift: 9, PhysicalBSShift: 12,
			IOMinShift: 9, IOOptShift: 12, DevSectors: testSize >> 9},
		Discard: ParamDiscard{DiscardGranularity: 4096, MaxDiscardSectors: 2048, MaxWriteZeroesSectors: 2048, MaxDiscardSegments: 1},
	}}
}

func sysfs(t *testing.T, d *Device, attr string) string {
	t.Helper()
	b, err := os.ReadFile("/sys/block/ublkb" + strconv.Itoa(d.ID()) + "/" + attr)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func openDirect(t *testing.T, d *Device) *os.File {
	t.Helper()
	f, err := os.OpenFile(d.BlockPath(), os.O_RDWR|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// aligned is a buffer O_DIRECT takes.
func aligned(n int) []byte {
	b := make([]byte, n+4096)
	off := int(-uintptr(unsafe.Pointer(&b[0])) & 4095)
	return b[off : off+n]
}

func rangeIoctl(f *os.File, req uint, off, n uint64) error {
	r := [2]uint64{off, n}
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&r)))
	if e != 0 {
		return e
	}
	return nil
}

// newTestDevice creates a device of testOptions served from memory, stopped when the test
// ends (a Stop the test makes itself before then is fine: the second does nothing).
func newTestDevice(t *testing.T, c *Ctrl) (*memHandler, *Device) {
	t.Helper()
	m := newMem(testSize)
	d, err := Create(c, testOptions(), m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop() })
	return m, d
}

// TestDeviceIO: a device with two queues takes reads and writes of every size up to its
// limit, flush (fsync), FUA, discard and write-zeroes, shows its limits in sysfs, counts
// as busy while open, and is gone after Stop.
func TestDeviceIO(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	m, d := newTestDevice(t, c)
	for attr, want := range map[string]string{"size": strconv.Itoa(testSize >> 9), "queue/logical_block_size": "512",
		"queue/physical_block_size": "4096", "queue/discard_granularity": "4096", "queue/write_cache": "write back",
		"queue/fua": "1", "queue/max_hw_sectors_kb": "128", "queue/write_zeroes_max_bytes": strconv.Itoa(2048 << 9)} {
		if got := sysfs(t, d, attr); got != want {
			t.Errorf("%s: %q, want %q", attr, got, want)
		}
	}
	f := openDirect(t, d)
	if !d.Busy() {
		t.Error("not busy while open")
	}
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 64; i++ {
		n := (1 + rng.Intn(256)) * 4096 // up to 1 MiB: the block layer splits at 128 KiB
		off := int64(rng.Intn((testSize-n)/4096)) * 4096
		p := aligned(n)
		rng.Read(p)
		if _, err := f.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		q := aligned(n)
		if _, err := f.ReadAt(q, off); err != nil || !bytes.Equal(p, q) {
			t.Fatalf("read back %d at %d: %v, equal %v", n, off, err, bytes.Equal(p, q))
		}
		if !bytes.Equal(m.mem[off:off+int64(n)], p) {
			t.Fatalf("the handler's memory differs at %d", off)
		}
	}
	if err := f.Sync(); err != nil || m.count(OpFlush) == 0 {
		t.Errorf("fsync: %v, %d flushes", err, m.count(OpFlush))
	}
	if err := rangeIoctl(f, blkDiscard, 1<<20, 1<<20); err != nil || m.count(OpDiscard) == 0 {
		t.Errorf("BLKDISCARD: %v, %d discards", err, m.count(OpDiscard))
	}
	if err := rangeIoctl(f, blkZeroOut, 4<<20, 1<<20); err != nil || m.count(OpWriteZeroes) == 0 {
		t.Errorf("BLKZEROOUT: %v, %d write-zeroes", err, m.count(OpWriteZeroes))
	}
	if !bytes.Equal(m.mem[4<<20:5<<20], make([]byte, 1<<20)) {
		t.Error("BLKZEROOUT left data")
	}
	// A write past the end is refused by the block layer, the handler never asked; an error
	// the handler gives reaches the caller as its errno (the driver's commit of a negative
	// result: EIO, and ENOSPC kept as itself).
	writes := m.count(OpWrite)
	if _, err := f.WriteAt(aligned(4096), testSize); !errors.Is(err, syscall.ENOSPC) || m.count(OpWrite) != writes {
		t.Errorf("write past the end: %v, %d writes reached the handler", err, m.count(OpWrite)-writes)
	}
	m.set(func(m *memHandler) { m.failAt, m.failErr = 32<<20, syscall.EIO })
	if _, err := f.ReadAt(aligned(8192), 32<<20-4096); !errors.Is(err, syscall.EIO) {
		t.Errorf("a read the handler failed with EIO: %v", err)
	}
	m.set(func(m *memHandler) { m.failErr = syscall.ENOSPC })
	if _, err := f.WriteAt(aligned(4096), 32<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("a write the handler failed with ENOSPC: %v", err)
	}
	m.set(func(m *memHandler) { m.failAt = -1 })
	g, err := os.OpenFile(d.BlockPath(), os.O_RDWR|syscall.O_DIRECT|syscall.O_DSYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.WriteAt(aligned(4096), 0); err != nil || m.fua == 0 && m.count(OpFlush) < 2 {
		t.Errorf("O_DSYNC write: %v, FUA %d", err, m.fua)
	}
	g.Close()
	f.Close()
	if d.Busy() {
		t.Error("busy once closed")
	}
	id := d.ID()
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.BlockPath()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Stop: %v", d.BlockPath(), err)
	}
	if _, err := c.DevInfo(uint32(id)); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("GET_DEV_INFO after Stop: %v", err)
	}
}

// newRecoverable creates a device served from memory for a test that makes its server
// "die"; should the test fail, the device goes, failing IO that waits on it (the test
// process could not exit with a read stuck in the kernel).
func newRecoverable(t *testing.T, c *Ctrl) (*memHandler, *Device) {
	t.Helper()
	m := newMem(testSize)
	d, err := Create(c, testOptions(), m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			_ = c.StopDev(uint32(d.ID()))
			_ = c.DelDev(uint32(d.ID()))
		}
	})
	return m, d
}

// TestRecover: a device whose server went away (its rings and char device closed, as at a
// crash) keeps its data path waiting; Recover takes it over, a read that waited meanwhile
// completes with the right data, and a write the dead server had taken is issued again. The recovered device then stops while the test still has
// it open (DEL_DEV would wait for that close; Stop must not).
func TestRecover(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	m, d := newRecoverable(t, c)
	f := openDirect(t, d)
	defer f.Close()
	p := aligned(64 << 10)
	rand.New(rand.NewSource(2)).Read(p)
	if _, err := f.WriteAt(p, 8<<20); err != nil {
		t.Fatal(err)
	}
	// A write the server has taken and not answered when it "dies": issued again to the
	// recovered server (UBLK_F_USER_RECOVERY_REISSUE), not failed.
	p2 := aligned(64 << 10)
	rand.New(rand.NewSource(5)).Read(p2)
	m.set(func(m *memHandler) { m.holdAt = 16 << 20 })
	heldDone := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(p2, 16<<20)
		heldDone <- err
	}()
	select {
	case <-m.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the write to hold never reached the server")
	}
	// The server "dies"; its loops would wait drainTimeout for the held request's handler.
	defer func(d time.Duration) { drainTimeout = d }(drainTimeout)
	drainTimeout = time.Second
	d.abort()
	done := make(chan error, 1)
	q := aligned(64 << 10)
	go func() {
		_, err := f.ReadAt(q, 8<<20)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("a read completed with no server: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	waitQuiesced(t, c, d)
	t1 := time.Now()
	d2, err := Recover(c, d.ID(), m, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		t2 := time.Now()
		if err := d2.Stop(); err != nil {
			t.Errorf("stopping the recovered device: %v", err)
		}
		t.Logf("stopped in %v", time.Since(t2))
	}()
	t.Logf("recovered in %v", time.Since(t1))
	select {
	case err := <-done:
		if err != nil || !bytes.Equal(p, q) {
			t.Fatalf("the waiting read: %v, equal %v", err, bytes.Equal(p, q))
		}
		t.Logf("the waiting read completed %v after the recovery began", time.Since(t1))
	case <-time.After(30 * time.Second):
		t.Fatal("the waiting read never completed")
	}
	select {
	case err := <-heldDone:
		m.mu.Lock()
		landed := bytes.Equal(m.mem[16<<20:16<<20+len(p2)], p2)
		m.mu.Unlock()
		if err != nil || !landed {
			t.Fatalf("the write the dead server held: %v, landed %v", err, landed)
		}
		t.Logf("the write the dead server held completed %v after the recovery began", time.Since(t1))
	case <-time.After(45 * time.Second):
		t.Fatal("the write the dead server held never completed")
	}
	if _, err := Recover(c, d2.ID(), m, time.Second); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("recovering a live device: %v", err)
	}
}

// waitQuiesced waits up to 30 s for the driver to quiesce d, whose server "died".
func waitQuiesced(t *testing.T, c *Ctrl, d *Device) {
	t.Helper()
	t0 := time.Now()
	for {
		info, err := c.DevInfo(uint32(d.ID()))
		if err != nil {
			t.Fatal(err)
		}
		if info.State == stateQuiesced {
			t.Logf("%v after %v", info.State, time.Since(t0))
			return
		}
		if time.Since(t0) > 30*time.Second {
			t.Fatalf("still %v after 30 s: never quiesced", info.State)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRecoverAfterFailedSetup: a recovery whose second queue cannot be set up (the test
// switch failQueueSetup) fails before START_USER_RECOVERY, so the device stays
// recoverable: the next recovery takes it over, and what was written before reads back.
// (On 6.12 a recovery that fails after START_USER_RECOVERY leaves the device beyond
// recovery: the driver refuses the next one, or, if some queues had fetched, resets those
// that had not.)
func TestRecoverAfterFailedSetup(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	m, d := newRecoverable(t, c)
	f := openDirect(t, d)
	p := aligned(64 << 10)
	rand.New(rand.NewSource(4)).Read(p)
	if _, err := f.WriteAt(p, 8<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.abort() // the server "dies"
	waitQuiesced(t, c, d)
	failQueueSetup = 1
	_, err := Recover(c, d.ID(), m, 30*time.Second)
	failQueueSetup = -1
	if !errors.Is(err, errSetupInjected) {
		t.Fatalf("a recovery with queue 1's setup failing: %v", err)
	}
	d2, err := Recover(c, d.ID(), m, 30*time.Second)
	if err != nil {
		t.Fatalf("the recovery after it: %v", err)
	}
	defer func() {
		if err := d2.Stop(); err != nil {
			t.Errorf("stopping the recovered device: %v", err)
		}
	}()
	g := openDirect(t, d2)
	defer g.Close()
	q := aligned(64 << 10)
	if _, err := g.ReadAt(q, 8<<20); err != nil || !bytes.Equal(p, q) {
		t.Fatalf("reading back after the recovery: %v, equal %v", err, bytes.Equal(p, q))
	}
}

// TestCreateErrors: a taken id and bad options are refused with nothing left behind.
func TestCreateErrors(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	o := testOptions()
	o.Depth = 0
	if _, err := Create(c, o, newMem(testSize)); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("depth 0: %v", err)
	}
	d, err := Create(c, testOptions(), newMem(testSize))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	o = testOptions()
	o.ID = d.ID()
	if _, err := Create(c, o, newMem(testSize)); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("a second device %d: %v", d.ID(), err)
	}
}

// TestCtrlCommandTimeout: a control command that does not complete in time (DEL_DEV, which
// waits until nothing holds the device, while this process still has its char device open)
// fails with ETIMEDOUT and leaves its ring to the kernel; the Ctrl goes on with a new ring,
// so devices can still be created and stopped through it, and the first device is let go
// once its Stop closes what held it (the abandoned DEL_DEV then completes).
func TestCtrlCommandTimeout(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	d, err := Create(c, testOptions(), newMem(testSize))
	if err != nil {
		t.Fatal(err)
	}
	old := ctrlTimeout
	ctrlTimeout = time.Second
	err = c.simple(cmdDelDev, d.id)
	ctrlTimeout = old
	if !errors.Is(err, syscall.ETIMEDOUT) {
		_ = d.Stop()
		t.Fatalf("DEL_DEV with the char device still open: %v, want ETIMEDOUT", err)
	}
	d2, err := Create(c, testOptions(), newMem(testSize))
	if err != nil {
		_ = d.Stop()
		t.Fatalf("a device created after the timed-out command: %v", err)
	}
	if err := d2.Stop(); err != nil {
		t.Errorf("stopping it: %v", err)
	}
	if err := d.Stop(); err != nil {
		t.Errorf("stopping the first: %v", err)
	}
	waitGone(t, c, d.id, "its Stop")
}

// TestStopOpenWithDelDevOnly: as on kernels before 6.11, which have DEL_DEV and not
// DEL_DEV_ASYNC (the test switch noDelDevAsync), a device stopped while /dev/ublkbN is
// still open is deleted without waiting for that opener: Stop succeeds and leaves no ring
// behind, IO on the open descriptor fails, the number stays taken while it is open and is
// free once it closes. (DEL_DEV alone waits for the opener: Stop failed after ctrlTimeout.)
func TestStopOpenWithDelDevOnly(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	old := ctrlTimeout
	noDelDevAsync, ctrlTimeout = true, 5*time.Second
	defer func() { noDelDevAsync, ctrlTimeout = false, old }()
	_, d := newTestDevice(t, c)
	f := openDirect(t, d)
	defer f.Close()
	left := abandonedRings()
	id := uint32(d.ID())
	if err := d.Stop(); err != nil {
		t.Fatalf("Stop with /dev/ublkb%d open, DEL_DEV alone: %v", id, err)
	}
	if n := abandonedRings(); n > left { // (fewer: another test's reaped meanwhile)
		t.Errorf("%d rings abandoned by the stop", n-left)
	}
	if _, err := f.ReadAt(aligned(4096), 0); err == nil {
		t.Error("a read from the deleted device succeeded")
	}
	if _, err := c.DevInfo(id); err != nil {
		t.Errorf("device %d while its opener still has it: %v, want it there", id, err)
	}
	f.Close()
	waitGone(t, c, id, "its opener closed it")
}

// TestStopIfUnused: where the driver checks for openers itself (FlagSafeStopDev, 7.x),
// StopIfUnused of an open device fails with EBUSY and changes nothing: the device still
// serves IO and stops once closed. Without that check (6.12) it stops a device nothing has
// open, as Stop does.
func TestStopIfUnused(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	m, d := newTestDevice(t, c)
	if c.Features()&FlagSafeStopDev != 0 {
		f := openDirect(t, d)
		if err := d.StopIfUnused(); !errors.Is(err, syscall.EBUSY) {
			f.Close()
			t.Fatalf("StopIfUnused of an open device: %v, want EBUSY", err)
		}
		p := aligned(4096)
		rand.New(rand.NewSource(3)).Read(p)
		if _, err := f.WriteAt(p, 1<<20); err != nil || !bytes.Equal(m.mem[1<<20:1<<20+4096], p) {
			t.Errorf("a write after the refused stop: %v", err)
		}
		f.Close()
	} else {
		t.Logf("driver features %#x: no TRY_STOP_DEV; only the caller's check guards the stop", c.Features())
	}
	if err := d.StopIfUnused(); err != nil {
		t.Fatalf("StopIfUnused of a closed device: %v", err)
	}
	waitGone(t, c, uint32(d.ID()), "StopIfUnused")
}

// failHandler is a memHandler that reports queue failures (FailureReporter).
type failHandler struct {
	*memHandler
	failed chan error
}

func (h failHandler) QueueFailed(_ int, err error) {
	select {
	case h.failed <- err:
	default:
	}
}

// abandonedRings counts the control rings left to the kernel so far.
func abandonedRings() int {
	abandoned.mu.Lock()
	defer abandoned.mu.Unlock()
	return len(abandoned.rings)
}

// TestStopAfterQueueFailed: a queue whose commit of a write the driver refuses (the test
// switch refuseCommit) ends, and the handler hears why; the write waits. Stop then releases
// the char device before STOP_DEV, which on 7.2 would otherwise wait for the request the
// failed queue had taken until the control timeout: the stop succeeds without leaving a
// ring behind, and the waiting write ends with an error.
func TestStopAfterQueueFailed(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	old := ctrlTimeout
	ctrlTimeout = 10 * time.Second
	defer func() { ctrlTimeout = old; refuseCommit.Store(false) }()
	h := failHandler{newMem(testSize), make(chan error, 4)}
	d, err := Create(c, testOptions(), h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop() })
	f := openDirect(t, d)
	defer f.Close()
	refuseCommit.Store(true)
	wrote := make(chan error, 1)
	go func() {
		_, err := f.WriteAt(aligned(4096), 0)
		wrote <- err
	}()
	select {
	case err := <-h.failed:
		if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("the queue failed with %v, want the driver's EINVAL", err)
		}
	case err := <-wrote:
		t.Fatalf("the write completed (%v) with its commit refused", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no queue failed 10 s after a refused commit")
	}
	left := abandonedRings()
	if err := d.Stop(); err != nil {
		t.Fatalf("Stop after a queue failed: %v", err)
	}
	if n := abandonedRings(); n > left {
		t.Errorf("%d control rings abandoned by the stop", n-left)
	}
	select {
	case err := <-wrote:
		if err == nil {
			t.Error("the write whose commit was refused succeeded")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the write on the failed queue still waits 10 s after Stop")
	}
}

// waitGone waits up to 10 s for device id to be gone from the driver, after what.
func waitGone(t *testing.T, c *Ctrl, id uint32, after string) {
	t.Helper()
	for t0 := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		_, err := c.DevInfo(id)
		if errors.Is(err, syscall.ENODEV) {
			return
		}
		if time.Since(t0) > 10*time.Second {
			t.Fatalf("device %d still there 10 s after %s: %v", id, after, err)
		}
	}
}

// TestCtrlConcurrentCommands: while one device's START_DEV waits (its queues have not
// fetched, which every kernel waits for), another device is created, queried and stopped
// through the same Ctrl; the first then starts once its queues fetch.
func TestCtrlConcurrentCommands(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	o := testOptions()
	info, err := c.AddDev(DevInfo{NrHWQueues: uint16(o.Queues), QueueDepth: uint16(o.Depth), MaxIOBufBytes: uint32(o.MaxIO),
		DevID: ^uint32(0), Flags: FlagUserRecovery | FlagUserRecoveryReissue | FlagCmdIoctlEncode})
	if err != nil {
		t.Fatal(err)
	}
	first := &Device{ctrl: c, id: info.DevID, info: info}
	p := o.Params
	p.Basic.MaxSectors, _ = maxSectors(0, o.MaxIO, info.MaxIOBufBytes)
	if err := c.SetParams(first.id, p); err != nil {
		first.delete()
		t.Fatal(err)
	}
	startDev := make(chan error, 1)
	go func() { startDev <- c.StartDev(first.id) }()
	second := make(chan error, 1)
	go func() {
		d, err := Create(c, testOptions(), newMem(testSize))
		if err == nil {
			if _, err = c.DevInfo(d.id); err != nil {
				_ = d.Stop()
			} else {
				err = d.Stop()
			}
		}
		second <- err
	}()
	// Less than ctrlTimeout, after which the waiting START_DEV fails.
	select {
	case err := <-second:
		if err != nil {
			t.Errorf("a second device while the first's START_DEV waited: %v", err)
		}
		select {
		case err := <-startDev:
			t.Errorf("the first device's START_DEV returned (%v) before its queues fetched", err)
			startDev <- err
		default:
		}
	case <-time.After(15 * time.Second):
		t.Errorf("a second device waited more than 15 s behind the first's START_DEV")
		defer func() {
			if err := <-second; err != nil {
				t.Errorf("the second device, once the first started: %v", err)
			}
		}()
	}
	if err := first.start(newMem(testSize), func(uint32) error { return <-startDev }, true); err != nil {
		first.delete()
		t.Fatalf("the first device, once its queues fetched: %v", err)
	}
	if err := first.Stop(); err != nil {
		t.Errorf("stopping the first device: %v", err)
	}
}

// TestRefusedFetch: a fetch the driver refuses fails the device's start at once, where
// START_DEV would wait for that tag until it timed out, and leaves no device behind.
func TestRefusedFetch(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	o := testOptions()
	o.ID = 77
	if _, err := c.DevInfo(uint32(o.ID)); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("device %d before the test: %v", o.ID, err)
	}
	refuseFetch = true
	oldTimeout := ctrlTimeout
	ctrlTimeout = 5 * time.Second // a START_DEV waiting for the tag would time out, and count as started
	d, err := Create(c, o, newMem(testSize))
	refuseFetch = false
	ctrlTimeout = oldTimeout
	if err == nil {
		_ = d.Stop()
		t.Fatal("a device started with a fetch refused")
	}
	if !strings.Contains(err.Error(), "refused a fetch") || !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Create: %v, want the refused fetch's EINVAL", err)
	}
	// The number is free once the queues' rings, torn down in the background, let go of
	// the char device.
	waitGone(t, c, uint32(o.ID), "the failed start")
}

// TestIdleBuffersGiveBack: the pages a queue's requests touched in its buffers go back to
// the system once it has been idle a while, and IO after that is served right.
func TestIdleBuffersGiveBack(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	_, d := newTestDevice(t, c)
	f := openDirect(t, d)
	defer f.Close()
	touched := func() (n int) {
		for _, q := range d.queues {
			n += testutil.Resident(t, q.bufs)
		}
		return n
	}
	rng := rand.New(rand.NewSource(2))
	roundTrip := func() {
		t.Helper()
		for i := 0; i < 16; i++ {
			off := int64(rng.Intn(testSize>>20)) << 20
			p := aligned(1 << 20)
			rng.Read(p)
			if _, err := f.WriteAt(p, off); err != nil {
				t.Fatal(err)
			}
			q := aligned(1 << 20)
			if _, err := f.ReadAt(q, off); err != nil || !bytes.Equal(p, q) {
				t.Fatalf("read back at %d: %v, equal %v", off, err, bytes.Equal(p, q))
			}
		}
	}
	roundTrip()
	if n := touched(); n == 0 {
		t.Fatal("no buffer page resident after IO: the test cannot tell a give-back")
	}
	deadline := time.Now().Add(time.Duration(idleWaits+5) * waitSlice)
	for touched() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d buffer pages still resident after %v idle", touched(), time.Duration(idleWaits+5)*waitSlice)
		}
		time.Sleep(100 * time.Millisecond)
	}
	roundTrip()
}

// TestMaxSectors: max_sectors stays within the buffer the driver granted, which ADD_DEV
// rounds down to its page size (SET_PARAMS refuses more), and a grant of nothing is refused.
func TestMaxSectors(t *testing.T) {
	for _, c := range []struct {
		want    uint32
		maxIO   int
		granted uint32
		out     uint32
		ok      bool
	}{
		{0, 124 << 10, 124 << 10, 248, true},   // 4 KiB pages: as asked
		{0, 124 << 10, 64 << 10, 128, true},    // 64 KiB pages: the driver's rounding
		{64, 124 << 10, 124 << 10, 64, true},   // a smaller limit of the caller's stays
		{300, 124 << 10, 124 << 10, 248, true}, // a larger one is cut to the buffer
		{0, 16 << 10, 0, 0, false},             // below a 64 KiB page: nothing granted
	} {
		out, ok := maxSectors(c.want, c.maxIO, c.granted)
		if out != c.out || ok != c.ok {
			t.Errorf("maxSectors(%d, %d, %d) = %d, %v; want %d, %v", c.want, c.maxIO, c.granted, out, ok, c.out, c.ok)
		}
	}
}

// providingHandler serves from memory with buffers it provides (BufferProvider), checking
// that every request's buffer lies in them.
type providingHandler struct {
	*memHandler
	mu      sync.Mutex
	bufs    [][]byte
	freed   int
	outside int // requests whose buffer was not in a provided one
	short   bool
}

func (h *providingHandler) QueueBuffers(queue, depth, maxIO int) ([]byte, func()) {
	n := depth * maxIO
	if h.short {
		n -= maxIO
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil
	}
	h.mu.Lock()
	h.bufs = append(h.bufs, b)
	h.mu.Unlock()
	return b, func() {
		h.mu.Lock()
		h.freed++
		// Forgotten: the queue's own mapping may take the same addresses.
		h.bufs = slices.DeleteFunc(h.bufs, func(x []byte) bool { return &x[0] == &b[0] })
		h.mu.Unlock()
		_ = unix.Munmap(b)
	}
}

func (h *providingHandler) Serve(r *Request) {
	if len(r.Buf) > 0 {
		p := uintptr(unsafe.Pointer(&r.Buf[0]))
		in := false
		h.mu.Lock()
		for _, b := range h.bufs {
			s := uintptr(unsafe.Pointer(&b[0]))
			in = in || p >= s && p+uintptr(len(r.Buf)) <= s+uintptr(len(b))
		}
		if !in {
			h.outside++
		}
		h.mu.Unlock()
	}
	h.memHandler.Serve(r)
}

// TestProvidedBuffers: a handler's buffers (BufferProvider) serve its requests, are not given
// back while idle (a registration would lose them), and are freed once per queue at Stop;
// buffers of the wrong size are freed at once and the queue maps its own.
func TestProvidedBuffers(t *testing.T) {
	leakcheck.Check(t)
	c := ctrlOrSkip(t)
	for _, short := range []bool{false, true} {
		h := &providingHandler{memHandler: newMem(testSize), short: short}
		d, err := Create(c, testOptions(), h)
		if err != nil {
			t.Fatal(err)
		}
		f := openDirect(t, d)
		p := aligned(1 << 20)
		rand.New(rand.NewSource(3)).Read(p)
		if _, err := f.WriteAt(p, 4<<20); err != nil {
			t.Fatal(err)
		}
		q := aligned(1 << 20)
		if _, err := f.ReadAt(q, 4<<20); err != nil || !bytes.Equal(p, q) {
			t.Fatalf("short %v: read back: %v, equal %v", short, err, bytes.Equal(p, q))
		}
		h.mu.Lock()
		outside, freed := h.outside, h.freed
		h.mu.Unlock()
		if !short {
			if outside != 0 || freed != 0 {
				t.Fatalf("%d requests outside the provided buffers, %d freed while in use", outside, freed)
			}
			// As long as TestIdleBuffersGiveBack waits for its own buffers to go.
			for end := time.Now().Add(time.Duration(idleWaits+5) * waitSlice); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
				n := 0
				for _, q := range d.queues {
					n += testutil.Resident(t, q.bufs)
				}
				if n == 0 {
					t.Fatal("provided buffers given back while idle")
				}
			}
		} else if nq := int(d.Info().NrHWQueues); outside == 0 || freed != nq {
			t.Fatalf("buffers of the wrong size: %d requests outside them (want all), %d freed (want %d)", outside, freed, nq)
		}
		f.Close()
		// The driver gives at most a queue per CPU, whatever was asked.
		nq := int(d.Info().NrHWQueues)
		if err := d.Stop(); err != nil {
			t.Fatal(err)
		}
		if h.freed != nq {
			t.Fatalf("short %v: provided buffers freed %d times for %d queues", short, h.freed, nq)
		}
	}
}

// TestServedBy: a device's recorded server counts only while it lives and holds the device's
// char device open; the recovering process itself and a process that merely has the number
// (a restarted container's pid 1, a reused pid) do not.
func TestServedBy(t *testing.T) {
	if servedBy(os.Getpid(), 1) {
		t.Fatal("this process taken as the server of a device it recovers")
	}
	id := 3000 + rand.Intn(1000)
	char := "/dev/ublkc" + strconv.Itoa(id) // no driver of this number: a plain file stands in
	if err := os.WriteFile(char, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(char)
	for _, holds := range []bool{false, true} {
		args := []string{"-c", "exec sleep 30"}
		if holds {
			args = []string{"-c", "exec sleep 30 3<" + char}
		}
		cmd := exec.Command("bash", args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		pid := cmd.Process.Pid
		testutil.WaitFor(t, 5*time.Second, "the child's exec", func() bool {
			l, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/exe")
			return strings.HasSuffix(l, "/sleep")
		})
		got := servedBy(pid, id)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if got != holds {
			t.Errorf("a live process holding /dev/ublkc%d %v: served %v", id, holds, got)
		}
		if servedBy(pid, id) {
			t.Errorf("a process gone taken as the server")
		}
	}
}

// TestIoctlEncoding: control opcodes as <linux/ublk_cmd.h> builds them with the generic
// _IOC (_IOR('u', 0x13, 32 bytes) is 0x80207513), and the architectures whose _IOC or byte
// order differ refused rather than sent wrong numbers.
func TestIoctlEncoding(t *testing.T) {
	for nr, want := range map[uint32]uint32{cmdGetFeatures: 0x80207513, cmdGetDevInfo: 0x80207502, cmdAddDev: 0xc0207504, cmdUpdateSize: 0xc0207515, cmdTryStopDev: 0xc0207517} {
		if got := ctrlOp(nr); got != want {
			t.Errorf("command %#x: %#x, want %#x", nr, got, want)
		}
	}
	if got := ioOp(ioCommitAndFetchReq); got != 0xc0107521 {
		t.Errorf("COMMIT_AND_FETCH: %#x, want 0xc0107521", got)
	}
	for arch, ok := range map[string]bool{"amd64": true, "arm64": true, "ppc64le": false, "mips64le": false, "s390x": false, "sparc64": false} {
		if ioctlArch(arch) != ok {
			t.Errorf("%s: taken %v, want %v", arch, !ok, ok)
		}
	}
}
