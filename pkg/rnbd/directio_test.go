package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/aio"
	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// loopExport makes an 8 MiB file of random bytes on tmpfs, attaches a loop device to it and
// returns the device's name under /dev, the file's path and its bytes.
func loopExport(t *testing.T) (name, file string, model []byte) {
	t.Helper()
	requireRoot(t)
	file = filepath.Join(tmpfsDir(t), "disk")
	model = make([]byte, loopSize)
	fill(rand.New(rand.NewPCG(7, 7)), model)
	if err := os.WriteFile(file, model, 0o600); err != nil {
		t.Fatal(err)
	}
	return attachLoop(t, file), file, model
}

// cachedPages counts the pages of the block device's own page cache that are resident.
func cachedPages(t *testing.T, dev string) int {
	t.Helper()
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, loopSize, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	return testutil.Resident(t, m)
}

// TestExportIOBlockDevice: a loop device exported from /dev takes random IO, a FUA write and
// a flush through the whole stack; the file under it ends equal to the model. With direct IO
// the device's page cache stays empty (the data went past it); buffered, it fills.
func TestExportIOBlockDevice(t *testing.T) {
	for _, mode := range []ExportIO{ExportIODirect, ExportIOBuffered} {
		t.Run(mode.String(), func(t *testing.T) {
			leakcheck.Check(t)
			name, file, model := loopExport(t)
			e := &testEnv{prov: soft.New(soft.Options{}), dir: "/dev", exportIO: mode}
			e.start(t, 0)
			t.Cleanup(e.stop)
			c := e.client(t, 5*time.Second)
			d := mustMap(t, e, c, "dio", name, AccessRW)
			// A volatile cache with FUA, whatever the loop device's queue says (no FUA):
			// writes may pass the page cache, which only flushes and FUA make durable.
			if got := d.Geometry().CachePolicy; got != CacheWriteback|CacheFUA {
				t.Errorf("cache policy %#x, want write-back with FUA", got)
			}
			randomIO(t, d, model, 600, 8, 3)
			ctx := context.Background()
			pattern := bytes.Repeat([]byte("FUA!"), 1024)
			if err := d.WriteAtContext(ctx, pattern, 1<<20, true); err != nil {
				t.Fatal(err)
			}
			copy(model[1<<20:], pattern)
			if err := d.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			st := &e.server().Stats
			if st.FUAWrites.Value() != 1 || st.Flushes.Value() != 1 || st.Errors.Value() != 0 {
				t.Fatalf("FUA writes %d, flushes %d, errors %d", st.FUAWrites.Value(), st.Flushes.Value(), st.Errors.Value())
			}
			// Bounds are the server's to check, before any IO.
			if _, err := d.ReadAt(make([]byte, 4096), loopSize); err == nil {
				t.Fatal("read beyond the device's end succeeded")
			}
			cached := cachedPages(t, "/dev/"+name)
			pages := loopSize / os.Getpagesize()
			switch {
			case mode == ExportIODirect && cached > pages/8:
				t.Errorf("direct IO: %d of %d pages in the device's page cache", cached, pages)
			case mode == ExportIOBuffered && cached < pages/2:
				t.Errorf("buffered IO: only %d of %d pages in the device's page cache", cached, pages)
			}
			if err := d.Unmap(ctx); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(file)
			if err != nil || !bytes.Equal(got, model) {
				t.Fatalf("the file under the loop device differs from the model (%v)", err)
			}
		})
	}
}

