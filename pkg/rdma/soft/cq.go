package soft

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// cq is a completion queue: a ring of completions and a one-slot notification channel, so a
// waiter sleeps without spinning and a producer never blocks.
type cq struct {
	mu     sync.Mutex
	ring   []rdma.WC
	head   int // next to poll
	n      int // queued
	closed bool

	notify chan struct{}
	done   chan struct{}

	handler atomic.Pointer[func()]
	pending atomic.Bool // completions arrived since the handler last started
	hmu     sync.Mutex
	running bool // a goroutine is in the handler loop
	again   bool // completions arrived while it ran
}

func newCQ(cqe int) *cq {
	return &cq{ring: make([]rdma.WC, cqe), notify: make(chan struct{}, 1), done: make(chan struct{})}
}

var _ rdma.CQ = (*cq)(nil)

// push queues a completion. A full ring grows: a real HCA would report a CQ overrun, which
// callers that size their queues as on hardware never see; growing keeps a mis-sized queue from
// losing completions.
func (c *cq) push(wc rdma.WC) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	if c.n == len(c.ring) {
		grown := make([]rdma.WC, 2*len(c.ring))
		k := copy(grown, c.ring[c.head:])
		copy(grown[k:], c.ring[:c.head])
		c.ring, c.head = grown, 0
	}
	c.ring[(c.head+c.n)%len(c.ring)] = wc
	c.n++
	c.mu.Unlock()
	c.pending.Store(true)
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

func (c *cq) Poll(wc []rdma.WC) int {
	c.mu.Lock()
	k := 0
	for k < len(wc) && c.n > 0 {
		wc[k] = c.ring[c.head]
		c.head = (c.head + 1) % len(c.ring)
		c.n--
		k++
	}
	c.mu.Unlock()
	return k
}

func (c *cq) Wait(ctx context.Context) error {
	for {
		c.mu.Lock()
		n, closed := c.n, c.closed
		c.mu.Unlock()
		if closed {
			return rdma.ErrClosed
		}
		if n > 0 {
			return nil
		}
		select {
		case <-c.notify:
		case <-c.done:
			return rdma.ErrClosed
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *cq) SetHandler(fn func()) {
	if fn == nil {
		c.handler.Store(nil)
		return
	}
	c.handler.Store(&fn)
	c.pending.Store(true)
	c.runHandler()
}

// runHandler runs the completion handler if completions arrived, unless another goroutine is
// already running it (that one runs it again). Callers hold no provider lock.
func (c *cq) runHandler() {
	h := c.handler.Load()
	if h == nil || !c.pending.Load() {
		return
	}
	c.hmu.Lock()
	if c.running {
		c.again = true
		c.hmu.Unlock()
		return
	}
	c.running = true
	c.hmu.Unlock()
	for {
		c.pending.Store(false)
		(*h)()
		c.hmu.Lock()
		if !c.again {
			c.running = false
			c.hmu.Unlock()
			return
		}
		c.again = false
		c.hmu.Unlock()
		if h = c.handler.Load(); h == nil {
			c.hmu.Lock()
			c.running = false
			c.hmu.Unlock()
			return
		}
	}
}

func (c *cq) Destroy() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return rdma.ErrClosed
	}
	c.closed = true
	close(c.done)
	return nil
}
