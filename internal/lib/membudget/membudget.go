// Package membudget counts memory against a bound where what is freed may come back later:
// registered IO buffers that a memory window still holds outlive their free, and stay
// counted until the transport gives them back.
package membudget

import "sync/atomic"

// Budget counts bytes against a limit. The zero value has no room; a negative limit means
// off (nothing is ever reserved).
type Budget struct {
	limit int64
	used  atomic.Int64
}

// New returns a budget of limit bytes (negative: off).
func New(limit int64) *Budget { return &Budget{limit: limit} }

// Limit is the bound in bytes (negative: off).
func (b *Budget) Limit() int64 { return b.limit }

// Used is the bytes counted now.
func (b *Budget) Used() int64 { return b.used.Load() }

// Reserve counts n bytes unless that would pass the limit, and says whether it did.
func (b *Budget) Reserve(n int64) bool {
	if b.limit < 0 {
		return false
	}
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	return true
}

// Cancel uncounts n bytes reserved for memory that was never taken.
func (b *Budget) Cancel(n int64) { b.used.Add(-n) }

// ReleaseWhen uncounts n bytes once released is closed: at once if it is, else from a
// goroutine that waits for it. At most the limit's worth of such waits exist, since what
// they wait for is counted.
func (b *Budget) ReleaseWhen(n int64, released <-chan struct{}) {
	select {
	case <-released:
		b.used.Add(-n)
	default:
		go func() {
			<-released
			b.used.Add(-n)
		}()
	}
}
