package transport

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// TestIOBuffers: on a provider that stages data (verbs), requests whose data begins a region
// of AllocIOBuffers go out from it and land in it, correct, with the stage never touched,
// also over a path that reconnected after the allocation; freed, the memory is the caller's
// no more and requests are staged again. Where nothing is staged (soft) there is nothing to
// allocate. Bad sizes are EINVAL.
func TestIOBuffers(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 64)
	// Round-robin: both paths carry the test's requests, one at a time as they are.
	s := e.open(t, "iobufs", paths(t, path1(), path2()), func(o *ClientOptions) { o.Policy = RoundRobin })
	const stride = 64 << 10
	for _, c := range []struct{ n, stride int }{{0, stride}, {3 * stride / 2, stride}, {2 * s.MaxIOSize() * 2, 2 * s.MaxIOSize()}} {
		if _, _, err := s.AllocIOBuffers(c.n, c.stride); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%d bytes in regions of %d: %v, want EINVAL", c.n, c.stride, err)
		}
	}
	buf, free, err := s.AllocIOBuffers(8*stride, stride)
	if err != nil {
		t.Fatal(err)
	}
	staging := false
	for _, p := range s.Paths() {
		p.mu.Lock()
		staging = staging || p.res.stage != nil
		p.mu.Unlock()
	}
	if !staging {
		if buf != nil || free != nil {
			t.Fatal("IO buffers allocated on a session that stages nothing")
		}
		return
	}
	if buf == nil || len(buf) != 8*stride {
		t.Fatalf("%d bytes of IO buffers, want %d", len(buf), 8*stride)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	model := make([]byte, len(e.disk.disk))
	io := func(round int) {
		t.Helper()
		var before [2]uint64
		for i, p := range s.Paths() {
			before[i] = p.Stats.ReadCnt.Value() + p.Stats.WriteCnt.Value()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		for i := range 8 {
			region := buf[i*stride : (i+1)*stride]
			n := 4096 * (1 + rng.IntN(stride/4096))
			off := 4096 * rng.IntN((len(model)-n)/4096)
			for j := range region[:n] {
				region[j] = byte(rng.Uint32())
			}
			if err := s.Do(ctx, Write, offHdr(off), region[:n]); err != nil {
				t.Fatalf("round %d: write from region %d: %v", round, i, err)
			}
			copy(model[off:], region[:n])
			clear(region)
			if err := s.Do(ctx, Read, offHdr(off), region[:n]); err != nil {
				t.Fatalf("round %d: read into region %d: %v", round, i, err)
			}
			if !bytes.Equal(region[:n], model[off:off+n]) {
				t.Fatalf("round %d: region %d read back other data", round, i)
			}
		}
		for i, p := range s.Paths() {
			if n := p.Stats.ReadCnt.Value() + p.Stats.WriteCnt.Value() - before[i]; n == 0 {
				t.Fatalf("round %d: %s carried none of the requests", round, p.Name())
			}
			p.mu.Lock()
			stage := p.res.stage.Bytes()
			p.mu.Unlock()
			if bytes.ContainsFunc(stage, func(r rune) bool { return r != 0 }) {
				t.Fatalf("round %d: data went through %s's stage", round, p.Name())
			}
		}
	}
	io(1)
	// A reconnect is a new PD: the buffers are registered on it again.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	reconnect(t, ctx, s.Paths()[1])
	io(2)

	free()
	free() // once only
	for _, p := range s.Paths() {
		p.mu.Lock()
		n := len(*p.res.direct.Load())
		p.mu.Unlock()
		if n != 0 {
			t.Fatalf("%s keeps %d regions of freed IO buffers", p.Name(), n)
		}
	}
}

// heldPD registers fake regions whose deregistration is refused while held is set: a
// memory window still bound over them.
type heldPD struct {
	rdma.PD
	held atomic.Bool
}

func (pd *heldPD) RegMR(buf []byte, _ rdma.Access) (rdma.MR, error) { return &heldMR{pd: pd}, nil }

type heldMR struct {
	rdma.MR
	pd *heldPD
}

func (m *heldMR) Dereg() error {
	if m.pd.held.Load() {
		return syscall.EBUSY
	}
	return nil
}

// TestIOBuffersKept: IO buffers freed while a window still holds a region are kept past
// unregisterWait, mapped, and their channel open; they are unmapped once the region
// deregisters: at a later allocation's retry, or when the path's resources go.
func TestIOBuffersKept(t *testing.T) {
	defer func(w time.Duration) { unregisterWait = w }(unregisterWait)
	unregisterWait = 20 * time.Millisecond
	for _, release := range []string{"a later allocation", "the path's close"} {
		pd := &heldPD{}
		res := &pathRes{pd: pd}
		s := &Session{log: log.L, maxIOSize: 1 << 20}
		s.addStaging(nil, res)
		buf, free, err := s.AllocIOBuffers(4<<10, 4<<10)
		if err != nil || buf == nil {
			t.Fatalf("%d bytes: %v", len(buf), err)
		}
		pd.held.Store(true)
		released := free()
		select {
		case <-released:
			t.Fatalf("%s: memory a window holds was given back", release)
		default:
		}
		if !rdma.Allocated(buf) || len(s.kept) != 1 {
			t.Fatalf("%s: the held memory is mapped %v, %d kept; want true, 1", release, rdma.Allocated(buf), len(s.kept))
		}
		pd.held.Store(false)
		if release == "a later allocation" {
			b2, free2, err := s.AllocIOBuffers(4<<10, 4<<10)
			if err != nil {
				t.Fatal(err)
			}
			<-free2()
			if rdma.Allocated(b2) {
				t.Fatal("the second allocation not unmapped")
			}
		} else {
			s.dropStaging(res)
		}
		select {
		case <-released:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the kept memory not given back once its region deregistered", release)
		}
		if rdma.Allocated(buf) || len(s.kept) != 0 {
			t.Fatalf("%s: the kept memory mapped %v, %d kept; want false, 0", release, rdma.Allocated(buf), len(s.kept))
		}
	}
}
