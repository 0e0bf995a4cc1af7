package transport

import (
	"context"
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
