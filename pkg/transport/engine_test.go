package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

// memDisk is a server handler over memory: the user header is the 8-byte offset.
type memDisk struct {
	mu     sync.Mutex
	disk   []byte
	async  bool
	delay  time.Duration // async answers wait this long
	events chan LinkEvent
	reqs   map[string]int // requests per path name
}

func newMemDisk(size int) *memDisk {
	return &memDisk{disk: make([]byte, size), events: make(chan LinkEvent, 64), reqs: map[string]int{}}
}

func (d *memDisk) Request(r *SrvRequest) {
	// WRITE data is taken out of the chunk here, on the receiving goroutine: after a
	// failover the client may resend the same request into the same chunk through another
	// path while this one is still being served (see SrvRequest).
	data := r.Data
	if d.async && r.Dir == Write {
		data = append([]byte(nil), r.Data...)
	}
	if len(r.Usr) != 8 {
		r.Respond(-22)
		return
	}
	off := int(binary.LittleEndian.Uint64(r.Usr))
	serve := func() {
		d.mu.Lock()
		d.reqs[r.Path().Name()]++
		if off < 0 || off+len(r.Data) > len(d.disk) {
			d.mu.Unlock()
			r.Respond(-5)
			return
		}
		if r.Dir == Write {
			copy(d.disk[off:], data)
		} else {
			copy(r.Data, d.disk[off:])
		}
		d.mu.Unlock()
		r.Respond(0)
	}
	if d.async {
		go func() {
			time.Sleep(d.delay)
			serve()
		}()
	} else {
		serve()
	}
}

func (d *memDisk) LinkEvent(_ *SrvSess, ev LinkEvent) { d.events <- ev }

// The provider and the two local addresses the engine tests run on: soft over loopback, or
// what RTRS_TEST_PROVIDER, RTRS_TEST_ADDR1 and RTRS_TEST_ADDR2 name (the VM suite runs
// them over verbs on rxe: scripts/vmtest.sh verbs).
func testProvider(t testing.TB) rdma.Provider {
	t.Helper()
	name := os.Getenv("RTRS_TEST_PROVIDER")
	if name == "" {
		return soft.New(soft.Options{})
	}
	p, _, err := pick.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func testAddr(n int) string {
	if a := os.Getenv(fmt.Sprintf("RTRS_TEST_ADDR%d", n)); a != "" {
		return a
	}
	return fmt.Sprintf("127.0.0.%d", n)
}

// path1 and path2 are two paths from the two addresses to the server on the first.
func path1() string { return fmt.Sprintf("ip:%s@ip:%s", testAddr(1), testAddr(1)) }
func path2() string { return fmt.Sprintf("ip:%s@ip:%s", testAddr(2), testAddr(1)) }

type env struct {
	prov rdma.Provider
	srv  *Server
	disk *memDisk
	port uint16
}

func newEnv(t testing.TB, alwaysInv bool, qd int) *env {
	t.Helper()
	return newLimitedEnv(t, func(o *ServerOptions) { o.AlwaysInvalidate, o.QueueDepth = alwaysInv, qd })
}

func paths(t testing.TB, spec ...string) []PathAddrs {
	var out []PathAddrs
	for _, s := range spec {
		src, dst, err := ParsePathAddrs(s)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, PathAddrs{Src: src, Dst: dst})
	}
	return out
}

