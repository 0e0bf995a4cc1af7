package nbd

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestArenaRuns: first fit over whole slots, a run for a request of several, freed runs
// taken again, nil with no run long enough, foreign buffers refused.
func TestArenaRuns(t *testing.T) {
	const slot = 1000
	a := &arena{buf: make([]byte, 4*slot), slot: slot, used: make([]bool, 4)}
	at := func(b []byte) int {
		return int(uintptr(unsafe.Pointer(unsafe.SliceData(b)))-uintptr(unsafe.Pointer(&a.buf[0]))) / slot
	}
	one := a.get(10)
	two := a.get(slot + 1) // two slots
	if len(one) != 10 || len(two) != slot+1 || at(one) != 0 || at(two) != 1 {
		t.Fatalf("got %d bytes at slot %d and %d at %d; want 10 at 0 and %d at 1", len(one), at(one), len(two), at(two), slot+1)
	}
	if b := a.get(2 * slot); b != nil {
		t.Fatalf("a run of two slots with one free: slot %d", at(b))
	}
	if !a.put(one) {
		t.Fatal("the arena's buffer not taken back")
	}
	if b := a.get(2 * slot); b != nil {
		t.Fatalf("a run of two slots across a used one: slot %d", at(b))
	}
	if b := a.get(slot); b == nil || at(b) != 0 {
		t.Fatal("the freed first slot not taken again")
	}
	if a.put(make([]byte, 10)) || a.put(nil) {
		t.Fatal("a buffer not of the arena taken")
	}
	a.put(two)
	if b := a.get(3 * slot); b == nil || at(b) != 1 {
		t.Fatal("three free slots after the first not given as a run")
	}
}

// bufDev is an asynchronous memDev that hands out device memory (BufferDevice) and
// records, for every read and write, whether its data began a slot of that memory.
type bufDev struct {
	*memDev
	slot int

	mu      sync.Mutex
	arenas  [][]byte
	frees   int
	inArena int // requests whose data began a slot of an arena
	outside int // requests whose data was elsewhere
	misfit  int // in an arena but not at a slot's start
	// keep, when set, is what the arenas' frees return: their memory is given back when
	// the test closes it (a transport that could not deregister it yet).
	keep chan struct{}
	wg   sync.WaitGroup
}

func (d *bufDev) MaxIO() int { return d.slot }

func (d *bufDev) AllocIOBuffers(n, stride int) ([]byte, func() <-chan struct{}, error) {
	if stride != d.slot || n%stride != 0 {
		return nil, nil, fmt.Errorf("asked for %d bytes in regions of %d", n, stride)
	}
	b := make([]byte, n)
	d.mu.Lock()
	d.arenas = append(d.arenas, b)
	released := d.keep
	d.mu.Unlock()
	if released == nil {
		released = make(chan struct{})
		close(released)
	}
	var once sync.Once
	return b, func() <-chan struct{} {
		once.Do(func() {
			d.mu.Lock()
			d.frees++
			d.mu.Unlock()
		})
		return released
	}, nil
}

func (d *bufDev) note(p []byte) {
	a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, ar := range d.arenas {
		s := uintptr(unsafe.Pointer(&ar[0]))
		if a >= s && a < s+uintptr(len(ar)) {
			if (a-s)%uintptr(d.slot) == 0 && int(a-s)+len(p) <= len(ar) {
				d.inArena++
			} else {
				d.misfit++
			}
			return
		}
	}
	d.outside++
}

func (d *bufDev) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.note(p)
	d.wg.Add(1)
	go func() { defer d.wg.Done(); done(d.ReadAtContext(ctx, p, off)) }()
}

func (d *bufDev) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	d.note(p)
	d.wg.Add(1)
	go func() { defer d.wg.Done(); done(d.WriteAtContext(ctx, p, off, fua)) }()
}

func (d *bufDev) counts() (inArena, outside, misfit, arenas, frees int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.inArena, d.outside, d.misfit, len(d.arenas), d.frees
}