// TestDirectIOQueue drives a device's direct IO alone: more requests than the ring has
// slots, each answered once with its data in place; a buffer O_DIRECT cannot take is
// refused, an empty one answered at once, a read at the device's end fails; close waits
// for everything queued.
func TestDirectIOQueue(t *testing.T) {
	leakcheck.Check(t)
	name, file, model := loopExport(t)
	var mu sync.Mutex
	answers := map[*transport.SrvRequest][]error{}
	answer := func(r *transport.SrvRequest, err error) {
		mu.Lock()
		answers[r] = append(answers[r], err)
		mu.Unlock()
	}
	d, err := newDirectIO("/dev/"+name, true, SectorSize, answer)
	if err != nil {
		t.Fatal(err)
	}
	const n = 3 * dioEntries
	const bs = 4096
	reqs := make([]transport.SrvRequest, n+3)
	buf, err := unix.Mmap(-1, 0, n*bs+bs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	// Even requests write their block (the model's bytes, inverted), odd ones read theirs.
	want := bytes.Clone(model)
	for i := range n {
		b := buf[i*bs : (i+1)*bs]
		off := int64(i * bs)
		write := i%2 == 0
		if write {
			for j := range b {
				b[j] = ^model[int(off)+j]
			}
			copy(want[off:], b)
		}
		if !d.submit(&reqs[i], write, i%4 == 0, b, off, i%2 == 0) {
			t.Fatalf("request %d refused", i)
		}
	}
	if d.submit(&reqs[n], false, false, buf[n*bs+1:n*bs+1+512], 0, true) {
		t.Fatal("a buffer one byte off the block accepted")
	}
	if !d.submit(&reqs[n+1], false, false, buf[:0], 0, true) {
		t.Fatal("an empty request refused")
	}
	if !d.submit(&reqs[n+2], false, false, buf[n*bs:n*bs+bs], loopSize, true) {
		t.Fatal("a read at the end refused")
	}
	if err := d.close(); err != nil {
		t.Fatal(err)
	}
	for i := range n + 3 {
		errs := answers[&reqs[i]]
		switch {
		case i == n:
			if len(errs) != 0 {
				t.Errorf("the refused request was answered: %v", errs)
			}
		case i == n+2:
			if len(errs) != 1 || !errors.Is(errs[0], syscall.EIO) {
				t.Errorf("read at the end: %v, want one EIO", errs)
			}
		case len(errs) != 1 || errs[0] != nil:
			t.Errorf("request %d answered %v, want once without error", i, errs)
		}
	}
	for i := 1; i < n; i += 2 {
		if !bytes.Equal(buf[i*bs:(i+1)*bs], model[i*bs:(i+1)*bs]) {
			t.Fatalf("read %d: wrong data", i)
		}
	}
	got, err := os.ReadFile(file)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the file differs from what was written (%v)", err)
	}
}

// The open's probe passes a device that reads with O_DIRECT, and refuses one that took the
// open but not the IO: a device of 4 KiB blocks probed as one of 512 bytes (EINVAL), which
// then stays on the page cache.
func TestDirectIOProbe(t *testing.T) {
	leakcheck.Check(t)
	name, file, _ := loopExport(t)
	d, err := newDirectIO("/dev/"+name, false, SectorSize, func(*transport.SrvRequest, error) {})
	if err != nil {
		t.Fatalf("loop device: %v", err)
	}
	if d.late {
		t.Error("a loop device over tmpfs did not answer its probe in time")
	}
	if err := d.close(); err != nil {
		t.Fatal(err)
	}
	big := attachLoopBlock(t, file, 4096)
	// (The open itself succeeds: the EINVAL is the read's.)
	if d, err := newDirectIO("/dev/"+big, false, SectorSize, func(*transport.SrvRequest, error) {}); !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "read") {
		if err == nil {
			_ = d.close()
		}
		t.Fatalf("a 512-byte probe of a device of 4 KiB blocks: %v, want the read's EINVAL", err)
	}
}

