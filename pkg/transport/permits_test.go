package transport

import (
	"context"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestPermitsLowestFirst(t *testing.T) {
	p := newPermits(130)
	for i := 0; i < 130; i++ {
		if got, ok := p.tryGet(); !ok || got != i {
			t.Fatalf("permit %d: %d %v", i, got, ok)
		}
	}
	if _, ok := p.tryGet(); ok {
		t.Fatal("131st permit")
	}
	p.put(70)
	p.put(3)
	if got, _ := p.tryGet(); got != 3 {
		t.Fatalf("lowest free is 3, got %d", got)
	}
	if got, _ := p.tryGet(); got != 70 {
		t.Fatalf("then 70, got %d", got)
	}
}

// threadCPU is the CPU time of the calling thread so far.
func threadCPU(t *testing.T) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		t.Error(err) // may run on another goroutine than the test's
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestPermitsDrainWaits: drain waits for the last permit without spinning. On the tree
// before it took avail's token, which is there whenever a permit is free, and put it back
// at once: Session.Close burnt a CPU for as long as a request stayed in flight. The check
// is of CPU spent, not of time taken: a spinning drain on its own thread spends about the
// whole wait, a waiting one next to nothing.
func TestPermitsDrainWaits(t *testing.T) {
	p := newPermits(2)
	held, _ := p.tryGet() // one in flight, one free: avail has its token
	const wait = 300 * time.Millisecond
	type result struct {
		ok  bool
		cpu time.Duration
	}
	res := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		start := threadCPU(t)
		ok := p.drain(context.Background())
		res <- result{ok, threadCPU(t) - start}
	}()
	time.Sleep(wait)
	select {
	case <-res:
		t.Fatal("drain returned with a permit out")
	default:
	}
	p.put(held)
	r := <-res
	if !r.ok {
		t.Fatal("drain failed with every permit back")
	}
	if r.cpu > wait/3 {
		t.Fatalf("drain spent %v of CPU waiting %v for the last permit", r.cpu, wait)
	}
	// An ended context ends it, a permit still out.
	held, _ = p.tryGet()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if p.drain(ctx) {
		t.Fatal("drain succeeded with a permit out")
	}
	p.put(held)
}
