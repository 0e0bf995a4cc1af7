package nbd

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// blockDev is a memDev of 4 KiB blocks that refuses anything but whole blocks, as an RNBD
// device does, and counts what it is asked.
type blockDev struct {
	*memDev
	mu            sync.Mutex
	reads, writes int
	slow          atomic.Bool // reads take 200 µs
}

func (d *blockDev) BlockSize() int { return 4096 }

func (d *blockDev) whole(off, n int64) error {
	if off%4096 != 0 || n%4096 != 0 {
		return fmt.Errorf("%d bytes at %d: %w", n, off, syscall.EINVAL)
	}
	return nil
}

func (d *blockDev) ReadAtContext(ctx context.Context, p []byte, off int64) error {
	if err := d.whole(off, int64(len(p))); err != nil {
		return err
	}
	d.mu.Lock()
	d.reads++
	d.mu.Unlock()
	if d.slow.Load() {
		time.Sleep(200 * time.Microsecond)
	}
	return d.memDev.ReadAtContext(ctx, p, off)
}

func (d *blockDev) WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error {
	if err := d.whole(off, int64(len(p))); err != nil {
		return err
	}
	d.mu.Lock()
	d.writes++
	d.mu.Unlock()
	return d.memDev.WriteAtContext(ctx, p, off, fua)
}

func (d *blockDev) Discard(ctx context.Context, off, n int64) error {
	if err := d.whole(off, n); err != nil {
		return err
	}
	return d.memDev.Discard(ctx, off, n)
}

func (d *blockDev) WriteZeroes(ctx context.Context, off, n int64, noUnmap bool) error {
	if err := d.whole(off, n); err != nil {
		return err
	}
	return d.memDev.WriteZeroes(ctx, off, n, noUnmap)
}

// goNoSizes selects name with GO asking for no block size: the spec's minimum of 1 applies.
func goNoSizes(t *testing.T, sock, name string) *client {
	t.Helper()
	c := hello(t, sock)
	sendOpt(t, c, optGo, goData(name))
	for {
		if _, typ, data := readOptReply(t, c); typ == repAck {
			return &client{t: t, c: c}
		} else if typ != repInfo {
			t.Fatalf("GO: reply %#x %q", typ, data)
		}
	}
}

