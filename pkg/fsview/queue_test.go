package fsview

import (
	"context"
	"os"
	"path/filepath"
	"sync"
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
	case <-time.After(2 * time.Second):
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