// TestStuckOpenGoesOnAfterProbe: an OPEN of a device that does not answer its probe read waits
// dioProbeTimeout, no longer: it is answered with the device open and the read still at the
// device. The device's IO then waits at the device like any other, is served once the
// device answers, and the close finds nothing left behind (the probe's late completion taken
// by the reaper).
func TestStuckOpenGoesOnAfterProbe(t *testing.T) {
	leakcheck.Check(t)
	withProbeTimeout(t, 300*time.Millisecond)
	f, name, e := gatedEnv(t, dioDrainTimeout)
	want := bytes.Repeat([]byte{0x5a}, 4096)
	copy(f.Data[2<<20:], want)
	c := e.client(t, 5*time.Second)
	f.shut()
	defer f.open()
	opened := make(chan error, 1)
	var d *Device
	go func() {
		var err error
		d, err = e.mapDev(t, c, "a", name, AccessRO)
		opened <- err
	}()
	select {
	case err := <-opened:
		if err != nil {
			t.Fatalf("the OPEN of a device that does not answer: %v", err)
		}
	case <-time.After(8 * time.Second):
		f.open()
		<-opened
		t.Fatal("the OPEN waited for the device past its probe's timeout")
	}
	if dio := directOf(t, e, "a"); dio == nil || !dio.late || f.waiting.Load() == 0 {
		t.Fatalf("direct IO %v, its probe late and held at the device: want all (the test proves nothing otherwise)", dio != nil)
	}
	got := make([]byte, 4096)
	read := make(chan error, 1)
	d.ReadAsync(context.Background(), got, 2<<20, func(err error) { read <- err })
	select {
	case err := <-read:
		t.Fatalf("a read answered while the device is shut: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	f.open()
	select {
	case err := <-read:
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("the read once the device answers: %v (right data: %v)", err, bytes.Equal(got, want))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the read was not answered once the device answered")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := d.Unmap(ctx); err != nil {
		t.Fatalf("unmap: %v", err)
	}
}

// TestLateOpenClosesAtOnce: a device opened while its probe read is still at the device, and
// closed before that read comes back, closes at once (not after dioDrainTimeout: none of the
// session's IO is there) and stops counting against rw opens; its place among the direct IO
// devices comes back only once the read has ended and the device is let go.
func TestLateOpenClosesAtOnce(t *testing.T) {
	leakcheck.Check(t)
	withProbeTimeout(t, 300*time.Millisecond)
	f, name, e := gatedEnv(t, 20*time.Second)
	f.shut()
	defer f.open()
	d := mustMap(t, e, e.client(t, 5*time.Second), "a", name, AccessRW)
	if dio := directOf(t, e, "a"); dio == nil || !dio.late {
		t.Fatal("the device was not opened with its probe late: the test proves nothing")
	}
	rs := e.server()
	loops := func() int { rs.mu.Lock(); defer rs.mu.Unlock(); return rs.loops }
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := d.Unmap(ctx); err != nil {
		t.Fatalf("unmap while only the probe is at the device: %v", err)
	}
	if _, err := e.mapDev(t, e.client(t, 5*time.Second), "b", name, AccessRW); err != nil {
		t.Fatalf("another session's rw open once the first has closed: %v", err)
	}
	if n := loops(); n != 2 {
		t.Fatalf("%d devices counted with direct IO, want 2 (the closed one until its probe ends)", n)
	}
	f.open()
	testutil.WaitFor(t, 10*time.Second, "the closed device let go once its probe ended", func() bool { return loops() == 1 })
}

// withProbeTimeout sets dioProbeTimeout for the test.
func withProbeTimeout(t *testing.T, d time.Duration) {
	old := dioProbeTimeout
	dioProbeTimeout = d
	t.Cleanup(func() { dioProbeTimeout = old })
}

// directOf is the direct IO of the device session sess has open on e's server, nil if it
// has none or it goes through the page cache.
func directOf(t *testing.T, e *testEnv, sess string) *directIO {
	t.Helper()
	rs := e.server()
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for _, ss := range rs.sessions {
		for _, d := range ss.devs {
			if ss.name == sess {
				if !d.direct {
					return nil
				}
				return d.b.dio
			}
		}
	}
	t.Fatalf("session %q has no device open", sess)
	return nil
}

// gatedFile is a FUSE file in memory whose reads and writes wait while its gate is shut:
// under a loop device, a block device that stops answering until told.
type gatedFile struct {
	fs.MemRegularFile
	mu      sync.Mutex
	gate    chan struct{} // non-nil while shut; closed to open it
	waiting atomic.Int32
	data    sync.Mutex // a read's bytes are copied out under it, away from writes
}

func (f *gatedFile) pass() {
	f.mu.Lock()
	g := f.gate
	f.mu.Unlock()
	if g != nil {
		f.waiting.Add(1)
		<-g
		f.waiting.Add(-1)
	}
}

func (f *gatedFile) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	f.pass()
	f.data.Lock()
	defer f.data.Unlock()
	return f.MemRegularFile.Write(ctx, fh, data, off)
}

// Read returns a copy: MemRegularFile's result is its own data, which the reply would send
// while a later write changes it.
func (f *gatedFile) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f.pass()
	f.data.Lock()
	defer f.data.Unlock()
	res, errno := f.MemRegularFile.Read(ctx, fh, dest, off)
	if errno != 0 {
		return res, errno
	}
	b, st := res.Bytes(dest)
	if st != fuse.OK {
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(append([]byte(nil), b...)), 0
}

func (f *gatedFile) shut() { f.mu.Lock(); f.gate = make(chan struct{}); f.mu.Unlock() }

func (f *gatedFile) open() {
	f.mu.Lock()
	if f.gate != nil {
		close(f.gate)
		f.gate = nil
	}
	f.mu.Unlock()
}

type gatedRoot struct {
	fs.Inode
	file *gatedFile
}

func (r *gatedRoot) OnAdd(ctx context.Context) {
	r.AddChild("disk", r.NewPersistentInode(ctx, r.file, fs.StableAttr{Mode: syscall.S_IFREG}), false)
	plain := &fs.MemRegularFile{Data: make([]byte, loopSize), Attr: fuse.Attr{Mode: 0o600}}
	r.AddChild("plain", r.NewPersistentInode(ctx, plain, fs.StableAttr{Mode: syscall.S_IFREG}), false)
}

// gatedMount mounts a gatedFile of loopSize bytes, "disk" in the directory it returns,
// beside "plain", a file of as many zeroes that always answers.
func gatedMount(t *testing.T) (*gatedFile, string) {
	t.Helper()
	requireRoot(t)
	mnt := t.TempDir()
	f := &gatedFile{MemRegularFile: fs.MemRegularFile{Data: make([]byte, loopSize), Attr: fuse.Attr{Mode: 0o600}}}
	srv, err := fs.Mount(mnt, &gatedRoot{file: f}, &fs.Options{MountOptions: fuse.MountOptions{DirectMount: true}})
	if err != nil {
		t.Fatalf("FUSE mount: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("FUSE unmount: %v", err)
		}
	})
	t.Cleanup(f.open) // before the unmount
	return f, mnt
}

