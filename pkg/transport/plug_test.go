package transport

import (
	"context"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// TestPlugNotHeldWhileWaiting: while a plugged caller waits for a permit, another caller's
// request goes out at once. The plug is the session's, so on the tree before, a request
// that took a permit then (here the permit the test hands back just as the first caller
// starts to wait) was held under that plug until the first caller had a permit and
// unplugged, or until something else arrived on its connection; with every permit in such
// requests, nothing would come back to free one.
func TestPlugNotHeldWhileWaiting(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 2)
	e.disk.async, e.disk.delay = true, 50*time.Millisecond
	s := e.open(t, "plug-wait", paths(t, path1()), nil)
	if qd := s.QueueDepth(); qd != 2 {
		t.Fatalf("queue depth %d, the test needs 2", qd)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Permit 0 (the first IO connection) is kept aside for the other caller; permit 1 (the
	// second) goes to the plugged caller's first request, which the plug holds.
	reserved, ok := s.permits.tryGet()
	if !ok {
		t.Fatal("no permit")
	}
	dones := make(chan error, 3)
	done := func(err error) { dones <- err }
	s.Plug()
	if err := s.Request(ctx, Write, offHdr(0), make([]byte, 4096), done); err != nil {
		t.Fatal(err)
	}
	other := make(chan error, 1)
	s.beforePermitWait = func() {
		s.beforePermitWait = nil // once; on the waiting caller's goroutine only
		s.permits.put(reserved)
		if err := s.Request(ctx, Write, offHdr(8192), make([]byte, 4096), func(err error) { other <- err }); err != nil {
			other <- err
		}
	}
	waited := make(chan error, 1)
	go func() { waited <- s.Request(ctx, Write, offHdr(4096), make([]byte, 4096), done) }()
	select {
	case err := <-other:
		if err != nil {
			t.Fatalf("the other caller's request: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the other caller's request was held by a plug whose caller waits for a permit")
	}
	if err := <-waited; err != nil {
		t.Fatalf("the waiting caller's request: %v", err)
	}
	s.Unplug()
	for i := 0; i < 2; i++ {
		select {
		case err := <-dones:
			if err != nil {
				t.Fatalf("a plugged request: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a plugged request never finished")
		}
	}
}
