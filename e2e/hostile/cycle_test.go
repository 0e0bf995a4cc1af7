package hostile

import (
	"context"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestDeadlineCycle: the server answers heartbeats and reconnects, never one request. Do's
// context ends; ConnectTimeout later the path holding the request is recovered and the
// request fails over to the other path; ConnectTimeout later that one is recovered, and by
// then the first has reconnected (ReconnectDelay < ConnectTimeout here; with the defaults,
// 30 s and 30 s + 1 s backoff, the same happens with three paths). The request used to go
// back and forth for ever; now it ends with ETIMEDOUT after its second path.
func TestDeadlineCycle(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	var n atomic.Int32
	s.onReq = func(r *req) { n.Add(1) } // never answered
	sess := open(t, s, 2, func(o *transport.ClientOptions) {
		o.Paths = []transport.PathAddrs{{Dst: dstN(t, 1)}, {Dst: dstN(t, 2)}}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	ret := make(chan error, 1)
	go func() { ret <- sess.Do(ctx, transport.Read, []byte("usr"), make([]byte, 4096)) }()
	select {
	case err := <-ret:
		if !errors.Is(err, syscall.ETIMEDOUT) || n.Load() != 2 {
			t.Fatalf("Do returned %v after the request was sent %d times, want ETIMEDOUT after 2", err, n.Load())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("Do (1 s deadline, ConnectTimeout 2 s) still waiting after 20 s; the request was sent %d times, each time taking a path down", n.Load())
	}
}