// gatedLoop attaches a loop device to a gatedMount's file; it returns the file and the
// device's name under /dev.
func gatedLoop(t *testing.T) (*gatedFile, string) {
	t.Helper()
	f, mnt := gatedMount(t)
	name := attachLoop(t, filepath.Join(mnt, "disk"))
	t.Cleanup(f.open) // before the loop device goes
	return f, name
}

// withDrain sets dioDrainTimeout for the test.
func withDrain(t *testing.T, drain time.Duration) {
	old := dioDrainTimeout
	dioDrainTimeout = drain
	t.Cleanup(func() { dioDrainTimeout = old })
}

// gatedEnv starts a server exporting /dev with a gatedLoop device in it, dioDrainTimeout
// set to drain for the test; the gate opens before the server stops, which waits for what
// the device holds.
func gatedEnv(t *testing.T, drain time.Duration) (*gatedFile, string, *testEnv) {
	t.Helper()
	withDrain(t, drain)
	f, name := gatedLoop(t)
	e := &testEnv{prov: soft.New(soft.Options{}), dir: "/dev"}
	e.start(t, 0)
	t.Cleanup(e.stop)
	t.Cleanup(f.open)
	return f, name, e
}

// TestDirectIOCloseKeepsWriterUntilIOEnds: a device closed for a session while one of its
// writes is still at the device (force_close here; a session that goes and a CLOSE take the
// same way) gives up waiting after dioDrainTimeout, but its rw mode keeps counting until
// that write has ended: another session's rw open is refused meanwhile, so it cannot write
// beside a write still on its way, and succeeds once the write is done.
func TestDirectIOCloseKeepsWriterUntilIOEnds(t *testing.T) {
	leakcheck.Check(t)
	f, name, e := gatedEnv(t, 200*time.Millisecond)
	d := mustMap(t, e, e.client(t, 5*time.Second), "writer", name, AccessRW)
	f.shut()
	defer f.open() // a failure's cleanups (the client's close) wait for the held IO
	wrote := make(chan error, 1)
	d.WriteAsync(context.Background(), bytes.Repeat([]byte{0xab}, 4096), 0, false, func(err error) { wrote <- err })
	testutil.WaitFor(t, 5*time.Second, "the write held at the device", func() bool { return f.waiting.Load() > 0 })
	rs := e.server()
	var es *ExportSession
	for _, x := range rs.Exports() {
		for i := range x.Sessions {
			if x.Sessions[i].Session == "writer" {
				es = &x.Sessions[i]
			}
		}
	}
	if es == nil {
		t.Fatal("the writer's session is not among the exports")
	}
	if err := rs.ForceClose(*es); err != nil {
		t.Fatal(err)
	}
	other := e.client(t, 5*time.Second)
	// In a goroutine: an open that went on to the device would wait behind the held write.
	opened := make(chan error, 1)
	go func() {
		_, err := e.mapDev(t, other, "other", name, AccessRW)
		opened <- err
	}()
	select {
	case err := <-opened:
		if !errors.Is(err, syscall.EPERM) {
			f.open()
			t.Fatalf("an rw open while the closed session's write is at the device: %v, want EPERM", err)
		}
	case <-time.After(5 * time.Second):
		f.open()
		<-opened
		t.Fatal("an rw open while the closed session's write is at the device went on to the device")
	}
	f.open()
	select {
	case <-wrote:
	case <-time.After(10 * time.Second):
		t.Fatal("the held write never ended")
	}
	testutil.WaitFor(t, 5*time.Second, "an rw open once the write has ended", func() bool {
		_, err := e.mapDev(t, other, "other", name, AccessRW)
		return err == nil
	})
}

