package fsview

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/aio"
	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// gateBlock is a memBlock whose reads wait, up to a bound, until want of them are in
// progress at once, and which records the most it saw.
type gateBlock struct {
	memBlock
	want int
	gmu  sync.Mutex
	cur  int
	most int
	all  chan struct{} // closed once want reads were in progress together
}

func (g *gateBlock) ReadAtContext(ctx context.Context, p []byte, off int64) error {
	g.gmu.Lock()
	g.cur++
	if g.cur > g.most {
		g.most = g.cur
	}
	if g.cur == g.want {
		close(g.all)
	}
	g.gmu.Unlock()
	select {
	case <-g.all:
	case <-time.After(5 * time.Second):
	}
	g.gmu.Lock()
	g.cur--
	g.gmu.Unlock()
	return g.memBlock.ReadAtContext(ctx, p, off)
}

// TestBlockFileQueueDepth: libaio reads of a device file with O_DIRECT reach the device
// together, as many as were submitted (FUSE_ASYNC_DIO). Without it the kernel ran each in
// the submitting thread, one after another: a job was QD1 whatever its iodepth.
func TestBlockFileQueueDepth(t *testing.T) {
	leakcheck.Check(t)
	const n = 16
	g := &gateBlock{memBlock: memBlock{b: make([]byte, 1<<20)}, want: n, all: make(chan struct{})}
	for i := range g.b {
		g.b[i] = byte(i / 4096)
	}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: g}} }))
	f, err := os.OpenFile(filepath.Join(dir, "dev"), os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := unix.Mmap(-1, 0, n*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Munmap(buf) }()
	ctx, err := aio.New(n)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ctx.Destroy() }()
	cbs := make([]*aio.IOCB, n)
	for i := range cbs {
		cbs[i] = &aio.IOCB{Data: uint64(i), Opcode: aio.CmdPread, Fd: uint32(f.Fd()),
			Buf: uint64(uintptr(unsafe.Pointer(&buf[i*4096]))), Nbytes: 4096, Offset: int64(i) * 8192}
	}
	if k, err := ctx.Submit(cbs); err != nil || k != n {
		t.Fatalf("submitted %d of %d: %v", k, n, err)
	}
	ev := make([]aio.Event, n)
	got := 0
	for deadline := time.Now().Add(60 * time.Second); got < n; {
		k, err := ctx.Ready(ev[got:])
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ev[got : got+k] {
			if e.Res != 4096 {
				t.Fatalf("read %d: %d", e.Data, e.Res)
			}
			if i := int(e.Data); buf[i*4096] != byte(2*i) || buf[i*4096+4095] != byte(2*i) {
				t.Fatalf("read %d: wrong data %d", i, buf[i*4096])
			}
		}
		got += k
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d reads completed", got, n)
		}
		time.Sleep(time.Millisecond)
	}
	g.gmu.Lock()
	most := g.most
	g.gmu.Unlock()
	if most != n {
		t.Fatalf("at most %d of %d submitted reads reached the device together", most, n)
	}
}

