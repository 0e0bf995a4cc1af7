package rnbd

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestAsyncNoPermitWait: with every permit of the session taken by requests the server holds,
// ReadAsync returns at once (a ublk queue's thread must not wait in it); the requests it
// queued wait, those whose context ends meanwhile fail with its error before the server
// answers anything, also behind a request that goes on waiting, and the rest complete with
// the right data once the server answers.
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

	h := holdIO(t, e)

	type result struct {
		i   int
		err error
	}
	const extra = 8 // beyond the permits: cancelled while they wait, behind two kept ones and before six
	results := make(chan result, depth+2*extra)
	bufs := make([][]byte, depth+2*extra)
	cancelCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	within(t, 10*time.Second, "ReadAsync with no permit free", func() {
		for i := range bufs {
			ctx := context.Background()
			if i >= depth+2 && i < depth+2+extra {
				ctx = cancelCtx
			}
			bufs[i] = make([]byte, 4096)
			d.ReadAsync(ctx, bufs[i], int64(i)*4096, func(err error) { results <- result{i, err} })
		}
	})
	testutil.WaitFor(t, 10*time.Second, "every permit held by the server", func() bool { return h.count() == depth })

	cancel()
	for range extra {
		select {
		case r := <-results:
			if r.i < depth+2 || r.i >= depth+2+extra || !errors.Is(r.err, context.Canceled) {
				t.Fatalf("request %d ended with %v while the server held every permit; want the %d queued with a cancelled context to fail with it", r.i, r.err, extra)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("queued requests whose context ended are still waiting for a permit")
		}
	}
	if n := h.count(); n != depth {
		t.Fatalf("the server saw %d requests, with %d permits", n, depth)
	}

	h.release()
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

// TestUnmapFailsBacklog: an unmap fails the requests waiting for a permit (ENODEV) rather
// than leave them to go out after its CLOSE, with an id the server may give to another
// device; the server sees no IO after the CLOSE.
func TestUnmapFailsBacklog(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "bl", "disk", AccessRW)
	depth := c.Session("bl").QueueDepth()

	h := holdIO(t, e)

	const extra = 4
	results := make(chan error, depth+extra)
	within(t, 10*time.Second, "WriteAsync with no permit free", func() {
		for i := range depth + extra {
			d.WriteAsync(context.Background(), make([]byte, 4096), int64(i)*4096, false, func(err error) { results <- err })
		}
	})
	testutil.WaitFor(t, 10*time.Second, "every permit held by the server", func() bool { return h.count() == depth })
	unmapped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		unmapped <- d.Unmap(ctx)
	}()
	for range extra {
		select {
		case err := <-results:
			if !errors.Is(err, syscall.ENODEV) {
				t.Fatalf("a request waiting for a permit ended with %v on unmap; want ENODEV", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("requests waiting for a permit still wait after the unmap began")
		}
	}
	h.release()
	// Those the server held end either way: answered before the CLOSE, or after it (the
	// unmap does not wait for IO in flight; its front ends have drained by then).
	for range depth {
		if err := <-results; err != nil && !errors.Is(err, syscall.ENODEV) {
			t.Fatalf("a request the server held: %v", err)
		}
	}
	if err := <-unmapped; err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	i := slices.Index(h.seen, MsgTypeClose)
	if i < 0 || slices.Contains(h.seen[i:], MsgTypeIO) {
		t.Fatalf("the server saw %v after it stopped holding: want a CLOSE, and no IO after it", h.seen)
	}
}

// ioHolder holds the IO requests that reach the server until release, and records the
// types of the messages that reach it after.
type ioHolder struct {
	e       *testEnv
	mu      sync.Mutex
	held    []*transport.SrvRequest
	seen    []MsgType
	holding bool
}

func holdIO(t *testing.T, e *testEnv) *ioHolder {
	h := &ioHolder{e: e, holding: true}
	f := h.intercept
	e.intercept.Store(&f)
	t.Cleanup(func() { e.intercept.Store(nil) })
	return h
}

func (h *ioHolder) intercept(r *transport.SrvRequest) bool {
	typ, _ := PeekType(r.Usr)
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.holding {
		h.seen = append(h.seen, typ)
		return false
	}
	if typ != MsgTypeIO {
		return false
	}
	h.held = append(h.held, r)
	return true
}

func (h *ioHolder) count() int { h.mu.Lock(); defer h.mu.Unlock(); return len(h.held) }

// release hands what was held to the server, and holds nothing more.
func (h *ioHolder) release() {
	h.mu.Lock()
	h.holding = false
	reqs := h.held
	h.mu.Unlock()
	for _, r := range reqs {
		h.e.server().Request(r)
	}
}
