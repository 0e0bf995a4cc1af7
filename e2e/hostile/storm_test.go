package hostile

import (
	"runtime"
	"testing"
	"time"
)

// TestReconnectStormLeaks: a server that drops every path 50 ms after it connected: the
// client reconnects after its delay; goroutines do not pile up.
func TestReconnectStormLeaks(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	s.info = nil
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			s.mu.Lock()
			cs := s.conns
			s.conns = nil
			s.mu.Unlock()
			for _, c := range cs {
				c.nc.Close()
			}
		}
	}()
	sess := open(t, s, 3, nil)
	time.Sleep(2 * time.Second)
	g1 := runtime.NumGoroutine()
	ok1 := sess.Paths()[0].Stats.ReconnectOK.Total()
	time.Sleep(6 * time.Second)
	g2 := runtime.NumGoroutine()
	ok2 := sess.Paths()[0].Stats.ReconnectOK.Total()
	t.Logf("goroutines %d -> %d over %d reconnects", g1, g2, ok2-ok1)
	if g2 > g1+20 {
		t.Errorf("goroutines grow: %d -> %d", g1, g2)
	}
}
