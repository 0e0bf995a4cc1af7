// Package resched lets a loop that lives in system calls or calls into C pass through the Go
// scheduler now and then, so that the runtime's monitor (sysmon) does not take its P again
// and again.
//
// The monitor notes, per P, when the scheduler last ran a goroutine there. Once that is
// 10 ms old (about 20 ms while another P is idle), each monitor tick that finds the goroutine inside
// a system call or a call into C takes its P, and each take puts the monitor back on its
// shortest sleep (20 µs). A tick that finds it in Go code preempts it instead, which ends
// the run of takes; but a loop that is almost always in the kernel or in C (a ublk queue
// going from one io_uring_enter to the next, locked to its thread; a busy poll spinning in
// the provider's C) is rarely found there: while IO flows, the monitor then wakes thousands
// of times a second and the loop gets a P back after nearly every call. One pass through the
// scheduler every Interval keeps the P's last run recent. It does not keep a P through one
// long wait: a call that outlasts a tick while other goroutines want the P still loses it, as
// in any Go program.
//
// A pass costs a reschedule, and for a goroutine locked to its thread a hand-off of its P to
// another thread and back, which may wait for a P when all are busy. Whether that pays is a
// measurement per loop: rdma-perf's busy poll is paced; the ublk queue loop is not, as its
// A/B in the VM gained 4 % at 4 KiB reads and lost 9 % at writes (docs/benchmarks.md).
package resched

import (
	"runtime"
	"time"
)

// Interval is how often a Pacer passes through the scheduler: half the 10 ms after which the
// monitor starts taking the P.
const Interval = 5 * time.Millisecond

// epoch is the origin of the Pacer's clock: time.Since of a monotonic time is one clock read.
var epoch = time.Now()

// Pacer times a loop's passes through the scheduler. The zero value is ready; it belongs to
// one goroutine.
type Pacer struct {
	last    time.Duration // since epoch, at the end of the last yield
	yielded bool
	now     func() time.Duration // since epoch; tests set it
}

// Tick yields the processor (runtime.Gosched) if Interval has passed since it last did, and
// reports whether it did. A loop calls it once per round.
func (p *Pacer) Tick() bool {
	if p.yielded && p.clock()-p.last < Interval {
		return false
	}
	runtime.Gosched()
	p.yielded = true
	// Read again: a Gosched of a goroutine locked to its thread hands the thread's P off and
	// back, which takes a while.
	p.last = p.clock()
	return true
}

func (p *Pacer) clock() time.Duration {
	if p.now != nil {
		return p.now()
	}
	return time.Since(epoch)
}
