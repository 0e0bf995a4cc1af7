package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// replyDisk serves requests on the connection's goroutine and leaves their responses to a
// goroutine that answers them in rounds through one Replies, as direct IO's reaper does.
type replyDisk struct {
	*memDisk
	done chan *SrvRequest
	errs chan int // each request's errno, beside it in done

	mu                 sync.Mutex
	rounds, multiCon   int // rounds flushed; with responses on more than one connection
	maxRound, answered int // most responses in one round; all of them
}

func (d *replyDisk) Request(r *SrvRequest) {
	errno := 0
	off := int(binary.LittleEndian.Uint64(r.Usr))
	d.memDisk.mu.Lock()
	if off < 0 || off+len(r.Data) > len(d.disk) {
		errno = -5
	} else if r.Dir == Write {
		copy(d.disk[off:], r.Data)
	} else {
		copy(r.Data, d.disk[off:])
	}
	d.memDisk.mu.Unlock()
	d.errs <- errno
	d.done <- r
}

// answer answers what has come in, in rounds, until stop is closed.
func (d *replyDisk) answer(stop <-chan struct{}) {
	var rep Replies
	for {
		var r *SrvRequest
		select {
		case r = <-d.done:
		case <-stop:
			return
		}
		n := 0
		for r != nil {
			rep.Respond(r, <-d.errs)
			n++
			select {
			case r = <-d.done:
			default:
				r = nil
			}
		}
		cons := len(rep.cons)
		rep.Flush()
		if len(rep.cons) != 0 {
			panic("Flush left connections behind")
		}
		d.mu.Lock()
		d.rounds++
		d.answered += n
		d.maxRound = max(d.maxRound, n)
		if cons > 1 {
			d.multiCon++
		}
		d.mu.Unlock()
	}
}

// TestReplies: responses gathered in a Replies and posted a round at a time, each round over
// several connections of two paths, all reach the client with the right data.
func TestReplies(t *testing.T) {
	leakcheck.Check(t)
	d := &replyDisk{memDisk: newMemDisk(8 << 20), done: make(chan *SrvRequest, 256), errs: make(chan int, 256)}
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Handler, o.QueueDepth = d, 64 })
	e.disk = d.memDisk
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); d.answer(stop) }()
	defer func() { close(stop); wg.Wait() }()
	for _, inv := range []bool{false, true} {
		e.srv.opts.AlwaysInvalidate = inv
		s := e.open(t, "replies", paths(t, path1(), path2()), func(o *ClientOptions) { o.ConPerPath = 2 })
		model := make([]byte, len(d.disk))
		d.memDisk.mu.Lock()
		copy(model, d.disk)
		d.memDisk.mu.Unlock()
		randomIO(t, s, model, 3000, 48, 11)
		d.memDisk.mu.Lock()
		same := bytes.Equal(model, d.disk)
		d.memDisk.mu.Unlock()
		if !same {
			t.Fatalf("always_invalidate %v: the disk differs from the model", inv)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	t.Logf("%d responses in %d rounds, at most %d in one, %d rounds over more than one connection", d.answered, d.rounds, d.maxRound, d.multiCon)
	if d.maxRound < 2 || d.multiCon == 0 {
		t.Fatalf("no round gathered responses on several connections (at most %d in one, %d rounds over more than one connection)", d.maxRound, d.multiCon)
	}
}

// TestRepliesHeldAcrossClose: a path's close waits for the responses a Replies holds, and a
// response gathered after the path began to close is dropped and counted as ended, so that
// the close returns once the held ones are flushed.
func TestRepliesHeldAcrossClose(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	d := &holdDisk{memDisk: e.disk, held: make(chan *SrvRequest, 16), order: make(chan string, 16)}
	e.srv.opts.Handler = d
	s := e.open(t, "held", paths(t, path1()), func(o *ClientOptions) { o.ConPerPath = 1 })
	d.holdPath.Store(s.Paths()[0].Name())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ended := make(chan error, 2)
	for i := range 2 {
		buf := make([]byte, 4096)
		if err := s.Request(ctx, Read, offHdr(i*4096), buf, func(err error) { ended <- err }); err != nil {
			t.Fatal(err)
		}
	}
	var reqs [2]*SrvRequest
	for i := range reqs {
		select {
		case reqs[i] = <-d.held:
		case <-ctx.Done():
			t.Fatal("requests did not arrive")
		}
	}
	var rep Replies
	rep.Respond(reqs[0], 0)
	p := reqs[0].Path()
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	for p.live.Load() {
		time.Sleep(time.Millisecond)
	}
	rep.Respond(reqs[1], 0) // dropped: the path is closing
	select {
	case <-closed:
		t.Fatal("the path closed with a response held in a Replies")
	case <-time.After(200 * time.Millisecond):
	}
	rep.Flush()
	select {
	case <-closed:
	case <-ctx.Done():
		t.Fatal("the path did not close after the flush")
	}
	_ = s.Close()
	for range 2 {
		select {
		case <-ended:
		case <-ctx.Done():
			t.Fatal("a request never ended at the client")
		}
	}
}
