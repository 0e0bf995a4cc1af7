package rnbd

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
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

// releaseFirst hands the first request held for device id to the server, and goes on
// holding the rest and what comes.
func (h *ioHolder) releaseFirst(id uint32) {
	h.mu.Lock()
	var r *transport.SrvRequest
	for i, x := range h.held {
		if ioDevice(x) == id {
			r = x
			h.held = slices.Delete(h.held, i, i+1)
			break
		}
	}
	h.mu.Unlock()
	if r != nil {
		h.e.server().Request(r)
	}
}

// lastDevice is the device of the request held last.
func (h *ioHolder) lastDevice() uint32 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return ioDevice(h.held[len(h.held)-1])
}

// ioDevice is the device an IO request names.
func ioDevice(r *transport.SrvRequest) uint32 {
	var m MsgIO
	_ = m.Unmarshal(r.Usr)
	return m.DeviceID
}

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

// TestBacklogsTakeTurns: a device whose callers keep every permit of the session busy (each
// completion submits the next request at once, as a ublk queue does) does not keep another
// device of the session waiting: the other's request, queued when it found no permit, is
// handed the next permit put, and the busy device's next request waits its turn. On the tree
// before, a put freed the permit and woke the other's drainer, and the busy device's next
// request, submitted on the completing goroutine right after the put, took the permit first.
// The server holds every request and answers one at a time, so that which request each
// freed permit carried is seen there.
func TestBacklogsTakeTurns(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "a", 1<<20)
	e.file(t, "b", 1<<20)
	c := e.client(t, 10*time.Second)
	a := mustMap(t, e, c, "bl", "a", AccessRW)
	b := mustMap(t, e, c, "bl", "b", AccessRW)
	depth := c.Session("bl").QueueDepth()
	h := holdIO(t, e)

	// a: depth requests out at all times, each completion submitting the next.
	var (
		stopped atomic.Bool
		running sync.WaitGroup
		aErr    atomic.Pointer[error]
	)
	var next func(buf []byte, off int64)
	next = func(buf []byte, off int64) {
		a.ReadAsync(context.Background(), buf, off, func(err error) {
			if err != nil {
				aErr.CompareAndSwap(nil, &err)
			}
			if stopped.Load() || err != nil {
				running.Done()
				return
			}
			next(buf, off)
		})
	}
	running.Add(depth)
	for i := range depth {
		next(make([]byte, 4096), int64(i%256)*4096)
	}
	testutil.WaitFor(t, 10*time.Second, "every permit held by the server", func() bool { return h.count() == depth })

	// Each round, b queues one request, then the server answers a's, one at a time, until a
	// request of b's arrives in the permit freed. The first round, a has nothing queued: b's
	// request comes next, ahead of the request a's completion submits right after the put.
	// From then on a's backlog waits in line too, ahead of b's new request: they alternate.
	const rounds = 5
	bDone := make(chan error, rounds)
	release := func() uint32 {
		h.releaseFirst(a.id)
		testutil.WaitFor(t, 10*time.Second, "a request in the freed permit", func() bool { return h.count() == depth })
		return h.lastDevice()
	}
	for i := range rounds {
		b.ReadAsync(context.Background(), make([]byte, 4096), 0, func(err error) { bDone <- err })
		if i > 0 {
			if id := release(); id != a.id {
				t.Fatalf("round %d: the first permit freed carried device %d's request, not that of a (%d), whose backlog waited first", i, id, a.id)
			}
		}
		if id := release(); id != b.id {
			t.Fatalf("round %d: the permit freed carried device %d's request, not that of b (%d), whose turn it was", i, id, b.id)
		}
	}
	stopped.Store(true)
	h.release()
	running.Wait()
	for range rounds {
		if err := <-bDone; err != nil {
			t.Fatal(err)
		}
	}
	if err := aErr.Load(); err != nil {
		t.Fatal(*err)
	}
}

// TestBacklogRacingTickets: two requests that both found the backlog empty each took a place
// in the permit line; the second is queued while the drainer has the first out and waits
// with it. When that wait is cut (the first request's context ends), the backlog keeps one
// place and gives the other up: no place is left in the line that nobody will use, which
// would be handed the next permit put and keep it for good. Afterwards every permit
// serves: a full queue depth of requests reaches the server at once.
func TestBacklogRacingTickets(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "bl", "disk", AccessRW)
	depth := c.Session("bl").QueueDepth()
	h := holdIO(t, e)
	done := make(chan error, 4*depth)
	for i := range depth {
		d.ReadAsync(context.Background(), make([]byte, 4096), int64(i)*4096, func(err error) { done <- err })
	}
	testutil.WaitFor(t, 10*time.Second, "every permit held", func() bool { return h.count() == depth })
	// What asyncOne does for a request that finds the backlog empty and no permit free.
	join := func(ctx context.Context, off int64) (*asyncReq, *transport.PermitTicket) {
		r := asyncPool.Get().(*asyncReq)
		r.d, r.ctx, r.op, r.flags, r.p, r.off = d, ctx, OpRead, 0, make([]byte, 4096), off
		r.done = func(err error) { done <- err }
		d.mu.Lock()
		r.setID(d.id)
		d.mu.Unlock()
		tk, err := d.sess.rtrs.TryRequestOrJoin(r.dir(), r.hdr[:], r.p, r.cb)
		if tk == nil {
			t.Fatalf("request at %d: no place in the permit line (%v)", off, err)
		}
		return r, tk
	}
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	r1, t1 := join(ctx1, 0)
	r2, t2 := join(context.Background(), 4096)
	d.queue(r1, t1)
	testutil.WaitFor(t, 5*time.Second, "the drainer waiting with the first place", func() bool {
		d.bl.mu.Lock()
		defer d.bl.mu.Unlock()
		return d.bl.stop != nil && d.bl.ticket == nil
	})
	d.queue(r2, t2) // kept: the drainer has the other out
	cancel1()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("the request whose context ended: %v, want context.Canceled", err)
	}
	h.release()
	for range depth + 1 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("requests stuck")
		}
	}
	h = holdIO(t, e)
	for i := range depth {
		d.ReadAsync(context.Background(), make([]byte, 4096), int64(i)*4096, func(err error) { done <- err })
	}
	testutil.WaitFor(t, 10*time.Second, "a queue depth of requests at the server at once", func() bool { return h.count() == depth })
	h.release()
	for range depth {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}
