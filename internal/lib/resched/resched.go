// Package resched lets a loop that never waits in the Go scheduler pass through it now and
// then, so that the runtime's monitor (sysmon) does not take it for a goroutine stuck in a
// long system call.
//
// The monitor counts the scheduler's passes per P. When a goroutine has run for 10 ms
// without one and is found inside a system call or a call into C, the monitor takes its P
// from it at every tick (from 20 µs apart), and each take keeps the monitor ticking at that
// rate. A loop that goes from one waiting system call to the next (a ublk queue's
// io_uring_enter, locked to its thread) or from one call into C to the next (a verbs
// completion handler that always finds more work) never passes through the scheduler while
// IO flows: the monitor then wakes thousands of times a second, and the loop reacquires a P
// after nearly every call. One pass every Interval resets the count for the price of one
// reschedule.
package resched

import (
	"runtime"
	"time"
)

// Interval is how often a Pacer passes through the scheduler: half the 10 ms after which the
// monitor starts taking the P.
const Interval = 5 * time.Millisecond

// Pacer times a loop's passes through the scheduler. The zero value is ready; it belongs to
// one goroutine.
type Pacer struct {
	last time.Time
	now  func() time.Time // time.Now; tests set it
}

// Tick yields the processor (runtime.Gosched) if Interval has passed since it last did or
// since Passed, and reports whether it did. A loop calls it once per round.
func (p *Pacer) Tick() bool {
	now := p.clock()
	if !p.last.IsZero() && now.Sub(p.last) < Interval {
		return false
	}
	runtime.Gosched()
	// Read again: a Gosched of a goroutine locked to its thread hands the thread's P off and
	// back, which takes a while.
	p.last = p.clock()
	return true
}

// Passed tells the Pacer that the goroutine has just passed through the scheduler by itself
// (it parked, in a channel or the netpoller): the next yield is due Interval from now.
func (p *Pacer) Passed() { p.last = p.clock() }

func (p *Pacer) clock() time.Time {
	if p.now != nil {
		return p.now()
	}
	return time.Now()
}
