package rnbd

import (
	"context"
	"errors"
	"sync"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// backlog holds, in order, a device's asynchronous requests that found no RTRS permit free,
// for one goroutine to send as permits come back, so that ReadAsync and WriteAsync never wait
// in their caller: a ublk queue's thread goes on committing what completed. The kernel's
// client does it its own way: a request that gets no permit goes back to the block layer,
// which runs the queue again when a permit is put. While the backlog holds anything, new
// requests queue behind it rather than overtake it. The backlog holds one place in the
// session's permit line, taken when its first request found no permit, and the session
// serves the line in order: the backlogs of a session's devices take turns (the kernel goes
// round its requeued queues). Its length is bounded by what the callers keep in flight (a
// ublk device's queues × depth, an NBD connection's MaxInflight).
type backlog struct {
	mu       sync.Mutex
	q        []*asyncReq
	draining bool               // the drainer runs; it ends with q empty
	stop     context.CancelFunc // ends the drainer's permit wait under way, if any
	done     chan struct{}      // closed when the drainer ends
	// ticket is the backlog's place in the session's permit line, taken when a request
	// first found no permit: the head request uses it. Without one (used, or given up),
	// the drainer waits at the end of the line.
	ticket *transport.PermitTicket
}

// behind queues r if the backlog holds anything, and says whether it did.
func (b *backlog) behind(r *asyncReq) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.q) == 0 {
		return false
	}
	b.pushLocked(r)
	return true
}

// pushLocked queues r; its context ending interrupts the drainer's wait, which then fails it.
func (b *backlog) pushLocked(r *asyncReq) {
	r.unwatch = context.AfterFunc(r.ctx, b.kick)
	b.q = append(b.q, r)
}

// kick ends the drainer's permit wait under way: it looks again at the device and at the
// contexts of what it holds.
func (b *backlog) kick() {
	b.mu.Lock()
	if b.stop != nil {
		b.stop()
	}
	b.mu.Unlock()
}

// wait waits for the drainer to end, or for ctx.
func (b *backlog) wait(ctx context.Context) {
	b.mu.Lock()
	ch := b.done
	b.mu.Unlock()
	if ch != nil {
		select {
		case <-ch:
		case <-ctx.Done():
		}
	}
}

// queue puts r, which found no permit free and took t, a place in the permit line, in the
// backlog, starting the drainer if none runs. The backlog keeps one place: another, taken by
// a request that raced this one into the backlog, is given up.
func (d *Device) queue(r *asyncReq, t *transport.PermitTicket) {
	b := &d.bl
	b.mu.Lock()
	if b.ticket == nil {
		b.ticket, t = t, nil
	}
	b.pushLocked(r)
	start := !b.draining
	if start {
		b.draining, b.done = true, make(chan struct{})
	}
	b.mu.Unlock()
	if t != nil {
		t.Release()
	}
	if start {
		go d.drain()
	}
}

// drain sends the backlog's requests in order, each waiting for a permit. The request at
// the head leaves the backlog only once sent or ended, so that new ones queue behind it
// meanwhile. Requests whose context ended fail, unsent, wherever they stand; a device no
// longer mapped sends its requests on to the waiting submit (which fails them once the
// device is unmapped); a remapped device's requests take its new id. It ends with the
// backlog empty.
func (d *Device) drain() {
	b := &d.bl
	for {
		b.mu.Lock()
		var ended []*asyncReq
		keep := b.q[:0]
		for _, r := range b.q {
			if r.ctx.Err() != nil {
				ended = append(ended, r)
			} else {
				keep = append(keep, r)
			}
		}
		clear(b.q[len(keep):])
		b.q = keep
		for _, r := range ended {
			r.unwatch()
		}
		if len(b.q) == 0 {
			t := b.ticket
			b.q, b.draining, b.ticket = nil, false, nil
			close(b.done)
			b.mu.Unlock()
			if t != nil {
				t.Release()
			}
			for _, r := range ended {
				r.fail(r.ctx.Err())
			}
			return
		}
		r, t := b.q[0], b.ticket
		b.ticket = nil
		wctx, stop := context.WithCancel(context.Background())
		b.stop = stop
		b.mu.Unlock()
		for _, r := range ended {
			r.fail(r.ctx.Err())
		}

		// The wait is registered before the look at the state: an Unmap that turns the
		// device unmapped after the look finds it to cut short.
		d.gate.RLock()
		d.mu.Lock()
		st, id := d.state, d.id
		d.mu.Unlock()
		var err error
		unwatch := r.unwatch
		if st == StateMapped {
			if id != r.id {
				r.setID(id)
			}
			// r may be back in the pool, or reused, once this returns nil: not read after.
			if t != nil {
				err = d.sess.rtrs.RequestWith(wctx, t, r.dir(), r.hdr[:], r.p, r.cb)
			} else {
				err = d.sess.rtrs.Request(wctx, r.dir(), r.hdr[:], r.p, r.cb)
			}
		}
		d.gate.RUnlock()
		cut := err != nil && wctx.Err() != nil && errors.Is(err, context.Canceled)
		interrupted := cut && r.ctx.Err() == nil
		stop()
		b.mu.Lock()
		b.stop = nil
		var spare *transport.PermitTicket
		if t != nil && (st != StateMapped || cut) {
			// Not used (RequestWith uses it up unless its wait was cut short): the place in
			// line stays the backlog's, for the next request at the head. A place that a
			// request racing into the backlog left meanwhile is later in line: given up.
			spare, b.ticket = b.ticket, t
		}
		b.mu.Unlock()
		if spare != nil {
			spare.Release()
		}
		if interrupted {
			continue // at the head still: look again
		}
		b.mu.Lock()
		b.q[0] = nil
		b.q = b.q[1:]
		b.mu.Unlock()
		unwatch()
		switch {
		case st != StateMapped:
			r.resubmit()
		case err != nil:
			if cerr := r.ctx.Err(); cerr != nil {
				err = cerr
			}
			r.fail(err)
		}
	}
}
