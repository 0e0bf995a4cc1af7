package transport

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"
)

// TestRemoveThenAddPath: removing a path and adding the same one right away (what
// `rnbd client path readd` does) always works, though the server may still be closing the old
// path when the new one connects.
func TestRemoveThenAddPath(t *testing.T) {
	e := newEnv(t, true, 16)
	s := e.open(t, "readd", paths(t, path1(), path2()), func(o *ClientOptions) { o.ConPerPath = 2 })
	pa := paths(t, path2())[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i := range 200 {
		var p *Path
		for _, q := range s.Paths() {
			if q.Name() == path2() {
				p = q
			}
		}
		if p == nil {
			t.Fatalf("round %d: the path is gone", i)
		}
		p.Remove()
		if _, err := s.AddPath(ctx, pa); err != nil {
			t.Fatalf("round %d: add after remove: %v", i, err)
		}
	}
	if n := len(s.Paths()); n != 2 {
		t.Fatalf("%d paths after the rounds", n)
	}
}

// TestAddPathServerEEXIST: a server's EEXIST for a path to an address the session did not
// just remove is its answer (the kernel's gives it for a path of a second address family),
// returned at once as the kernel's client returns it, not retried for a connect timeout.
func TestAddPathServerEEXIST(t *testing.T) {
	e := newEnv(t, true, 16)
	s := e.open(t, "eexist", paths(t, path1()), nil)
	// No source: the client cannot see before connecting that it is path1 again.
	pa := PathAddrs{Dst: paths(t, path1())[0].Dst}
	t0 := time.Now()
	_, err := s.AddPath(context.Background(), pa)
	if !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("a second path from the same address: %v, want EEXIST", err)
	}
	if d := time.Since(t0); d >= s.opts.Timings.ConnectTimeout {
		t.Fatalf("EEXIST after %v: retried as if the path had just been removed: %v", d, err)
	}
}