// TestBufferDevice: a connection to a device that hands out memory for its transport serves
// reads and writes from it, each request's data beginning a slot (a run of them for a
// request longer than one), with the right data; the memory is taken at the first read or
// write and freed once, after the connection's last request; past MaxArenaMemory a connection serves from the pools, as
// before.
func TestBufferDevice(t *testing.T) {
	leakcheck.Check(t)
	const slot = 64 << 10
	dev := &bufDev{memDev: &memDev{b: make([]byte, 8<<20)}, slot: slot}
	t.Cleanup(dev.wg.Wait)
	// Room for one connection's arena (MaxInflight slots of MaxIO), not two.
	sock, _ := startServerOpts(t, Options{MaxInflight: 16, MaxArenaMemory: 16*slot + slot}, Export{Name: "d", Dev: dev})

	model := make([]byte, len(dev.b))
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range model {
		model[i] = byte(rng.Uint32())
	}
	check := func(cl *client, name string) {
		// Writes of one slot's bytes, of less, and of several slots and a part, in flight
		// together (7 slots of the 16), then the same read back.
		sizes := []int{4096, slot, 3*slot + 8192, 512}
		for round := range 4 {
			for i, n := range sizes {
				off := (round*len(sizes) + i) * 4 * slot
				cl.send(Request{Type: CmdWrite, Cookie: uint64(off), Offset: uint64(off), Length: uint32(n)}, model[off:off+n])
			}
			for range sizes {
				if ck, e, _ := cl.recv(0); e != 0 {
					t.Fatalf("%s: write %d: errno %d", name, ck, e)
				}
			}
		}
		for round := range 4 {
			for i, n := range sizes {
				off := (round*len(sizes) + i) * 4 * slot
				cl.send(Request{Type: CmdRead, Cookie: uint64(off), Offset: uint64(off), Length: uint32(n)}, nil)
				ck, e, data := cl.recv(n)
				if e != 0 || ck != uint64(off) || !bytes.Equal(data, model[off:off+n]) {
					t.Fatalf("%s: read of %d bytes at %d: errno %d, cookie %d, data right %v", name, n, off, e, ck, bytes.Equal(data, model[off:off+n]))
				}
			}
		}
	}

	// A connection that only looks (no read or write) takes none.
	look := dial(t, sock, "d")
	look.send(Request{Type: CmdFlush, Cookie: 1}, nil)
	if _, e, _ := look.recv(0); e != 0 {
		t.Fatalf("flush: errno %d", e)
	}
	look.c.Close()

	first := dial(t, sock, "d")
	check(first, "first connection")
	in, out, misfit, arenas, _ := dev.counts()
	if arenas != 1 || in != 32 || out != 0 || misfit != 0 {
		t.Fatalf("first connection: %d arenas, %d requests in a slot, %d outside, %d inside off a slot's start; want 1, 32, 0, 0", arenas, in, out, misfit)
	}

	second := dial(t, sock, "d") // past the bound: the pools
	check(second, "second connection")
	in2, out2, misfit, arenas, _ := dev.counts()
	if arenas != 1 || in2 != in || out2 != 32 || misfit != 0 {
		t.Fatalf("second connection, past MaxArenaMemory: %d arenas, %d more requests in a slot, %d outside; want 1, 0, 32", arenas, in2-in, out2)
	}

	first.c.Close()
	testutil.WaitFor(t, 10*time.Second, "the first connection's arena freed", func() bool {
		_, _, _, _, frees := dev.counts()
		return frees == 1
	})
	third := dial(t, sock, "d") // its bytes are back within the bound
	check(third, "third connection")
	in3, _, _, arenas, _ := dev.counts()
	if arenas != 2 || in3 != in2+32 {
		t.Fatalf("third connection, after the first's arena was freed: %d arenas, %d requests in a slot; want 2, 32", arenas, in3-in2)
	}
	second.c.Close()
	third.c.Close()
	testutil.WaitFor(t, 10*time.Second, "every arena freed", func() bool {
		_, _, _, _, frees := dev.counts()
		return frees == 2
	})
}

// TestBufferDeviceKept: an arena its device keeps past the free (a region not deregistered
// yet) counts against MaxArenaMemory until it is given back: a connection meanwhile is
// served from the pools; one after, from an arena again.
func TestBufferDeviceKept(t *testing.T) {
	leakcheck.Check(t)
	const slot = 64 << 10
	dev := &bufDev{memDev: &memDev{b: make([]byte, 1<<20)}, slot: slot, keep: make(chan struct{})}
	t.Cleanup(dev.wg.Wait)
	sock, s := startServerOpts(t, Options{MaxInflight: 4, MaxArenaMemory: 4 * slot}, Export{Name: "d", Dev: dev})
	write := func(name string) {
		t.Helper()
		cl := dial(t, sock, "d")
		cl.send(Request{Type: CmdWrite, Cookie: 1, Length: 4096}, make([]byte, 4096))
		if _, e, _ := cl.recv(0); e != 0 {
			t.Fatalf("%s: write: errno %d", name, e)
		}
		cl.c.Close()
	}
	write("first")
	testutil.WaitFor(t, 10*time.Second, "the first connection's arena freed", func() bool {
		_, _, _, _, frees := dev.counts()
		return frees == 1
	})
	if in, out, _, arenas, frees := dev.counts(); arenas != 1 || in != 1 || out != 0 || frees != 1 {
		t.Fatalf("first connection: %d arenas, %d requests in one, %d outside, %d frees; want 1, 1, 0, 1", arenas, in, out, frees)
	}
	write("second") // the first's arena is kept: past the bound
	if in, out, _, arenas, _ := dev.counts(); arenas != 1 || in != 1 || out != 1 {
		t.Fatalf("second connection, the first's arena kept: %d arenas, %d requests in one, %d outside; want 1, 1, 1", arenas, in, out)
	}
	dev.mu.Lock()
	close(dev.keep)
	dev.keep = nil
	dev.mu.Unlock()
	testutil.WaitFor(t, 10*time.Second, "the kept arena uncounted", func() bool { return s.arenaMem.Used() == 0 })
	write("third")
	if in, out, _, arenas, _ := dev.counts(); arenas != 2 || in != 2 || out != 1 {
		t.Fatalf("third connection, the arena given back: %d arenas, %d requests in one, %d outside; want 2, 2, 1", arenas, in, out)
	}
}

// TestBufferDeviceOff: with MaxArenaMemory negative no connection takes device memory.
func TestBufferDeviceOff(t *testing.T) {
	leakcheck.Check(t)
	dev := &bufDev{memDev: &memDev{b: make([]byte, 1<<20)}, slot: 64 << 10}
	t.Cleanup(dev.wg.Wait)
	sock, _ := startServerOpts(t, Options{MaxArenaMemory: -1}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	cl.send(Request{Type: CmdWrite, Cookie: 1, Length: 4096}, make([]byte, 4096))
	if _, e, _ := cl.recv(0); e != 0 {
		t.Fatalf("write: errno %d", e)
	}
	if in, out, _, arenas, _ := dev.counts(); arenas != 0 || in != 0 || out != 1 {
		t.Fatalf("%d arenas taken, %d requests in one, %d outside; want 0, 0, 1", arenas, in, out)
	}
	cl.c.Close()
}
