package transport

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// TestEarlyResponseDuringPost: a response for a message id that comes while the client's
// post of that request is still running (only a hostile server can send it before the
// request has left) does not finish the request under PostSend, where its permit, header
// and work requests could be taken by the next request; it is finished once, after the post
// has returned, and the session goes on. For a READ the key the post registered over the
// caller's buffer is taken back before the buffer is handed back: the server cannot write
// into it afterwards.
func TestEarlyResponseDuringPost(t *testing.T) {
	for _, dir := range []Dir{Write, Read} {
		t.Run(dir.String(), func(t *testing.T) { testEarlyResponse(t, dir) })
	}
}

func testEarlyResponse(t *testing.T, dir Dir) {
	leakcheck.Check(t)
	e := newEnv(t, false, 8)
	// The real request's answer comes late: an honest server's SEND_WITH_INV would take
	// the READ's key back by itself.
	e.disk.async, e.disk.delay = true, 3*time.Second
	s := e.open(t, "early", paths(t, path1()), nil)
	sp := e.srvPath(t, "ip:"+testAddr(1))
	var calls atomic.Int32
	var inWindow int32 = -1
	permit := -1
	s.beforePost = func(pm, cid int) {
		s.beforePost = nil // once; read and written on the caller's goroutine only
		permit = pm
		forgeResponse(t, s, sp, pm, cid)
		inWindow = calls.Load()
	}
	finished := make(chan error, 2)
	err := s.Request(context.Background(), dir, offHdr(0), make([]byte, 4096), func(err error) {
		calls.Add(1)
		finished <- err
	})
	if err != nil {
		t.Fatal(err)
	}
	if inWindow != 0 {
		t.Fatalf("the request was finished %d times while its post ran", inWindow)
	}
	select {
	case err := <-finished:
		if err != nil {
			t.Errorf("the request's outcome: %v (the forged response said 0)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request was never finished")
	}
	if dir == Read {
		p := s.Paths()[0]
		p.mu.Lock()
		fr := p.res.fr[permit]
		p.mu.Unlock()
		if fr.Valid() {
			t.Fatal("the buffer handed back to the caller can still be written by the server")
		}
	}
	// The real response, stale by now, finishes nothing: for a WRITE it is dropped; for a
	// READ its data meets the taken-back key, a remote access error that takes the
	// connection down, and the path reconnects.
	time.Sleep(e.disk.delay + 200*time.Millisecond)
	if n := calls.Load(); n != 1 {
		t.Fatalf("done called %d times", n)
	}
	p := s.Paths()[0]
	testutil.WaitFor(t, 10*time.Second, "the path connected", func() bool { return p.State() == StateConnected })
	if err := s.Do(context.Background(), Write, offHdr(4096), make([]byte, 4096)); err != nil {
		t.Fatalf("the next request: %v", err)
	}
}

// forgeResponse has the server's end of connection cid answer message pm with success at
// once, before the request has been sent, and waits for the client to take the answer.
func forgeResponse(t *testing.T, s *Session, sp *SrvPath, pm, cid int) {
	sp.mu.Lock()
	c := sp.cons[cid]
	sp.mu.Unlock()
	// The server's end is ready once the client's RTU has reached it.
	testutil.WaitFor(t, 5*time.Second, "the server's connection ready", func() bool { return c.qp.State() == rdma.QPSRTS })
	if _, err := c.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpRDMAWriteWithImm, Imm: IORspImm(uint32(pm), 0, false)}}); err != nil {
		t.Errorf("the forged response: %v", err)
		return
	}
	r := &s.reqs[pm]
	// Taken, and left to the post: the window this is for.
	testutil.WaitFor(t, 5*time.Second, "the forged response taken", func() bool {
		return r.owner.Load() == nil && r.posting.Load() == postPosting|postAnswered
	})
	time.Sleep(100 * time.Millisecond) // what else the completion goroutine does with it
}
