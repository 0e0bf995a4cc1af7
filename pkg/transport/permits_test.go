package transport

import (
	"context"
	"fmt"
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

// TestPermitsDrainWaits: drain waits for the last permit without spinning. An earlier tree
// took a "permit free" token, which was there whenever a permit was free, and put it back
// at once: Session.Close burnt a CPU for as long as a request stayed in flight. The check
// is of CPU spent, not of time taken: a spinning drain on its own thread spends about the
// whole wait, a waiting one next to nothing.
func TestPermitsDrainWaits(t *testing.T) {
	p := newPermits(2)
	held, _ := p.tryGet() // one in flight, one free
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

// waiting is how many callers wait for a permit of p.
func (p *permits) waiting() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.waiters)
}

// TestPermitsInTurn: those who wait for a permit get them in the order they came, and a
// permit put while anyone waits is theirs: a caller that does not wait finds none, however
// soon it looks. On the tree before, a put freed the permit and woke a waiter, and whoever
// looked first took it (a device with no backlog, on its own thread, before the woken
// drainer of another): a busy device could keep another's backlog waiting.
func TestPermitsInTurn(t *testing.T) {
	p := newPermits(2)
	a, _ := p.tryGet()
	b, _ := p.tryGet()
	type res struct {
		waiter, permit int
		err            error
	}
	got := make(chan res, 3)
	var cancels []context.CancelFunc
	for w := 0; w < 3; w++ {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		cancels = append(cancels, cancel)
		go func() {
			i, err := p.get(ctx)
			got <- res{w, i, err}
		}()
		// In order: each is waiting before the next comes.
		deadline := time.Now().Add(5 * time.Second)
		for p.waiting() != w+1 {
			if time.Now().After(deadline) {
				t.Fatalf("%d waiters, want %d", p.waiting(), w+1)
			}
			time.Sleep(time.Millisecond)
		}
	}
	p.put(b)
	if i, ok := p.tryGet(); ok {
		t.Fatalf("tryGet took permit %d, put while three waited", i)
	}
	if r := <-got; r.waiter != 0 || r.permit != b || r.err != nil {
		t.Fatalf("the first put went to waiter %d as permit %d (%v), want waiter 0 with %d", r.waiter, r.permit, r.err, b)
	}
	// The second waiter gives up: it leaves the line, and the next put goes to the third.
	cancels[1]()
	if r := <-got; r.waiter != 1 || r.err != context.Canceled {
		t.Fatalf("waiter %d ended with %v, want waiter 1 canceled", r.waiter, r.err)
	}
	if n := p.waiting(); n != 1 {
		t.Fatalf("%d waiting after the second gave up, want 1", n)
	}
	p.put(a)
	if r := <-got; r.waiter != 2 || r.permit != a || r.err != nil {
		t.Fatalf("the second put went to waiter %d as permit %d (%v), want waiter 2 with %d", r.waiter, r.permit, r.err, a)
	}
	p.put(a)
	p.put(b)
	if !p.drain(context.Background()) {
		t.Fatal("permits lost")
	}
}

// TestPermitsGiveUpRace: waiters whose contexts end while permits are put lose none of
// them, and strand no one: a permit handed to one that has given up goes on to the next in
// line, or back to the pool only when no one waits. Throughout, no permit is free while
// anyone waits.
func TestPermitsGiveUpRace(t *testing.T) {
	const n, workers, rounds = 4, 16, 300
	p := newPermits(n)
	done := make(chan struct{})
	stop := make(chan struct{})
	bad := make(chan string, 1)
	go func() {
		defer close(bad)
		for {
			p.mu.Lock()
			free, waiting := p.nfree, len(p.waiters)
			p.mu.Unlock()
			if free > 0 && waiting > 0 {
				bad <- fmt.Sprintf("%d permits free while %d wait", free, waiting)
				return
			}
			select {
			case <-stop:
				return
			default:
				runtime.Gosched()
			}
		}
	}()
	for w := 0; w < workers; w++ {
		go func() {
			defer func() { done <- struct{}{} }()
			for r := 0; r < rounds; r++ {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r%3)*20*time.Microsecond)
				i, err := p.get(ctx)
				cancel()
				if err == nil {
					runtime.Gosched()
					p.put(i)
				}
			}
		}()
	}
	timeout := time.After(30 * time.Second)
	for w := 0; w < workers; w++ {
		select {
		case <-done:
		case <-timeout:
			t.Fatalf("waiters still waiting after 30 s: %d of %d workers done", w, workers)
		}
	}
	close(stop)
	if msg, ok := <-bad; ok {
		t.Fatal(msg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !p.drain(ctx) {
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Fatalf("%d of %d permits free after every waiter ended, %d waiting", p.nfree, n, len(p.waiters))
	}
}

// TestPermitsPlaceKept: a place taken in line (a ticket's) keeps its turn across waits cut
// short, and given up, passes a permit handed to it on to the next in line.
func TestPermitsPlaceKept(t *testing.T) {
	p := newPermits(1)
	held, _ := p.tryGet()
	_, first := p.join()
	_, second := p.join()
	if first == nil || second == nil {
		t.Fatal("a place in line with no permit free: none taken")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := p.wait(ctx, first); err == nil {
		t.Fatal("a wait with no permit put succeeded")
	}
	p.put(held) // still the first's turn, though its wait ended
	if i, err := p.wait(context.Background(), first); err != nil || i != held {
		t.Fatalf("the first place got %d, %v; want permit %d", i, err, held)
	}
	p.put(held)
	p.leave(second) // handed the permit as it gave up: back to the pool, no one waiting
	if i, ok := p.tryGet(); !ok || i != held {
		t.Fatalf("permit %d not back after the last place in line gave it up (%d %v)", held, i, ok)
	}
	p.put(held)
	if !p.drain(context.Background()) {
		t.Fatal("permits lost")
	}
}
