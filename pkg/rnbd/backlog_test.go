package rnbd

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestAsyncNoPermitWait: with every permit of the session taken by requests the server holds,
// ReadAsync returns at once (a ublk queue's thread must not wait in it); the requests it
// queued wait, those whose context ends meanwhile fail with its error before the server
// answers anything, and the rest complete with the right data once the server answers.
func TestAsyncNoPermitWait(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "bl", "disk", AccessRW)
	depth := c.Session("bl").QueueDepth()
	if depth <= 0 || depth*4096 > len(model)/2 {
		t.Fatalf("queue depth %d: the test needs at most %d", depth, len(model)/2/4096)
	}

	var mu sync.Mutex
	var held []*transport.SrvRequest
	holding := true
	hold := func(r *transport.SrvRequest) bool {
		if typ, _ := PeekType(r.Usr); typ != MsgTypeIO {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if holding {
			held = append(held, r)
		}
		return holding
	}
	e.intercept.Store(&hold)
	defer e.intercept.Store(nil)
	nHeld := func() int { mu.Lock(); defer mu.Unlock(); return len(held) }

	type result struct {
		i   int
		err error
	}
	const extra = 8 // beyond the permits: half cancelled while they wait, half kept
	results := make(chan result, depth+2*extra)
	bufs := make([][]byte, depth+2*extra)
	cancelCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	within(t, 10*time.Second, "ReadAsync with no permit free", func() {
		for i := range bufs {
			ctx := context.Background()
			if i >= depth && i < depth+extra {
				ctx = cancelCtx
			}
			bufs[i] = make([]byte, 4096)
			d.ReadAsync(ctx, bufs[i], int64(i)*4096, func(err error) { results <- result{i, err} })
		}
	})
	testutil.WaitFor(t, 10*time.Second, "every permit held by the server", func() bool { return nHeld() == depth })

	cancel()
	for range extra {
		select {
		case r := <-results:
			if r.i < depth || r.i >= depth+extra || !errors.Is(r.err, context.Canceled) {
				t.Fatalf("request %d ended with %v while the server held every permit; want the %d queued with a cancelled context to fail with it", r.i, r.err, extra)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("queued requests whose context ended are still waiting for a permit")
		}
	}
	if n := nHeld(); n != depth {
		t.Fatalf("the server saw %d requests, with %d permits", n, depth)
	}

	mu.Lock()
	holding = false
	reqs := held
	mu.Unlock()
	for _, r := range reqs {
		e.server().Request(r)
	}
	for range depth + extra {
		select {
		case r := <-results:
			if r.err != nil {
				t.Fatalf("request %d: %v", r.i, r.err)
			}
			if off := r.i * 4096; !bytes.Equal(bufs[r.i], model[off:off+4096]) {
				t.Fatalf("request %d read the wrong data", r.i)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("requests still waiting after the server answered")
		}
	}
	select {
	case r := <-results:
		t.Fatalf("request %d completed twice (%v)", r.i, r.err)
	default:
	}
}
