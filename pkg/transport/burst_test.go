package transport

import (
	"bytes"
	"sync/atomic"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// burstDisk answers every request from its AtBurstEnd function instead of from Request.
type burstDisk struct {
	*memDisk
	early, bursts, multi atomic.Int64 // fns run before their Request returned; burst ends; with more than one fn
	pending              map[*con]int // fns registered in the burst being polled, per connection (its goroutine's alone)
}

func (d *burstDisk) Request(r *SrvRequest) {
	c := r.slot.con
	var returned atomic.Bool
	first := d.pending[c] == 0
	d.pending[c]++
	ok := r.AtBurstEnd(func() {
		if !returned.Load() {
			d.early.Add(1)
		}
		d.memDisk.Request(r)
	})
	if !ok {
		r.Respond(-5)
		return
	}
	if first {
		r.AtBurstEnd(func() {
			if d.pending[c] > 1 {
				d.multi.Add(1)
			}
			d.pending[c] = 0
			d.bursts.Add(1)
		})
	}
	returned.Store(true)
}

// TestAtBurstEnd: what a handler asks for at a burst's end runs once per request, after its
// Request returned, on the connection's goroutine (the per-connection count below is that
// goroutine's alone: the race detector would see two), and every request answered from there
// is served.
func TestAtBurstEnd(t *testing.T) {
	leakcheck.Check(t)
	d := &burstDisk{memDisk: newMemDisk(8 << 20), pending: map[*con]int{}}
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Handler, o.QueueDepth = d, 64 })
	e.disk = d.memDisk
	s := e.open(t, "burst", paths(t, path1()), func(o *ClientOptions) { o.ConPerPath = 1 })
	model := make([]byte, len(d.disk))
	randomIO(t, s, model, 2000, 32, 7)
	d.mu.Lock()
	defer d.mu.Unlock()
	if !bytes.Equal(model, d.disk) {
		t.Fatal("the disk differs from the model")
	}
	if n := d.early.Load(); n != 0 {
		t.Fatalf("%d functions ran before their Request returned", n)
	}
	t.Logf("%d bursts, %d with more than one request", d.bursts.Load(), d.multi.Load())
	if d.bursts.Load() == 0 {
		t.Fatal("no burst ended")
	}
}