// TestUnalignedWithoutBlockSizes: a client that agreed to no block size (GO without
// NBD_INFO_BLOCK_SIZE, as nbd-client 3.24 sends it, or EXPORT_NAME) may read and write any
// byte range: reads read the blocks they touch, writes and write-zeroes read-modify-write
// their partial blocks (whole blocks between zeroed by the device), a TRIM discards the whole
// blocks inside it. Concurrent partial writes into the same blocks from two connections,
// beside whole-block ones, lose nothing. A client that agreed to the block size still gets
// EINVAL for a partial block (TestCommands).
func TestUnalignedWithoutBlockSizes(t *testing.T) {
	leakcheck.Check(t)
	const size = 1 << 20
	dev := &blockDev{memDev: &memDev{b: make([]byte, size)}}
	model := make([]byte, size)
	for i := range dev.b {
		dev.b[i] = byte(i * 13)
	}
	copy(model, dev.b)
	sock := startServer(t, Export{Name: "d", Dev: dev})
	cl := goNoSizes(t, sock, "d")
	check := func(what string) {
		t.Helper()
		dev.memDev.mu.Lock()
		defer dev.memDev.mu.Unlock()
		if i := firstDiff(dev.b, model); i >= 0 {
			t.Fatalf("%s: the device differs from the model at %d (%#x, want %#x)", what, i, dev.b[i], model[i])
		}
	}

	cl.send(Request{Type: CmdRead, Cookie: 1, Offset: 4090, Length: 20}, nil)
	if _, e, data := cl.recv(20); e != 0 || !bytes.Equal(data, model[4090:4110]) {
		t.Fatalf("read across a block boundary: errno %d", e)
	}
	for i, w := range []struct{ off, n int }{{4095, 2}, {100, 50}, {8192, 4096}, {12000, 3 * 4096}} {
		p := bytes.Repeat([]byte{byte(0xa0 + i)}, w.n)
		cl.send(Request{Type: CmdWrite, Cookie: 10 + uint64(i), Offset: uint64(w.off), Length: uint32(w.n)}, p)
		if _, e, _ := cl.recv(0); e != 0 {
			t.Fatalf("write of %d at %d: errno %d", w.n, w.off, e)
		}
		copy(model[w.off:], p)
		check(fmt.Sprintf("write of %d at %d", w.n, w.off))
	}
	dev.memDev.mu.Lock()
	zeroes0 := dev.zeroes
	dev.memDev.mu.Unlock()
	for i, z := range []struct{ off, n int }{{70000, 3 * 4096}, {200000, 10}, {300000 - 5, 10}} {
		cl.send(Request{Type: CmdWriteZeroes, Cookie: 20 + uint64(i), Offset: uint64(z.off), Length: uint32(z.n)}, nil)
		if _, e, _ := cl.recv(0); e != 0 {
			t.Fatalf("write-zeroes of %d at %d: errno %d", z.n, z.off, e)
		}
		clear(model[z.off : z.off+z.n])
		check(fmt.Sprintf("write-zeroes of %d at %d", z.n, z.off))
	}
	dev.memDev.mu.Lock()
	if dev.zeroes != zeroes0+1 {
		t.Errorf("%d write-zeroes reached the device, want 1 (the whole blocks of the first range)", dev.zeroes-zeroes0)
	}
	dev.memDev.mu.Unlock()
	cl.send(Request{Type: CmdTrim, Cookie: 30, Offset: 409600 + 1, Length: 3 * 4096}, nil)
	if _, e, _ := cl.recv(0); e != 0 {
		t.Fatalf("trim: errno %d", e)
	}
	clear(model[409600+4096 : 409600+3*4096])
	check("a trim of whole blocks inside its range")

	// Two connections, each with 32 writes in flight: partial writes into the same blocks
	// (each connection owns alternate 512-byte sectors of the first 64 KiB, and no batch
	// writes a sector twice) and whole-block writes beside. Reads take a while, so that
	// read-modify-writes of one block overlap unless the lock keeps them apart.
	dev.slow.Store(true)
	c2 := goNoSizes(t, sock, "d")
	r := rand.New(rand.NewPCG(7, 9))
	for round := range 8 {
		var wg sync.WaitGroup
		var mu sync.Mutex
		for k, c := range []*client{cl, c2} {
			batch := map[uint64][]byte{}
			for i, sec := range r.Perm(64)[:32] {
				off, n := (sec*2+k)*512, 512
				if i%5 == 0 {
					off, n = 65536+k*32768+(i/5)*4096, 4096 // whole blocks, apart
				}
				batch[uint64(off)] = bytes.Repeat([]byte{byte(r.Uint32())}, n)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				for off, p := range batch {
					c.send(Request{Type: CmdWrite, Cookie: off, Offset: off, Length: uint32(len(p))}, p)
				}
				for range batch {
					ck, e, _ := c.recv(0)
					if e != 0 {
						t.Errorf("connection %d round %d write at %d: errno %d", k, round, ck, e)
						return
					}
					mu.Lock()
					copy(model[ck:], batch[ck])
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		check(fmt.Sprintf("round %d of concurrent partial writes into shared blocks", round))
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// asyncBlockDev is a blockDev that is also an AsyncDevice, as rnbd.Device is: a partial block
// must not reach its asynchronous path either.
type asyncBlockDev struct{ *blockDev }

func (d asyncBlockDev) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	go func() { done(d.ReadAtContext(ctx, p, off)) }()
}

func (d asyncBlockDev) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	go func() { done(d.WriteAtContext(ctx, p, off, fua)) }()
}

// TestUnalignedAsyncDevice: partial-block READs and WRITEs of a client that agreed to no block
// size are served on a device with an asynchronous path too (they went to it and got EINVAL).
func TestUnalignedAsyncDevice(t *testing.T) {
	leakcheck.Check(t)
	dev := asyncBlockDev{&blockDev{memDev: &memDev{b: make([]byte, 1<<20)}}}
	for i := range dev.b {
		dev.b[i] = byte(i * 13)
	}
	want := bytes.Clone(dev.b[4090:4110])
	sock := startServer(t, Export{Name: "d", Dev: dev})
	cl := goNoSizes(t, sock, "d")
	cl.send(Request{Type: CmdRead, Cookie: 1, Offset: 4090, Length: 20}, nil)
	if _, e, data := cl.recv(20); e != 0 || !bytes.Equal(data, want) {
		t.Fatalf("partial read on an async device: errno %d", e)
	}
	cl.send(Request{Type: CmdWrite, Cookie: 2, Offset: 100, Length: 10}, make([]byte, 10))
	if _, e, _ := cl.recv(0); e != 0 {
		t.Fatalf("partial write on an async device: errno %d", e)
	}
}

// holdDev4k is holdDev (IO held until the last Unplug, as the transport holds posts) of 4 KiB
// blocks.
type holdDev4k struct{ *holdDev }

func (holdDev4k) BlockSize() int { return 4096 }

// TestPartialWritesWhilePlugged: bursts mixing whole-block writes (the export's lock shared,
// their IO held by the plug) and partial ones (the lock alone, waiting for those) from one
// connection, and from a second that agreed to the block size: the transmit loop must let
// the plug go before it waits for the lock. It waited with the plug held, and every IO of
// the session stopped.
func TestPartialWritesWhilePlugged(t *testing.T) {
	leakcheck.Check(t)
	dev := holdDev4k{&holdDev{memDev: &memDev{b: make([]byte, 1<<20)}}}
	sock := startServer(t, Export{Name: "d", Dev: dev})
	loose, agreed := goNoSizes(t, sock, "d"), dial(t, sock, "d")
	const rounds = 100
	write := func(c *client, reqs [][2]uint64) {
		var buf []byte
		for _, r := range reqs {
			h := make([]byte, requestSize)
			Request{Type: CmdWrite, Offset: r[0], Length: uint32(r[1])}.Put(h)
			buf = append(append(buf, h...), make([]byte, r[1])...)
		}
		if _, err := c.c.Write(buf); err != nil {
			t.Error(err)
		}
	}
	replies := func(c *client, n int, done chan<- error) {
		var h [replySize]byte
		for range n {
			if _, err := io.ReadFull(c.c, h[:]); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}
	done := make(chan error, 2)
	go replies(loose, rounds*12, done)
	go replies(agreed, rounds*16, done)
	go func() {
		for range rounds {
			burst := [][2]uint64{{0, 4096}, {8192 + 512, 512}}
			for i := range 10 {
				burst = append(burst, [2]uint64{16384 + uint64(i)*4096, 4096})
			}
			write(loose, burst)
		}
	}()
	go func() {
		for range rounds {
			var burst [][2]uint64
			for i := range 16 {
				burst = append(burst, [2]uint64{uint64(i) * 4096, 4096})
			}
			write(agreed, burst)
		}
	}()
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(20 * time.Second):
			loose.c.Close()
			agreed.c.Close()
			t.Fatal("no replies for 20 s: a transmit loop waits for the export's lock with its plug held")
		}
	}
}
