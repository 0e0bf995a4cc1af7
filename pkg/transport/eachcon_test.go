package transport

import (
	"sync"
	"testing"
	"time"
)

// TestEachConAtOnce: a path's close runs its connections' teardown at once, each of which
// may wait its write deadline for a peer that does not read (one after another, a path of
// 257 connections took minutes): here every call waits for all the others to have begun,
// which only calls made at once get past.
func TestEachConAtOnce(t *testing.T) {
	cons := []*con{{cid: 0}, nil, {cid: 2}, {cid: 3}, {cid: 4}}
	var started sync.WaitGroup
	started.Add(4)
	all := make(chan struct{})
	go func() { started.Wait(); close(all) }()
	var mu sync.Mutex
	seen := map[int]bool{}
	done := make(chan struct{})
	go func() {
		eachCon(cons, func(c *con) {
			started.Done()
			<-all
			mu.Lock()
			seen[c.cid] = true
			mu.Unlock()
		})
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the teardowns ran one after another")
	}
	if len(seen) != 4 || seen[1] {
		t.Fatalf("connections torn down: %v", seen)
	}
}