// TestDirectLoopsBounded: past maxLoops devices open with direct IO (a goroutine, an AIO
// context and two descriptors each), an open goes through the page cache; a close gives its loop back.
func TestDirectLoopsBounded(t *testing.T) {
	leakcheck.Check(t)
	old := maxLoops
	maxLoops = 1
	t.Cleanup(func() { maxLoops = old })
	name, _, model := loopExport(t)
	e := &testEnv{prov: soft.New(soft.Options{}), dir: "/dev"}
	e.start(t, 0)
	t.Cleanup(e.stop)
	direct := func(sess string) bool { return directOf(t, e, sess) != nil }
	loops := func() int { rs := e.server(); rs.mu.Lock(); defer rs.mu.Unlock(); return rs.loops }
	ctx := context.Background()
	a := mustMap(t, e, e.client(t, 5*time.Second), "a", name, AccessRO)
	b := mustMap(t, e, e.client(t, 5*time.Second), "b", name, AccessRO)
	if !direct("a") || direct("b") || loops() != 1 {
		t.Fatalf("direct IO: a %v, b %v, %d loops; want a only, 1 loop", direct("a"), direct("b"), loops())
	}
	for _, d := range []*Device{a, b} {
		got := make([]byte, 64<<10)
		if _, err := d.ReadAt(got, 1<<20); err != nil || !bytes.Equal(got, model[1<<20:1<<20+len(got)]) {
			t.Fatalf("read: %v", err)
		}
	}
	if err := a.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	if loops() != 0 {
		t.Fatalf("%d loops after the direct device closed, want 0", loops())
	}
	mustMap(t, e, e.client(t, 5*time.Second), "c", name, AccessRO)
	if !direct("c") {
		t.Fatal("an open after the loop came back has no direct IO")
	}
}

// TestIORefusedDuringDrain: while force_close waits for a device's direct IO (its drain), IO
// to the closed id is answered at once (ENOTCONN, as the kernel answers it), not held on the
// transport's goroutine until the drain ends.
func TestIORefusedDuringDrain(t *testing.T) {
	leakcheck.Check(t)
	f, name, e := gatedEnv(t, 20*time.Second)
	d := mustMap(t, e, e.client(t, 5*time.Second), "s", name, AccessRW)
	f.shut()
	defer f.open()
	wrote := make(chan error, 1)
	d.WriteAsync(context.Background(), make([]byte, 4096), 0, false, func(err error) { wrote <- err })
	testutil.WaitFor(t, 5*time.Second, "the write held at the device", func() bool { return f.waiting.Load() > 0 })
	rs := e.server()
	es := rs.Exports()[0].Sessions[0]
	forced := make(chan error, 1)
	go func() { forced <- rs.ForceClose(es) }()
	testutil.WaitFor(t, 5*time.Second, "the device closed, its drain under way", func() bool {
		rs.mu.Lock()
		sd := rs.sessions[es.ts].forced[es.ID]
		rs.mu.Unlock()
		if sd == nil || !sd.mu.TryRLock() {
			return false
		}
		defer sd.mu.RUnlock()
		return sd.closed
	})
	read := make(chan error, 1)
	d.ReadAsync(context.Background(), make([]byte, 4096), 1<<20, func(err error) { read <- err })
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("a read of a force-closed device succeeded")
		}
	case <-forced:
		t.Fatal("force_close returned before the read was answered")
	case <-time.After(10 * time.Second):
		t.Fatal("the read was not answered during the drain")
	}
	f.open()
	if err := <-forced; err != nil {
		t.Fatal(err)
	}
	<-wrote
}

// TestOpenAfterSessionGone: an OPEN still reading its device when its session goes (its
// paths closed, the session's devices closed) is refused when it comes back, instead of
// bringing the session back with a device open that nothing would close.
func TestOpenAfterSessionGone(t *testing.T) {
	leakcheck.Check(t)
	f, name, e := gatedEnv(t, dioDrainTimeout)
	rs := e.server()
	f.shut()
	defer f.open()
	c := e.client(t, 5*time.Second)
	go func() { _, _ = e.mapDev(t, c, "s", name, AccessRW) }()
	testutil.WaitFor(t, 5*time.Second, "the OPEN's probe held at the device", func() bool { return f.waiting.Load() > 0 })
	e.mu.Lock()
	srv := e.srv
	e.mu.Unlock()
	ts := srv.Sessions()[0]
	for _, p := range ts.Paths() {
		p.Disconnect()
	}
	testutil.WaitFor(t, 15*time.Second, "the session's paths gone", func() bool {
		for _, p := range ts.Paths() {
			if p.State() == "connected" {
				return false
			}
		}
		rs.mu.Lock()
		defer rs.mu.Unlock()
		return rs.sessions[ts] == nil
	})
	before := rs.OpenRefused()[syscall.ENOTCONN]
	f.open()
	testutil.WaitFor(t, 10*time.Second, "the OPEN refused", func() bool { return rs.OpenRefused()[syscall.ENOTCONN] > before })
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if ss := rs.sessions[ts]; ss != nil {
		t.Fatalf("the session that went is back, with %d devices", len(ss.devs))
	}
}

