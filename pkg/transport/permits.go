package transport

import (
	"context"
	"math/bits"
	"sync"
)

// permits is a session's permit pool: a bitmap handed out lowest free index first, as the
// kernel's find_first_zero_bit, so a light load keeps reusing the same few permits (and so
// the same chunks and connections).
type permits struct {
	mu    sync.Mutex
	free  []uint64 // 1 = free
	n     int
	nfree int
	avail chan struct{} // a permit came back; one token, re-armed by whoever takes it
	idle  chan struct{} // every permit came back; one token, for drain
}

func newPermits(n int) *permits {
	p := &permits{free: make([]uint64, (n+63)/64), n: n, nfree: n, avail: make(chan struct{}, 1), idle: make(chan struct{}, 1)}
	for i := 0; i < n; i++ {
		p.free[i/64] |= 1 << (i % 64)
	}
	return p
}

// tryGet takes the lowest free permit.
func (p *permits) tryGet() (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for w, v := range p.free {
		if v != 0 {
			b := bits.TrailingZeros64(v)
			p.free[w] &^= 1 << b
			p.nfree--
			if p.nfree > 0 {
				p.signal() // others may be waiting
			}
			return w*64 + b, true
		}
	}
	return 0, false
}

// get waits for a permit until ctx ends.
func (p *permits) get(ctx context.Context) (int, error) {
	for {
		if i, ok := p.tryGet(); ok {
			return i, nil
		}
		select {
		case <-p.avail:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

func (p *permits) put(i int) {
	p.mu.Lock()
	p.free[i/64] |= 1 << (i % 64)
	p.nfree++
	all := p.nfree == p.n
	p.mu.Unlock()
	p.signal()
	if all {
		select {
		case p.idle <- struct{}{}:
		default:
		}
	}
}

func (p *permits) signal() {
	select {
	case p.avail <- struct{}{}:
	default:
	}
}

// drain waits until every permit is back or ctx ends. It waits for the last put, not for
// avail, whose token is there whenever a permit is free: taking and re-arming it spun.
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
