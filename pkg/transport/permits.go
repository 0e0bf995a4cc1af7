package transport

import (
	"context"
	"math/bits"
	"slices"
	"sync"
)

// permits is a session's permit pool: a bitmap handed out lowest free index first, as the
// kernel's find_first_zero_bit, so a light load keeps reusing the same few permits (and so
// the same chunks and connections). Those who wait are served in the order they came: a
// permit put while anyone waits goes to the first of them, never back to the pool, so a
// caller that does not wait (TryRequest) cannot take it first, however often it tries. Each
// device's backlog waits with one request at a time, so the devices of a session that found
// no permit take turns, as the kernel's client reruns its requeued queues round robin.
type permits struct {
	mu      sync.Mutex
	free    []uint64 // 1 = free
	n       int
	nfree   int
	waiters []chan int    // in arrival order; each receives the permit handed to it
	idle    chan struct{} // every permit came back; one token, for drain
}

func newPermits(n int) *permits {
	p := &permits{free: make([]uint64, (n+63)/64), n: n, nfree: n, idle: make(chan struct{}, 1)}
	for i := 0; i < n; i++ {
		p.free[i/64] |= 1 << (i % 64)
	}
	return p
}

// tryGet takes the lowest free permit. None is free while anyone waits: puts go to them.
func (p *permits) tryGet() (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.takeLocked()
}

func (p *permits) takeLocked() (int, bool) {
	for w, v := range p.free {
		if v != 0 {
			b := bits.TrailingZeros64(v)
			p.free[w] &^= 1 << b
			p.nfree--
			return w*64 + b, true
		}
	}
	return 0, false
}

// get waits for a permit until ctx ends, behind those already waiting.
func (p *permits) get(ctx context.Context) (int, error) {
	i, ch := p.join()
	if ch == nil {
		return i, nil
	}
	i, err := p.wait(ctx, ch)
	if err != nil {
		p.leave(ch)
	}
	return i, err
}

// join takes the lowest free permit, or, with none free, a place at the end of the line:
// the channel the permit will be handed on.
func (p *permits) join() (int, chan int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if i, ok := p.takeLocked(); ok {
		return i, nil
	}
	ch := make(chan int, 1)
	p.waiters = append(p.waiters, ch)
	return 0, ch
}

// wait waits for the permit handed on ch until ctx ends; the place in line is kept then.
func (p *permits) wait(ctx context.Context, ch chan int) (int, error) {
	select {
	case i := <-ch:
		return i, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// leave gives up the place ch holds in line; a permit handed on it meanwhile goes on to the
// next in line.
func (p *permits) leave(ch chan int) {
	p.mu.Lock()
	if k := slices.Index(p.waiters, ch); k >= 0 {
		p.waiters = slices.Delete(p.waiters, k, k+1)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	p.put(<-ch)
}

func (p *permits) put(i int) {
	p.mu.Lock()
	if len(p.waiters) > 0 {
		ch := p.waiters[0]
		p.waiters[0] = nil
		p.waiters = p.waiters[1:]
		p.mu.Unlock()
		ch <- i
		return
	}
	p.free[i/64] |= 1 << (i % 64)
	p.nfree++
	all := p.nfree == p.n
	p.mu.Unlock()
	if all {
		select {
		case p.idle <- struct{}{}:
		default:
		}
	}
}

// drain waits until every permit is back or ctx ends. It waits for the last put, which
// signals idle.
func (p *permits) drain(ctx context.Context) bool {
	for {
		p.mu.Lock()
		all := p.nfree == p.n
		p.mu.Unlock()
		if all {
			return true
		}
		select {
		case <-p.idle: // possibly from an earlier moment: checked again
		case <-ctx.Done():
			return false
		}
	}
}