// TestBlockFileDsync: writes through a device file opened with O_DSYNC or O_SYNC are FUA
// (durable when they complete, as a block device's O_DSYNC direct writes are), whole blocks
// and partial ones alike; without the flag they are not.
func TestBlockFileDsync(t *testing.T) {
	leakcheck.Check(t)
	b := &orderBlock{memBlock: memBlock{b: make([]byte, 1<<20)}}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: b}} }))
	for _, tc := range []struct {
		name  string
		flags int
		want  string // each write as the device saw it
	}{
		{"plain", os.O_WRONLY, "write"},
		{"O_DSYNC", os.O_WRONLY | unix.O_DSYNC, "write FUA"},
		{"O_SYNC", os.O_WRONLY | unix.O_SYNC, "write FUA"},
		{"O_DSYNC|O_DIRECT", os.O_WRONLY | unix.O_DSYNC | unix.O_DIRECT, "write FUA"},
	} {
		f, err := os.OpenFile(filepath.Join(dir, "dev"), tc.flags, 0)
		if err != nil {
			t.Fatal(err)
		}
		buf, err := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		_, werr := f.WriteAt(buf, 8192)
		if werr == nil && tc.flags&unix.O_DIRECT == 0 {
			_, werr = f.WriteAt([]byte("x"), 100) // a partial block: read, merge, write back
		}
		_ = unix.Munmap(buf)
		_ = f.Close()
		if werr != nil {
			t.Fatalf("%s: %v", tc.name, werr)
		}
		got := b.take()
		if got == "" {
			t.Fatalf("%s: no write reached the device", tc.name)
		}
		for i, op := range strings.Split(got, ", ") {
			if op != tc.want {
				t.Errorf("%s: request %d of %q: %q, want %q", tc.name, i+1, got, op, tc.want)
			}
		}
	}
}

// orderBlock is a memBlock that records its completed writes (with their FUA flag) and its
// flushes, in order; a flush fails while flushErr is set.
type orderBlock struct {
	memBlock
	omu      sync.Mutex
	ops      []string
	flushErr error
	fuaAt    map[int64]bool // each write's FUA flag by its offset, when not nil
}

func (b *orderBlock) WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error {
	err := b.memBlock.WriteAtContext(ctx, p, off, fua)
	b.omu.Lock()
	defer b.omu.Unlock()
	if b.fuaAt != nil {
		b.fuaAt[off] = fua
	}
	if fua {
		b.ops = append(b.ops, "write FUA")
	} else {
		b.ops = append(b.ops, "write")
	}
	return err
}

func (b *orderBlock) Flush(ctx context.Context) error {
	b.omu.Lock()
	defer b.omu.Unlock()
	b.ops = append(b.ops, "flush")
	return b.flushErr
}

func (b *orderBlock) take() string {
	b.omu.Lock()
	defer b.omu.Unlock()
	out := strings.Join(b.ops, ", ")
	b.ops = nil
	return out
}

// TestBlockFileWriteDsyncConcurrent: plain and RWF_DSYNC writes in flight together through one
// device file each go out with their own FUA flag (a durable write's mark is its request's
// alone), with no flush; a 1 MiB RWF_DSYNC write, which the kernel sends as several FUSE
// requests, is FUA in every one of them.
func TestBlockFileWriteDsyncConcurrent(t *testing.T) {
	leakcheck.Check(t)
	const writers, each, bs = 8, 256, 4096
	b := &orderBlock{memBlock: memBlock{b: make([]byte, 12<<20)}, fuaAt: map[int64]bool{}}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: b}} }))
	f, err := os.OpenFile(filepath.Join(dir, "dev"), os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Munmap(buf) }()
	dsync := func(w, i int) bool { return (w+i)%2 == 0 }
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			for i := range each {
				rwf := 0
				if dsync(w, i) {
					rwf = unix.RWF_DSYNC
				}
				if _, err := unix.Pwritev2(int(f.Fd()), [][]byte{buf[:bs]}, int64(w*each+i)*bs, rwf); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	b.omu.Lock()
	wrong := 0
	for w := range writers {
		for i := range each {
			fua, ok := b.fuaAt[int64(w*each+i)*bs]
			if !ok || fua != dsync(w, i) {
				wrong++
			}
		}
	}
	clear(b.fuaAt)
	b.omu.Unlock()
	if wrong != 0 {
		t.Fatalf("%d of %d writes went out without their own FUA flag", wrong, writers*each)
	}
	if got := b.take(); strings.Contains(got, "flush") {
		t.Fatalf("a flush among the writes: %q", got)
	}
	if _, err := unix.Pwritev2(int(f.Fd()), [][]byte{buf}, 10<<20, unix.RWF_DSYNC); err != nil {
		t.Fatal(err)
	}
	got := strings.Split(b.take(), ", ")
	if len(got) < 2 {
		t.Fatalf("a 1 MiB write came as %q: not split into FUSE requests, so this checks nothing", got)
	}
	for _, op := range got {
		if op != "write FUA" {
			t.Fatalf("a 1 MiB RWF_DSYNC write: the device saw %q, want FUA writes only", got)
		}
	}
}

