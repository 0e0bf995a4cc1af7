package resched

import (
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestTickEveryInterval(t *testing.T) {
	now := time.Unix(1000, 0)
	p := Pacer{now: func() time.Time { return now }}
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
		now = now.Add(c.step)
		if got := p.Tick(); got != c.want {
			t.Fatalf("after %v more: Tick = %v, want %v", c.step, got, c.want)
		}
	}
}

func TestPassedPostpones(t *testing.T) {
	now := time.Unix(1000, 0)
	p := Pacer{now: func() time.Time { return now }}
	p.Tick()
	now = now.Add(Interval - time.Millisecond)
	p.Passed()
	now = now.Add(Interval - time.Millisecond)
	if p.Tick() {
		t.Fatal("Tick yielded less than Interval after Passed")
	}
	now = now.Add(time.Millisecond)
	if !p.Tick() {
		t.Fatal("Tick did not yield Interval after Passed")
	}
}

// A goroutine locked to its thread, which a Gosched hands off and back, keeps going.
func TestTickLocked(t *testing.T) {
	done := make(chan int)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var p Pacer
		n := 0
		for end := time.Now().Add(30 * time.Millisecond); time.Now().Before(end); {
			if p.Tick() {
				n++
			}
		}
		done <- n
	}()
	select {
	case n := <-done:
		// 30 ms at one yield per 5 ms at most: the first Tick and up to six more.
		if n < 2 || n > 7 {
			t.Fatalf("%d yields in 30 ms, want 2 to 7", n)
		}
	case <-time.After(10 * time.Second):
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
			if _, err := unix.Read(req, buf[:]); err != nil {
				b.Error(err)
				return
			}
			if _, err := unix.Write(ackFD, one); err != nil {
				b.Error(err)
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
