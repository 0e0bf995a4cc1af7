package transport

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// goid is the calling goroutine's number, from its stack header ("goroutine N [...]").
func goid() uint64 {
	var b [64]byte
	s := b[:runtime.Stack(b[:], false)]
	s = bytes.TrimPrefix(s, []byte("goroutine "))
	n, _ := strconv.ParseUint(string(s[:bytes.IndexByte(s, ' ')]), 10, 64)
	return n
}

// hookRecorder checks that the AfterCompletions hook follows every request callback on
// the goroutine that ran it, as a user that gathers its callbacks' output (the NBD
// server's replies) relies on: a callback whose goroutine ends without the hook leaves
// that output unsent until some other completion comes, a heartbeat seconds later.
type hookRecorder struct {
	mu      sync.Mutex
	pending map[uint64]int // callbacks per goroutine not yet followed by the hook
	flushed chan struct{}  // a hook ran after a callback on its goroutine
}

func newHookRecorder() *hookRecorder {
	return &hookRecorder{pending: map[uint64]int{}, flushed: make(chan struct{}, 64)}
}

// done records a callback on this goroutine.
func (h *hookRecorder) done() {
	h.mu.Lock()
	h.pending[goid()]++
	h.mu.Unlock()
}

// hook is the AfterCompletions hook.
func (h *hookRecorder) hook() {
	h.mu.Lock()
	n := h.pending[goid()]
	delete(h.pending, goid())
	h.mu.Unlock()
	if n > 0 {
		h.flushed <- struct{}{}
	}
}

// wait fails t unless the hook has followed a callback.
func (h *hookRecorder) wait(t *testing.T, what string) {
	t.Helper()
	select {
	case <-h.flushed:
	case <-time.After(5 * time.Second):
		h.mu.Lock()
		defer h.mu.Unlock()
		t.Fatalf("%s: no AfterCompletions hook ran after the callback on its goroutine (callbacks left: %v)", what, h.pending)
	}
}

// hookedSession opens a session over one path whose AfterCompletions hook is h's, against a
// server that answers after delay.
func hookedSession(t *testing.T, name string, delay time.Duration) (*env, *Session, *hookRecorder) {
	e := newEnv(t, false, 8)
	e.disk.async, e.disk.delay = true, delay
	h := newHookRecorder()
	s := e.open(t, name, paths(t, path1()), func(o *ClientOptions) { o.AfterCompletions = h.hook })
	return e, s, h
}

// write sends a 4 KiB write whose callback is recorded; its outcome comes on the channel.
func (h *hookRecorder) write(t *testing.T, s *Session) <-chan error {
	t.Helper()
	finished := make(chan error, 1)
	if err := s.Request(context.Background(), Write, offHdr(0), make([]byte, 4096), func(err error) {
		h.done()
		finished <- err
	}); err != nil {
		t.Fatal(err)
	}
	return finished
}

// TestAfterCompletionsAfterEarlyAnswer: a request answered while its post still ran is
// finished on a goroutine of the post's, and the hook runs there after its callback. On the
// tree before, the NBD server's reply to such a request waited for the next completion:
// over loopback at queue depth 1 an IO now and then took the heartbeat's 5 s.
func TestAfterCompletionsAfterEarlyAnswer(t *testing.T) {
	leakcheck.Check(t)
	e, s, h := hookedSession(t, "early-hook", 3*time.Second)
	sp := e.srvPath(t, "ip:"+testAddr(1))
	s.beforePost = func(pm, cid int) {
		s.beforePost = nil
		forgeResponse(t, s, sp, pm, cid)
	}
	if err := <-h.write(t, s); err != nil {
		t.Fatalf("the request's outcome: %v", err)
	}
	h.wait(t, "answered during its post")
	time.Sleep(e.disk.delay + 200*time.Millisecond) // the real answer, stale, finishes nothing
}

// TestAfterCompletionsAfterFailover: a request in flight on the only path, failed when the
// path is disconnected, is finished by the failover, which runs the hook after it.
func TestAfterCompletionsAfterFailover(t *testing.T) {
	leakcheck.Check(t)
	e, s, h := hookedSession(t, "failover-hook", 2*time.Second)
	finished := h.write(t, s)
	p := s.Paths()[0]
	testutil.WaitFor(t, 5*time.Second, "the request in flight", func() bool { return p.Stats.Inflight.Load() == 1 })
	p.Disconnect()
	if err := <-finished; err == nil || !errors.Is(err, ErrNoPath) {
		t.Fatalf("the request's outcome with no path left: %v, want ErrNoPath", err)
	}
	h.wait(t, "failed by the failover")
	time.Sleep(e.disk.delay + 200*time.Millisecond) // the server's late answer goes nowhere
}