func (e *env) open(t testing.TB, name string, ps []PathAddrs, mod func(*ClientOptions)) *Session {
	t.Helper()
	o := ClientOptions{Provider: e.prov, SessName: name, Paths: ps, Port: e.port, ConPerPath: 3,
		Policy: MinInflight, MaxReconnectAttempts: -1, Timings: Timings(testutil.FastTimings())}
	if mod != nil {
		mod(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := Open(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func offHdr(off int) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, uint64(off))
	return b
}

// randomIO runs n random reads and writes with up to depth in flight and checks every read
// against a model of the disk.
func randomIO(t testing.TB, s *Session, model []byte, n, depth int, seed uint64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed))
	const block = 4096
	blocks := len(model) / block
	var mu sync.Mutex
	busy := map[int]bool{} // blocks with a request in flight
	errs := make(chan error, n)
	sem := make(chan struct{}, depth)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := 0; i < n; i++ {
		nb := 1 + rng.IntN(16)
		b := rng.IntN(blocks - nb)
		mu.Lock()
		clash := false
		for k := b; k < b+nb; k++ {
			clash = clash || busy[k]
		}
		if clash {
			mu.Unlock()
			continue
		}
		for k := b; k < b+nb; k++ {
			busy[k] = true
		}
		mu.Unlock()
		off, size := b*block, nb*block
		buf := make([]byte, size)
		write := rng.IntN(2) == 0
		if write {
			for j := range buf {
				buf[j] = byte(rng.Uint32())
			}
		}
		sem <- struct{}{}
		wg.Add(1)
		dir := Read
		if write {
			dir = Write
		}
		err := s.Request(ctx, dir, offHdr(off), buf, func(err error) {
			defer wg.Done()
			defer func() { <-sem }()
			mu.Lock()
			defer mu.Unlock()
			for k := b; k < b+nb; k++ {
				delete(busy, k)
			}
			if err != nil {
				errs <- fmt.Errorf("%v at %d: %w", dir, off, err)
				return
			}
			if write {
				copy(model[off:], buf)
			} else if !bytes.Equal(buf, model[off:off+size]) {
				errs <- fmt.Errorf("read at %d: data differs from the model", off)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func TestOpenAndRandomIO(t *testing.T) {
	for _, inv := range []bool{true, false} {
		t.Run(fmt.Sprintf("always_invalidate=%v", inv), func(t *testing.T) {
			leakcheck.Check(t)
			e := newEnv(t, inv, 64)
			s := e.open(t, "sess1", paths(t, path1(), path2()), nil)
			if s.QueueDepth() != 64 || s.MaxIOSize() != DefaultChunkSize-MaxHdrSize {
				t.Fatalf("queue depth %d, max io %d", s.QueueDepth(), s.MaxIOSize())
			}
			ps := s.Paths()
			if len(ps) != 2 || ps[0].Name() != path1() || ps[1].Name() != path2() {
				t.Fatalf("paths %v", ps)
			}
			for _, p := range ps {
				if p.State() != StateConnected {
					t.Fatalf("%s is %v", p.Name(), p.State())
				}
			}
			model := make([]byte, len(e.disk.disk))
			randomIO(t, s, model, 3000, 32, 1)
			e.disk.mu.Lock()
			defer e.disk.mu.Unlock()
			if !bytes.Equal(model, e.disk.disk) {
				t.Fatal("server disk differs from the model")
			}
			if len(e.disk.reqs) != 2 {
				t.Fatalf("requests went over %d paths: %v", len(e.disk.reqs), e.disk.reqs)
			}
			ss := e.srv.Sessions()
			if len(ss) != 1 || ss[0].Name() != "sess1" || len(ss[0].Paths()) != 2 {
				t.Fatalf("server sessions %v", ss)
			}
			// Without failover, each side counts every request once, per direction.
			var cr, cw, sr, sw uint64
			for _, p := range s.Paths() {
				cr, cw = cr+p.Stats.ReadCnt.Value(), cw+p.Stats.WriteCnt.Value()
			}
			for _, p := range ss[0].Paths() {
				sr, sw = sr+p.Stats.ReadCnt.Value(), sw+p.Stats.WriteCnt.Value()
			}
			if cr != sr || cw != sw || cr == 0 || cw == 0 {
				t.Fatalf("client counted %d reads %d writes, server %d and %d", cr, cw, sr, sw)
			}
		})
	}
}

// reconnect is a manual reconnect of a path that must end connected. Its attempt can come
// before the server has seen the old connections go, with the tests' 10 ms backoff (the
// kernel's 1 s leaves the server room), and fail with ENOTCONN, as the kernel's write would:
// the path then reconnects on its own after the delay, which is waited for.
func reconnect(t testing.TB, ctx context.Context, p *Path) {
	t.Helper()
	err := p.Reconnect(ctx)
	if errors.Is(err, syscall.ENOTCONN) {
		testutil.WaitFor(t, 10*time.Second, "the path reconnected after a first attempt too early", func() bool { return p.State() == StateConnected })
		return
	}
	if err != nil {
		t.Fatalf("reconnect: %v", err)
	}
}
