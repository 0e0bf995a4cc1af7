package resched

import (
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestTickEveryInterval(t *testing.T) {
	var now time.Duration
	p := Pacer{now: func() time.Duration { return now }}
	if !p.Tick() {
		t.Fatal("the first Tick did not yield")
	}
	for _, c := range []struct {
		step time.Duration
		want bool
	}{
		{time.Millisecond, false},
		{Interval - 2*time.Millisecond, false},
		{time.Millisecond, true}, // Interval after the last yield
		{Interval - 1, false},
		{1, true},
		{time.Hour, true},
		{0, false},
	} {
		now += c.step
		if got := p.Tick(); got != c.want {
			t.Fatalf("after %v more: Tick = %v, want %v", c.step, got, c.want)
		}
	}
}

// A Tick that reports a yield let another goroutine run: with one P and a fake clock that
// makes every Tick yield, a goroutine started before them runs within a few.
func TestTickYields(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	var ran atomic.Bool
	go ran.Store(true)
	var now time.Duration
	p := Pacer{now: func() time.Duration { now += Interval; return now }}
	// The scheduler takes the global queue (where a Gosched puts the yielder) first on
	// every 61st round; a few yields are enough.
	for i := 0; i < 3 && !ran.Load(); i++ {
		if !p.Tick() {
			t.Fatal("Tick did not yield with the clock Interval on")
		}
	}
	if !ran.Load() {
		t.Fatal("three yields with one P and another goroutine runnable did not run it")
	}
}

// A goroutine locked to its thread, which a Gosched hands off and back, keeps going, and its
// yields are at least Interval apart.
func TestTickLocked(t *testing.T) {
	done := make(chan []time.Time, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var p Pacer
		var at []time.Time
		for end := time.Now().Add(10 * time.Second); len(at) < 3 && time.Now().Before(end); {
			if p.Tick() {
				at = append(at, time.Now())
			}
		}
		done <- at
	}()
	select {
	case at := <-done:
		if len(at) < 3 {
			t.Fatalf("%d yields in 10 s", len(at))
		}
		for i := 1; i < len(at); i++ {
			if d := at[i].Sub(at[i-1]); d < Interval {
				t.Fatalf("yields %v apart, want at least %v", d, Interval)
			}
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a locked goroutine's Ticks did not return")
	}
}

// BenchmarkLockedSyscallLoop is the shape the Pacer is for: a goroutine locked to its thread
// waits in a system call (a blocking eventfd read, as a ublk queue in io_uring_enter) for
// another goroutine, which answers through the netpoller. It reports the time of a round trip
// and the process's voluntary context switches per round trip (vcsw/op, all threads: the
// monitor's wake-ups are among them).
func BenchmarkLockedSyscallLoop(b *testing.B) {
	for _, paced := range []bool{false, true} {
		name := "unpaced"
		if paced {
			name = "paced"
		}
		b.Run(name, func(b *testing.B) { lockedSyscallLoop(b, paced) })
	}
}

func lockedSyscallLoop(b *testing.B, paced bool) {
	req, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(req)
	ackFD, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		b.Fatal(err)
	}
	ack := os.NewFile(uintptr(ackFD), "eventfd")
	defer ack.Close()
	one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var p Pacer
		var buf [8]byte
		for i := 0; i < b.N; i++ {
			_, err := unix.Read(req, buf[:])
			if err == nil {
				_, err = unix.Write(ackFD, one)
			}
			if err != nil {
				b.Error(err)
				ack.Close() // ends the other side's wait
				return
			}
			if paced {
				p.Tick()
			}
		}
	}()
	var buf [8]byte
	var ru0, ru1 unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru0)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := unix.Write(req, one); err != nil {
			b.Fatal(err)
		}
		if _, err := ack.Read(buf[:]); err != nil {
			b.Fatal(err)
		}
	}
	<-done
	b.StopTimer()
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru1)
	b.ReportMetric(float64(ru1.Nvcsw-ru0.Nvcsw)/float64(b.N), "vcsw/op")
}