// TestDirectIOSubmitRefused: io_submit refusing requests for a while (EAGAIN: no resources,
// or, with RWF_NOWAIT, the device would have made the transport's goroutine wait) or taking
// only some of them loses nothing: every request is answered once, with its data in place,
// and the device keeps direct IO.
func TestDirectIOSubmitRefused(t *testing.T) {
	leakcheck.Check(t)
	name, _, model := loopExport(t)
	var calls, refused, partial atomic.Int32
	var armed atomic.Bool // past the open's probe
	dioSubmit = func(c *aio.Context, cbs []*aio.IOCB) (int, error) {
		if !armed.Load() {
			return c.Submit(cbs)
		}
		switch n := calls.Add(1); {
		case n%3 == 1 && refused.Load() < 30:
			refused.Add(1)
			return 0, fmt.Errorf("io_submit: %w", unix.EAGAIN)
		case n%3 == 2 && len(cbs) > 1:
			partial.Add(1)
			return c.Submit(cbs[:len(cbs)/2])
		}
		return c.Submit(cbs)
	}
	t.Cleanup(func() { dioSubmit = (*aio.Context).Submit })
	var mu sync.Mutex
	answers := map[*transport.SrvRequest][]error{}
	d, err := newDirectIO("/dev/"+name, false, SectorSize, func(r *transport.SrvRequest, err error) {
		mu.Lock()
		answers[r] = append(answers[r], err)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	const n, bs = 2 * dioEntries, 4096
	reqs := make([]transport.SrvRequest, n)
	buf, err := unix.Mmap(-1, 0, n*bs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	for i := range n {
		if !d.submit(&reqs[i], false, false, buf[i*bs:(i+1)*bs], int64(i*bs), true) {
			t.Fatalf("request %d refused", i)
		}
		if i%16 == 0 {
			time.Sleep(time.Millisecond) // spread over several rounds of the reaper
		}
	}
	if err := d.close(); err != nil {
		t.Fatal(err)
	}
	if refused.Load() == 0 {
		t.Fatal("no refusal was made")
	}
	for i := range n {
		if errs := answers[&reqs[i]]; len(errs) != 1 || errs[0] != nil {
			t.Fatalf("request %d answered %v, want once without error", i, errs)
		}
	}
	if !bytes.Equal(buf, model[:n*bs]) {
		t.Fatal("the reads do not hold the device's data")
	}
	t.Logf("%d calls, %d refused, %d partly taken", calls.Load(), refused.Load(), partial.Load())
}

// TestDirectIOSubmitFailsWithIOAtDevice: a submission that fails for good answers the
// requests it did not submit with its error and sends later ones to the page cache, while a
// write already at the device is answered when it ends, and the device is let go only then.
func TestDirectIOSubmitFailsWithIOAtDevice(t *testing.T) {
	leakcheck.Check(t)
	withDrain(t, 200*time.Millisecond)
	f, name := gatedLoop(t)
	var broken atomic.Bool
	dioSubmit = func(c *aio.Context, cbs []*aio.IOCB) (int, error) {
		if broken.Load() {
			return 0, fmt.Errorf("io_submit: %w", unix.EBADF)
		}
		return c.Submit(cbs)
	}
	t.Cleanup(func() { dioSubmit = (*aio.Context).Submit })
	var held, next, last transport.SrvRequest
	answers := make(chan *transport.SrvRequest, 2)
	errs := map[*transport.SrvRequest]error{}
	var mu sync.Mutex
	d, err := newDirectIO("/dev/"+name, true, SectorSize, func(r *transport.SrvRequest, err error) {
		mu.Lock()
		errs[r] = err
		mu.Unlock()
		answers <- r
	})
	if err != nil {
		t.Fatal(err)
	}
	buf, err := unix.Mmap(-1, 0, 3*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	f.shut()
	defer f.open()
	if !d.submit(&held, true, false, buf[:4096], 0, true) {
		t.Fatal("write refused")
	}
	testutil.WaitFor(t, 5*time.Second, "the write held at the device", func() bool { return f.waiting.Load() > 0 })
	broken.Store(true)
	if !d.submit(&next, true, false, buf[4096:8192], 4096, true) {
		t.Fatal("second write refused before the submission failed")
	}
	if r := <-answers; r != &next || !errors.Is(errs[r], unix.EBADF) {
		t.Fatalf("the write the kernel never took: answered %v (held: %v), want EBADF", errs[r], r == &held)
	}
	if d.submit(&last, true, false, buf[8192:], 8192, true) {
		t.Fatal("a write taken for direct IO after a submission failed for good")
	}
	if err := d.close(); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("close with a write at the device: %v, want EBUSY", err)
	}
	select {
	case <-d.ended:
		t.Fatal("the device was let go with a write at it")
	default:
	}
	f.open()
	select {
	case r := <-answers:
		if r != &held || errs[r] != nil {
			t.Fatalf("the held write answered %v", errs[r])
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the held write was not answered once the device answered")
	}
	select {
	case <-d.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the device was not let go once its write ended")
	}
	if err := d.release(); err != nil {
		t.Fatal(err)
	}
}

// TestDirectIOReapFails: a reaper that cannot wait for completions any more, with a write
// at the device, never lets the device go: the write may still reach the device and its
// chunk, so the access mode keeps counting and the descriptors stay open.
func TestDirectIOReapFails(t *testing.T) {
	leakcheck.Check(t)
	withDrain(t, 200*time.Millisecond)
	f, name := gatedLoop(t)
	var broken atomic.Bool
	var once sync.Once
	failed := make(chan struct{}) // the reaper's last call: its read of dioReady came before
	dioReady = func(c *aio.Context, ev []aio.Event) (int, error) {
		if broken.Load() {
			once.Do(func() { close(failed) })
			return 0, fmt.Errorf("io_getevents: %w", unix.EBADF)
		}
		return c.Ready(ev)
	}
	t.Cleanup(func() { dioReady = (*aio.Context).Ready })
	d, err := newDirectIO("/dev/"+name, true, SectorSize, func(*transport.SrvRequest, error) {})
	if err != nil {
		t.Fatal(err)
	}
	var held transport.SrvRequest
	holdWrite(t, f, d, &held)
	broken.Store(true)
	d.wake() // the reaper's next look fails
	<-failed
	if err := d.close(); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("close with a write at the device: %v, want EBUSY", err)
	}
	f.open()
	testutil.WaitFor(t, 5*time.Second, "the held write at the file", func() bool { return f.waiting.Load() == 0 })
	select {
	case <-d.ended:
		t.Fatal("the device was let go")
	default:
	}
	// What a restart would do: the descriptors go, so the test's loop device and FUSE
	// mount can.
	_ = d.release()
}

// TestDirectIOPreflushWrite: a WRITE with PREFLUSH reaches direct IO from the goroutine that
// ran its flush, not the transport's in a burst, and is submitted from there at once (it was
// left for a burst end that would never come, and waited for the reaper's next round); the
// data is on the device.
func TestDirectIOPreflushWrite(t *testing.T) {
	leakcheck.Check(t)
	old := dioWaitSlice
	dioWaitSlice = 15 * time.Second // longer than a request is given below
	t.Cleanup(func() { dioWaitSlice = old })
	name, file, _ := loopExport(t)
	e := &testEnv{prov: soft.New(soft.Options{}), dir: "/dev"}
	e.start(t, 0)
	t.Cleanup(e.stop)
	c := e.client(t, 5*time.Second)
	d := mustMap(t, e, c, "pf", name, AccessRW)
	s := c.Session("pf")
	want := make([]byte, 6*4096)
	for i := range 6 {
		block := bytes.Repeat([]byte{byte(0x40 + i)}, 4096)
		copy(want[i*4096:], block)
		usr := make([]byte, IOSize)
		MsgIO{DeviceID: d.ID(), Sector: uint64(i * 8), RW: uint32(OpWrite) | FlagSync | FlagPreflush, BiSize: 4096}.Put(usr)
		done := make(chan error, 1)
		go func() { done <- s.Do(context.Background(), transport.Write, usr, block) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("WRITE with PREFLUSH %d: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			<-done // the reaper's round submits it: the test's cleanup then finds nothing held
			t.Fatalf("WRITE with PREFLUSH %d waited for the reaper's round", i)
		}
	}
	got := make([]byte, len(want))
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the writes are not in the device's file")
	}
}

// withLongWait makes the reaper's wait for its bell longer than the tests below give
// anything, so that a wake-up it sleeps through fails them instead of passing a second late.
func withLongWait(t *testing.T) {
	old := dioWaitSlice
	dioWaitSlice = 15 * time.Second
	t.Cleanup(func() { dioWaitSlice = old })
}

// TestDirectIOShortReadGoesAgainAtOnce: a read that reaches past the device's end comes back
// short; its rest is submitted again in the same round of the reaper (it waited for the
// reaper's next wait to run out, the completion's bell read already), and is answered EIO.
func TestDirectIOShortReadGoesAgainAtOnce(t *testing.T) {
	leakcheck.Check(t)
	withLongWait(t)
	name, _, _ := loopExport(t)
	done := make(chan error, 1)
	d, err := newDirectIO("/dev/"+name, false, SectorSize, func(_ *transport.SrvRequest, err error) { done <- err })
	if err != nil {
		t.Fatal(err)
	}
	defer d.close()
	buf, err := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	time.Sleep(100 * time.Millisecond) // the reaper at its bell
	var r transport.SrvRequest
	if !d.submit(&r, false, false, buf, loopSize-4096, false) { // its second half beyond the end
		t.Fatal("read refused")
	}
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("answered %v, want EIO", err)
		}
	case <-time.After(dioWaitSlice * 2 / 3):
		t.Fatal("the short read's rest waited for the reaper's wait to run out")
	}
}

// TestDirectIOCloseEndsWithLastIO: a close waiting for a write held at the device returns
// once that write ends, not when the reaper's wait runs out.
func TestDirectIOCloseEndsWithLastIO(t *testing.T) {
	leakcheck.Check(t)
	withLongWait(t)
	f, name := gatedLoop(t)
	d, err := newDirectIO("/dev/"+name, true, SectorSize, func(*transport.SrvRequest, error) {})
	if err != nil {
		t.Fatal(err)
	}
	var r transport.SrvRequest
	holdWrite(t, f, d, &r)
	closed := make(chan error, 1)
	go func() { closed <- d.close() }()
	time.Sleep(100 * time.Millisecond) // the reaper back at its bell
	f.open()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(dioWaitSlice * 2 / 3):
		t.Fatal("the close waited for the reaper's wait to run out")
	}
}