// TestBlockFileWriteDsync: a single write's RWF_DSYNC or RWF_SYNC (pwritev2, or an AIO's)
// through a device file is durable when it returns: written with FUA, as the kernel's block
// device writes a direct dsync write, and not flushed after; so are the writes of a file
// opened with O_DSYNC; a plain write is neither.
func TestBlockFileWriteDsync(t *testing.T) {
	leakcheck.Check(t)
	b := &orderBlock{memBlock: memBlock{b: make([]byte, 1<<20)}}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: b}} }))
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Munmap(buf) }()
	for _, tc := range []struct {
		name     string
		open     int
		rwf      int
		flushErr error
		want     string
		wantErr  error
	}{
		{"plain", os.O_WRONLY, 0, nil, "write", nil},
		{"RWF_DSYNC", os.O_WRONLY, unix.RWF_DSYNC, nil, "write FUA", nil},
		{"RWF_SYNC", os.O_WRONLY, unix.RWF_SYNC, nil, "write FUA", nil},
		{"O_DIRECT, RWF_DSYNC", os.O_WRONLY | unix.O_DIRECT, unix.RWF_DSYNC, nil, "write FUA", nil},
		{"O_DSYNC", os.O_WRONLY | unix.O_DSYNC, 0, nil, "write FUA", nil},
		{"O_DSYNC, RWF_DSYNC", os.O_WRONLY | unix.O_DSYNC, unix.RWF_DSYNC, nil, "write FUA", nil},
		{"plain, a flush would fail", os.O_WRONLY, 0, syscall.EIO, "write", nil},
	} {
		f, err := os.OpenFile(filepath.Join(dir, "dev"), tc.open, 0)
		if err != nil {
			t.Fatal(err)
		}
		b.omu.Lock()
		b.flushErr = tc.flushErr
		b.omu.Unlock()
		_, werr := unix.Pwritev2(int(f.Fd()), [][]byte{buf}, 8192, tc.rwf)
		got := b.take()
		_ = f.Close()
		if !errors.Is(werr, tc.wantErr) {
			t.Errorf("%s: pwritev2: %v, want %v", tc.name, werr, tc.wantErr)
		}
		if got != tc.want {
			t.Errorf("%s: the device saw %q, want %q", tc.name, got, tc.want)
		}
	}
	// Asynchronous direct IO (libaio, FUSE_ASYNC_DIO) takes another path in the kernel.
	b.omu.Lock()
	b.flushErr = nil
	b.omu.Unlock()
	f, err := os.OpenFile(filepath.Join(dir, "dev"), os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, err := aio.New(1)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ctx.Destroy() }()
	cb := &aio.IOCB{Opcode: aio.CmdPwrite, RWFlags: unix.RWF_DSYNC, Fd: uint32(f.Fd()),
		Buf: uint64(uintptr(unsafe.Pointer(&buf[0]))), Nbytes: 4096, Offset: 8192}
	if k, err := ctx.Submit([]*aio.IOCB{cb}); err != nil || k != 1 {
		t.Fatalf("io_submit: %d, %v", k, err)
	}
	var ev [1]aio.Event
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(time.Millisecond) {
		k, err := ctx.Ready(ev[:])
		if err != nil {
			t.Fatal(err)
		}
		if k == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the asynchronous write did not complete")
		}
	}
	if got := b.take(); ev[0].Res != 4096 || got != "write FUA" {
		t.Fatalf("libaio write with RWF_DSYNC: result %d, the device saw %q, want a write with FUA", ev[0].Res, got)
	}
}
