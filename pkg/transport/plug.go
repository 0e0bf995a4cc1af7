package transport

import (
	"sync"
	"sync/atomic"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// plug is a session's plugging state: while a caller has the session plugged, the
// connections its requests go out on hold their frames back (rdma.Plugger), and the
// last Unplug sends them together, as the block layer's plug gathers requests before it
// rings the doorbell once.
type plug struct {
	depth atomic.Int32
	// waiting counts requests waiting for a permit: while there is one, posts are not held.
	// A plug is the session's, not its caller's, so a request of another caller would
	// otherwise wait, held, until the waiting caller got its permit and unplugged; with every
	// permit in such held requests that is never.
	waiting atomic.Int32
	mu      sync.Mutex
	qps     []rdma.Plugger // plugged by this session, unplugged together
}

// Plug starts gathering the session's posts; calls nest. The caller must Unplug soon, and
// before it waits for anything its requests' completions would bring (Request's wait for a
// permit unplugs by itself).
func (s *Session) Plug() { s.plug.depth.Add(1) }

// Unplug ends a Plug; the last one sends what was gathered.
func (s *Session) Unplug() {
	s.plug.mu.Lock()
	if s.plug.depth.Add(-1) > 0 {
		s.plug.mu.Unlock()
		return
	}
	s.releasePlugsLocked()
}

// releasePlugsLocked unplugs every connection plugged so far; s.plug.mu is held and is
// released.
func (s *Session) releasePlugsLocked() {
	qps := s.plug.qps
	s.plug.qps = nil
	s.plug.mu.Unlock()
	for _, q := range qps {
		q.Unplug()
	}
}

// flushPlugs sends what is gathered without ending the plug (before waiting for a permit).
func (s *Session) flushPlugs() {
	if s.plug.depth.Load() == 0 {
		return
	}
	s.plug.mu.Lock()
	s.releasePlugsLocked()
}

// plugCon plugs c's queue pair for the session's current plug, once, unless a request is
// waiting for a permit.
func (s *Session) plugCon(c *con) {
	if s.plug.depth.Load() == 0 || s.plug.waiting.Load() > 0 {
		return
	}
	pl, ok := c.qp.(rdma.Plugger)
	if !ok {
		return
	}
	s.plug.mu.Lock()
	defer s.plug.mu.Unlock()
	// Checked again under the lock: a waiter counts itself before its flushPlugs takes it,
	// so a queue pair plugged here is either released by that flush or not plugged at all.
	if s.plug.depth.Load() == 0 || s.plug.waiting.Load() > 0 {
		return
	}
	for _, q := range s.plug.qps {
		if q == pl {
			return
		}
	}
	pl.Plug()
	s.plug.qps = append(s.plug.qps, pl)
}