// TestDirectIONowaitRefusalGoesAgainAtOnce: a read submitted with RWF_NOWAIT that comes back
// EAGAIN (the device had no request free) is submitted again, blocking, in the same round of
// the reaper that took the refusal, not when its wait runs out, and is answered with the
// device's data.
func TestDirectIONowaitRefusalGoesAgainAtOnce(t *testing.T) {
	leakcheck.Check(t)
	withLongWait(t)
	name, _, model := loopExport(t)
	var refused atomic.Int32
	var armed atomic.Bool // past the open's probe
	dioReady = func(c *aio.Context, ev []aio.Event) (int, error) {
		n, err := c.Ready(ev)
		if n > 0 && armed.Load() && refused.Load() == 0 {
			refused.Add(1)
			ev[0].Res = -int64(unix.EAGAIN) // as the block layer answers a nowait bio it would wait for
		}
		return n, err
	}
	t.Cleanup(func() { dioReady = (*aio.Context).Ready })
	done := make(chan error, 1)
	d, err := newDirectIO("/dev/"+name, false, SectorSize, func(_ *transport.SrvRequest, err error) { done <- err })
	if err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	defer d.close()
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	time.Sleep(100 * time.Millisecond) // the reaper at its bell
	var r transport.SrvRequest
	if !d.submit(&r, false, false, buf, 8192, true) { // a burst of one, with RWF_NOWAIT
		t.Fatal("read refused")
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(dioWaitSlice * 2 / 3):
		t.Fatal("the refused read waited for the reaper's wait to run out")
	}
	if refused.Load() != 1 {
		t.Fatal("no refusal was made")
	}
	if !bytes.Equal(buf, model[8192:8192+4096]) {
		t.Fatal("the read does not hold the device's data")
	}
}

// holdWrite submits a 4 KiB write at 0 to d, over f's loop device, with f shut, and waits
// until the write is held at the device; f opens again at the test's end at the latest.
func holdWrite(t *testing.T, f *gatedFile, d *directIO, r *transport.SrvRequest) {
	t.Helper()
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(buf) })
	f.shut()
	t.Cleanup(f.open) // before the buffer goes
	if !d.submit(r, true, false, buf, 0, true) {
		t.Fatal("write refused")
	}
	testutil.WaitFor(t, 5*time.Second, "the write held at the device", func() bool { return f.waiting.Load() > 0 })
}
