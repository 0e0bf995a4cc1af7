package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/stats"
)

// srvPath finds the server path whose client address is src.
func (e *env) srvPath(t testing.TB, src string) *SrvPath {
	t.Helper()
	for _, ss := range e.srv.Sessions() {
		for _, p := range ss.Paths() {
			if p.SrcAddr().String() == src {
				return p
			}
		}
	}
	t.Fatalf("no server path from %s", src)
	return nil
}

// TestFailoverMidIO kills one path's connections while IO runs on both: every request
// completes with the right data, the path that took the failed-over requests counts them, and
// the killed path reconnects by itself.
func TestFailoverMidIO(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 64)
	e.disk.async, e.disk.delay = true, time.Millisecond
	s := e.open(t, "fo", paths(t, path1(), path2()), nil)
	p1, p2 := s.Paths()[0], s.Paths()[1]
	model := make([]byte, len(e.disk.disk))
	done := make(chan struct{})
	go func() {
		defer close(done)
		randomIO(t, s, model, 4000, 48, 7)
	}()
	// Kill path 2 mid-IO from the client's side: its connections go to error at once.
	testutil.WaitFor(t, 10*time.Second, "IO in flight on path 2", func() bool {
		return p2.Stats.WriteCnt.Value()+p2.Stats.ReadCnt.Value() > 200 && p2.Inflight() >= 4
	})
	// Not under p2.mu: the soft provider may run the connection's completion handler from
	// ToError itself, and the handler takes p2.mu (the test hung so once in a full run).
	p2.mu.Lock()
	cons := append([]*con(nil), p2.cons...)
	p2.mu.Unlock()
	for _, c := range cons {
		c.qp.ToError()
	}
	<-done
	if p1.Stats.Failovered.Value() == 0 {
		t.Fatal("path 1 took no failed-over request")
	}
	testutil.WaitFor(t, 10*time.Second, "path 2 back", func() bool { return p2.State() == StateConnected })
	if p2.Stats.ReconnectOK.Value() != 1 {
		t.Fatalf("reconnects ok %d", p2.Stats.ReconnectOK.Value())
	}
	// IO uses both paths again.
	before := p2.Stats.WriteCnt.Value() + p2.Stats.ReadCnt.Value()
	randomIO(t, s, model, 1000, 32, 8)
	if p2.Stats.WriteCnt.Value()+p2.Stats.ReadCnt.Value() == before {
		t.Fatal("the reconnected path carries no IO")
	}
	e.disk.mu.Lock()
	defer e.disk.mu.Unlock()
	if string(model) != string(e.disk.disk) {
		t.Fatal("disk differs from the model")
	}
}

// TestAllPathsDown: with both paths gone, requests fail with ECONNABORTED and the session
// reports DISCONNECTED; when a path returns, RECONNECTED, and IO works again.
func TestAllPathsDown(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 32)
	events := make(chan LinkEvent, 16)
	s := e.open(t, "down", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), func(o *ClientOptions) {
		o.Timings.ReconnectDelay = 300 * time.Millisecond
		o.OnLinkEvent = func(ev LinkEvent) { events <- ev }
	})
	// The server drops both paths (its sysfs disconnect).
	e.srvPath(t, "ip:127.0.0.1").Disconnect()
	e.srvPath(t, "ip:127.0.0.2").Disconnect()
	select {
	case ev := <-events:
		if ev != LinkDisconnected {
			t.Fatalf("event %v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no DISCONNECTED event")
	}
	err := s.Do(context.Background(), Read, offHdr(0), make([]byte, 4096))
	if !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("request with no path: %v", err)
	}
	// A request refused at once is not also completed: its done is never called.
	var calls atomic.Int32
	for i := 0; i < 8; i++ {
		err = s.Request(context.Background(), Read, offHdr(0), make([]byte, 4096), func(error) { calls.Add(1) })
		if !errors.Is(err, syscall.ECONNABORTED) {
			t.Fatalf("async request with no path: %v", err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	if n := calls.Load(); n != 0 {
		t.Fatalf("done called %d times for requests refused with an error", n)
	}
	select {
	case ev := <-events:
		if ev != LinkReconnected {
			t.Fatalf("event %v", ev)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no RECONNECTED event")
	}
	if err := s.Do(context.Background(), Write, offHdr(4096), make([]byte, 4096)); err != nil {
		t.Fatalf("IO after reconnect: %v", err)
	}
}

// TestNoReconnect: max_reconnect_attempts 0 closes a failed path at the first attempt; a
// manual reconnect still brings it back.
func TestNoReconnect(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "norecon", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), func(o *ClientOptions) {
		o.MaxReconnectAttempts = 0
	})
	p := s.Paths()[1]
	e.srvPath(t, "ip:127.0.0.2").Disconnect()
	testutil.WaitFor(t, 5*time.Second, "path closed", func() bool { return p.State() == StateClosed })
	time.Sleep(200 * time.Millisecond)
	if p.State() != StateClosed || p.Stats.ReconnectOK.Value() != 0 {
		t.Fatalf("path %v after a failure with no reconnect allowed", p.State())
	}
	// As in the kernel, the reconnect attempt itself checks the limit: with 0 even a manual
	// reconnect closes the path again.
	if err := p.Reconnect(context.Background()); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("manual reconnect with max_reconnect_attempts 0: %v", err)
	}
	if err := s.SetMaxReconnectAttempts(-1); err != nil {
		t.Fatal(err)
	}
	if err := p.Reconnect(context.Background()); err != nil {
		t.Fatalf("manual reconnect: %v", err)
	}
	if p.State() != StateConnected {
		t.Fatal(p.State())
	}
}

// TestReconnectClosedSession: a reconnect of a closed session's path is ErrClosed and
// starts nothing (it used to reconnect the path for a session that was gone, its worker
// left running: a shell sitting in the session's directory could do it).
func TestReconnectClosedSession(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "closedrecon", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	p := s.Paths()[0]
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.Reconnect(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("reconnect of a closed session's path: %v", err)
	}
	if st := p.State(); st != StateClosed {
		t.Errorf("path %v", st)
	}
}

// TestHeartbeatLoss: a server whose connection 0 stops answering (hung, not closed) is
// detected by the client's heartbeat, and the path recovers once the server lets go.
func TestHeartbeatLoss(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "hb", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	p := s.Paths()[0]
	testutil.WaitFor(t, 5*time.Second, "a heartbeat round trip", func() bool { return p.CurLatency() > 0 })
	sp := e.srvPath(t, "ip:127.0.0.1")
	block := make(chan struct{})
	sp.mu.Lock()
	cq := sp.cons[0].cq
	sp.mu.Unlock()
	// Installed from its own goroutine: the handler runs at once and stays busy, so the
	// server never looks at connection 0's completions again, as a hung peer would.
	go cq.SetHandler(func() { <-block })
	start := time.Now()
	testutil.WaitFor(t, 5*time.Second, "heartbeat loss", func() bool { return p.State() != StateConnected })
	t.Logf("loss detected after %v (interval 50ms, 3 misses)", time.Since(start))
	close(block)
	testutil.WaitFor(t, 10*time.Second, "reconnect", func() bool { return p.State() == StateConnected })
	if err := s.Do(context.Background(), Write, offHdr(0), make([]byte, 512)); err != nil {
		t.Fatal(err)
	}
}

// TestAnyReceiveResetsMissedHeartbeats: on both sides any message received on a path, not
// only a heartbeat's answer, clears the count of heartbeats missed (rtrs_clt_rdma_done and
// rtrs_srv_rdma_done zero hb_missed_cnt on every receive). Heartbeats are made too rare to
// run here, so only the IO request and its response can clear the counts.
func TestAnyReceiveResetsMissedHeartbeats(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	e.srv.opts.Timings.HeartbeatInterval = time.Hour
	s := e.open(t, "hbreset", paths(t, path1()), func(o *ClientOptions) { o.Timings.HeartbeatInterval = time.Hour })
	p := s.Paths()[0]
	sp := e.srvPath(t, "ip:"+testAddr(1))
	for i := range 3 {
		p.hb.missed.Store(3)
		sp.hb.missed.Store(3)
		if err := s.Do(context.Background(), Write, offHdr(i*4096), make([]byte, 4096)); err != nil {
			t.Fatal(err)
		}
		// The request reached the server before its response reached the client, and Do
		// returned after that.
		if n := sp.hb.missed.Load(); n != 0 {
			t.Fatalf("server: %d heartbeats missed after a request arrived, want 0", n)
		}
		if n := p.hb.missed.Load(); n != 0 {
			t.Fatalf("client: %d heartbeats missed after a response arrived, want 0", n)
		}
	}
}

// TestStaleRkeyRefused: with always_invalidate, the key a client used for a chunk is dead
// once the request is answered; a write with it is a remote access error, the chunk is not
// touched, and the path recovers.
func TestStaleRkeyRefused(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 8)
	// Two paths: the other one keeps the session (and its chunks) while this one is down.
	s := e.open(t, "stale", paths(t, path1(), path2()), nil)
	olds := map[*Path]uint32{}
	for _, q := range s.Paths() {
		q.mu.Lock()
		olds[q] = q.rbufs[0].rkey.Load()
		q.mu.Unlock()
	}
	if err := s.Do(context.Background(), Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	// The path the write went on is the one whose key for chunk 0 changed.
	var p *Path
	var old, fresh uint32
	var addr uint64
	var c *con
	var res *pathRes
	for _, q := range s.Paths() {
		q.mu.Lock()
		if k := q.rbufs[0].rkey.Load(); k != olds[q] {
			p, old, fresh, addr, c, res = q, olds[q], k, q.rbufs[0].addr, q.cons[1], q.res
		}
		q.mu.Unlock()
	}
	if p == nil || fresh == old {
		t.Fatal("the chunk key did not change")
	}
	ss := e.srv.Sessions()[0]
	chunk := ss.Paths()[0].chunk(0) // one per session, whichever path
	// The handler took the disk lock after the chunk was filled: holding it orders this read.
	e.disk.mu.Lock()
	before := string(chunk[:64])
	e.disk.mu.Unlock()
	payload := make([]byte, 64)
	for i := range payload {
		payload[i] = 0xee
	}
	copy(res.iu.Bytes()[7*MaxHdrSize:], payload)
	if _, err := c.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(res.iu, 7*MaxHdrSize, 64)}, RemoteAddr: addr, RKey: old}}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "path down", func() bool { return p.State() != StateConnected })
	e.disk.mu.Lock()
	after := string(chunk[:64])
	e.disk.mu.Unlock()
	if after != before {
		t.Fatal("a stale key wrote into the chunk")
	}
	testutil.WaitFor(t, 10*time.Second, "reconnect", func() bool { return p.State() == StateConnected })
	if err := s.Do(context.Background(), Read, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
}

// TestReconnectOneAttempt: a manual reconnect (the path's reconnect file) returns once the
// attempt it asked for has failed, with ENOTCONN, as the kernel's write does, and leaves the
// path reconnecting: it used to wait for the worker, which with unlimited attempts ends only
// when the server is back.
func TestReconnectOneAttempt(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "oneshot", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), func(o *ClientOptions) { o.MaxReconnectAttempts = -1 })
	p := s.Paths()[0]
	addr := e.srv.Addr()
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "path down", func() bool { return p.State() != StateConnected })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	fails := p.Stats.ReconnectFail.Value()
	if err := p.Reconnect(ctx); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("manual reconnect with no server: %v, want ENOTCONN", err)
	}
	if got := p.Stats.ReconnectFail.Value(); got <= fails {
		t.Fatalf("reconnect failures %d → %d: the write returned before its attempt", fails, got)
	}
	if st := p.State(); st == StateClosed || st == StateConnected {
		t.Fatalf("path %v after a failed manual reconnect, want it still reconnecting", st)
	}
	o := DefaultServerOptions()
	o.Provider, o.Handler, o.Timings, o.Addr, o.QueueDepth, o.AlwaysInvalidate = e.prov, e.disk, Timings(testutil.FastTimings()), addr, 16, false
	srv2, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	testutil.WaitFor(t, 10*time.Second, "reconnected on its own", func() bool { return p.State() == StateConnected })
	reconnect(t, ctx, p) // with the server back
	if err := s.Do(ctx, Read, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
}

// TestServerRestartedOtherwise: a server restarted with always_invalidate switched and larger
// chunks is reconnected to, as the kernel's client does (it takes the flags of each path's
// connection 0 afresh), and the session's largest IO still goes through; one restarted with
// smaller chunks, which would not take that IO, is refused, and the path keeps trying. Both
// used to be refused for good.
func TestServerRestartedOtherwise(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "otherwise", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), func(o *ClientOptions) { o.MaxReconnectAttempts = -1 })
	p := s.Paths()[0]
	addr := e.srv.Addr()
	max := s.MaxIOSize()
	restart := func(old *Server, inv bool, chunk int) *Server {
		t.Helper()
		if err := old.Close(); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 5*time.Second, "path down", func() bool { return p.State() != StateConnected })
		o := DefaultServerOptions()
		o.Provider, o.Handler, o.Timings, o.Addr, o.QueueDepth = e.prov, e.disk, Timings(testutil.FastTimings()), addr, 16
		o.AlwaysInvalidate, o.ChunkSize = inv, chunk
		srv, err := NewServer(o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = srv.Close() })
		return srv
	}
	srv := restart(e.srv, true, 2*DefaultChunkSize)
	testutil.WaitFor(t, 10*time.Second, "reconnected to a server with always_invalidate on and 256 KiB chunks", func() bool { return p.State() == StateConnected })
	data := bytes.Repeat([]byte{0x5a}, max)
	if err := s.Do(context.Background(), Write, offHdr(0), data); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, max)
	if err := s.Do(context.Background(), Read, offHdr(0), got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back after the restart: %v, equal %v", err, bytes.Equal(got, data))
	}
	restart(srv, false, DefaultChunkSize/2)
	fails := p.Stats.ReconnectFail.Value()
	testutil.WaitFor(t, 10*time.Second, "refusals of a server with smaller chunks", func() bool { return p.Stats.ReconnectFail.Value() >= fails+3 })
	if st := p.State(); st == StateConnected || st == StateClosed {
		t.Fatalf("path %v with a server whose chunks are smaller, want it reconnecting", st)
	}
	_ = s.Close()
}

// TestQueueDepthChange: a server that comes back with another queue depth gets no automatic
// reconnects from that path (the kernel logs "queue depth changed" and stops).
func TestQueueDepthChange(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "qdchange", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	p := s.Paths()[0]
	addr := e.srv.Addr()
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "path down", func() bool { return p.State() != StateConnected })
	o := DefaultServerOptions()
	o.Provider, o.Handler, o.Timings, o.Addr, o.QueueDepth = e.prov, e.disk, Timings(testutil.FastTimings()), addr, 32
	srv2, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	testutil.WaitFor(t, 10*time.Second, "path closed", func() bool { return p.State() == StateClosed })
	time.Sleep(300 * time.Millisecond)
	if p.State() != StateClosed || p.Stats.ReconnectOK.Value() != 0 || p.Stats.ReconnectFail.Value() == 0 {
		t.Fatalf("path %v, reconnects %s", p.State(), p.Stats.Reconnects())
	}
}

// TestChunkReuseRefused: a request into a chunk whose request is not answered yet is a
// protocol violation (a client reuses a chunk only after its response), refused with the
// path closed: served, it would hand the same request up again, each copy held until
// answered, for as long as the client kept sending. The request in flight is served once on
// that path and fails over to the other.
func TestChunkReuseRefused(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 8)
	e.disk.async, e.disk.delay = true, 2*time.Second
	s := e.open(t, "reuse", paths(t, path1(), path2()), nil)
	done := make(chan error, 1)
	go func() { done <- s.Do(context.Background(), Write, offHdr(0), make([]byte, 4096)) }()
	var sp *SrvPath
	id := -1
	testutil.WaitFor(t, 5*time.Second, "the write in flight at the server", func() bool {
		for _, q := range e.srv.Sessions()[0].Paths() {
			for i := range q.reqs {
				if q.reqs[i].busy.Load() {
					sp, id = q, i
					return true
				}
			}
		}
		return false
	})
	var p *Path
	for _, q := range s.Paths() {
		if q.SrcAddr().IP == sp.SrcAddr().IP {
			p = q
		}
	}
	if p == nil {
		t.Fatalf("no client path from %v", sp.SrcAddr())
	}
	p.mu.Lock()
	c, rb := p.cons[1], &p.rbufs[id]
	p.mu.Unlock()
	before := e.srv.Refused()["malformed request"]
	// The same chunk and header offset (the data, then the 8-byte user header) as the write:
	// a server that took it would serve the write a second time.
	if _, err := c.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpRDMAWriteWithImm, Imm: IOReqImm(uint32(id), 4096+8, MemBits(8)),
		RemoteAddr: rb.addr, RKey: rb.rkey.Load()}}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the refusal", func() bool { return e.srv.Refused()["malformed request"] > before })
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the write, failed over: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the write never ended")
	}
	e.disk.mu.Lock()
	n := e.disk.reqs[sp.Name()]
	e.disk.mu.Unlock()
	if n != 1 {
		t.Fatalf("the path that was refused served %d requests, want 1 (the reused chunk's is not served again)", n)
	}
}

// TestPDsFreed: every protection domain the client and the server allocate for a path is
// freed when the path goes, reconnects included (the verbs provider's are kernel objects,
// 32k of them on rxe: a flapping link would use them all up).
func TestPDsFreed(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	sp, ok := e.prov.(*soft.Provider)
	if !ok {
		t.Skip("counts the soft provider's PDs")
	}
	s := e.open(t, "pds", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), nil)
	p := s.Paths()[1]
	base := sp.LivePDs() // one per path on each side
	if base != 4 {
		t.Fatalf("%d PDs for two paths, client and server", base)
	}
	for i := 0; i < 5; i++ {
		e.srvPath(t, "ip:127.0.0.2").Disconnect()
		testutil.WaitFor(t, 5*time.Second, "path 2 down", func() bool { return p.State() != StateConnected })
		testutil.WaitFor(t, 10*time.Second, "path 2 back", func() bool { return p.State() == StateConnected })
		if err := s.Do(context.Background(), Write, offHdr(4096), make([]byte, 4096)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, 5*time.Second, "the PDs of the reconnects freed", func() bool { return sp.LivePDs() == base })
	s.Close()
	testutil.WaitFor(t, 5*time.Second, "every PD freed after the close", func() bool { return sp.LivePDs() == 0 })
}

// TestIdleHeartbeatsKeepPath: an idle path's heartbeats and their acks, thousands of them,
// never fill connection 0's send queue. On hardware (and rxe) an unsignaled send's slot is
// freed only by a later signaled one: heartbeats posted unsignaled on an idle path filled
// the queue after about a thousand, and the failed post closed a healthy path.
func TestIdleHeartbeatsKeepPath(t *testing.T) {
	leakcheck.Check(t)
	hb := func(tm *Timings) { tm.HeartbeatInterval, tm.HeartbeatMissed = 2*time.Millisecond, 1000 }
	e := newLimitedEnv(t, func(o *ServerOptions) { o.QueueDepth = 16; hb(&o.Timings) })
	s := e.open(t, "idlehb", paths(t, path1()), func(o *ClientOptions) { hb(&o.Timings) })
	p := s.Paths()[0]
	sp := e.srvPath(t, "ip:"+testAddr(1))
	start := time.Now()
	for time.Since(start) < 4*time.Second {
		if p.State() != StateConnected || sp.State() != "connected" {
			t.Fatalf("idle path went %v (server %v) after %v of heartbeats every 2 ms", p.State(), sp.State(), time.Since(start))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := p.Stats.ReconnectOK.Value() + p.Stats.ReconnectFail.Value(); n != 0 {
		t.Fatalf("%d reconnects of an idle path", n)
	}
	if err := s.Do(context.Background(), Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
}

// TestDeepServerQueue: a server of queue depth 1024 (the kernel's module parameter allows
// far more than its default of 512) is opened: the IO connections of the first connect are
// sized by the depth connection 0 was told, not by the default's 3 × 512 + 1 receives.
func TestDeepServerQueue(t *testing.T) {
	leakcheck.Check(t)
	e := newLimitedEnv(t, func(o *ServerOptions) { o.QueueDepth, o.ChunkSize = 1024, 8<<10 })
	s := e.open(t, "deep", paths(t, path1()), nil)
	if qd := s.QueueDepth(); qd != 1024 {
		t.Fatalf("queue depth %d", qd)
	}
	if err := s.Do(context.Background(), Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
}

// holdOnce is a server handler that never answers the first request for offset 1 MiB (every
// one, with all) and hands everything else to the disk.
type holdOnce struct {
	Handler
	all  bool
	mu   sync.Mutex
	held []*SrvRequest
}

func (h *holdOnce) Request(r *SrvRequest) {
	h.mu.Lock()
	hold := (h.all || len(h.held) == 0) && len(r.Usr) == 8 && binary.LittleEndian.Uint64(r.Usr) == 1<<20
	if hold {
		h.held = append(h.held, r)
	}
	h.mu.Unlock()
	if !hold {
		h.Handler.Request(r)
	}
}

// TestDoDeadline: a request the server never answers, on a path whose heartbeats go on,
// ends after its caller's deadline and a connect timeout's grace: Do recovers the path that
// holds it, which fails it over to the other path, where it is answered.
func TestDoDeadline(t *testing.T) {
	leakcheck.Check(t)
	h := &holdOnce{}
	e := newLimitedEnv(t, func(o *ServerOptions) { h.Handler = o.Handler; o.Handler = h })
	s := e.open(t, "deadline", paths(t, path1(), path2()), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	held, err := doHeld(t, ctx, h, s, 10*time.Second)
	if err != nil {
		t.Fatalf("the request held on one path, failed over: %v", err)
	}
	if len(held) != 1 {
		t.Fatalf("%d requests held", len(held))
	}
	defer held[0].Respond(0) // into the void: its path is gone; the server's close waits no more
	down := uint64(0)
	for _, p := range s.Paths() {
		down += p.Stats.Down[stats.DownHeartbeat].Value()
	}
	if down != 1 {
		t.Fatalf("%d paths recovered for the unanswered request, want 1", down)
	}
	// A request whose caller's deadline has passed, to a server that answers, is answered:
	// no path is recovered for it.
	if err := s.Do(ctx, Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatalf("a request whose deadline passed, to a server that answers: %v", err)
	}
	after := uint64(0)
	for _, p := range s.Paths() {
		after += p.Stats.Down[stats.DownHeartbeat].Value()
	}
	if after != down {
		t.Fatalf("%d more paths recovered for a request the server answered", after-down)
	}
}

// doHeld runs a Do of the request h holds (offset 1 MiB) with ctx, and returns its outcome
// and the copies of it h holds then; it fails the test if Do has not returned within d.
func doHeld(t *testing.T, ctx context.Context, h *holdOnce, s *Session, d time.Duration) ([]*SrvRequest, error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Do(ctx, Write, offHdr(1<<20), make([]byte, 4096)) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(d):
		t.Fatalf("Do still waits %v after its deadline", d)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*SrvRequest(nil), h.held...), err
}

// TestDoDeadlineBounded: a request that no path's server answers, while their heartbeats go
// on, is sent again once after its caller's deadline, then ends with ETIMEDOUT: with paths
// that come back before the next recovery it bounced between them for ever (and with it an
// unmap's CLOSE, a daemon's stop).
func TestDoDeadlineBounded(t *testing.T) {
	leakcheck.Check(t)
	h := &holdOnce{all: true}
	e := newLimitedEnv(t, func(o *ServerOptions) { h.Handler = o.Handler; o.Handler = h })
	s := e.open(t, "bounded", paths(t, path1(), path2()), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	held, err := doHeld(t, ctx, h, s, 30*time.Second)
	if !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("a request no server answers: %v, want ETIMEDOUT", err)
	}
	if len(held) != 2 {
		t.Fatalf("the request was sent %d times, want 2", len(held))
	}
	for _, r := range held {
		defer r.Respond(0)
	}
	testutil.WaitFor(t, 10*time.Second, "both paths back", func() bool {
		for _, p := range s.Paths() {
			if p.State() != StateConnected {
				return false
			}
		}
		return true
	})
	if err := s.Do(context.Background(), Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatalf("the permit after: %v", err)
	}
}

// TestLateInvalidation: on a device that executes LOCAL_INV after the post (an HCA; here the
// soft provider reporting itself as one), a READ whose key the server did not invalidate is
// finished from its LOCAL_INV's completion, not before; those whose completion a path's
// failure flushes are finished from the flush, or by the path's teardown when its handlers
// had stopped first (a reconnect). IO with one path killed mid-run completes with the right
// data, no request is left waiting for an invalidation, and every permit serves after.
func TestLateInvalidation(t *testing.T) {
	leakcheck.Check(t)
	// The server leaves READ keys valid, so that READs take the path too (ours invalidates
	// them with SEND_WITH_INV otherwise, and the kernel's does).
	keepClientKeys = true
	defer func() { keepClientKeys = false }()
	for _, c := range []struct {
		inv  bool
		kill string
	}{{false, "qp error"}, {false, "reconnect"}, {true, "reconnect"}} {
		name := fmt.Sprintf("always_invalidate=%v, %s", c.inv, c.kill)
		e := newProvEnv(t, soft.New(soft.Options{LateLocalOps: true}), func(o *ServerOptions) { o.AlwaysInvalidate, o.QueueDepth = c.inv, 64 })
		e.disk.async, e.disk.delay = true, time.Millisecond
		s := e.open(t, "late", paths(t, path1(), path2()), nil)
		p2 := s.Paths()[1]
		model := make([]byte, len(e.disk.disk))
		done := make(chan struct{})
		go func() {
			defer close(done)
			randomIO(t, s, model, 3000, 48, 9)
		}()
		testutil.WaitFor(t, 10*time.Second, "IO in flight on path 2", func() bool {
			return p2.Stats.ReadCnt.Value() > 200 && p2.Inflight() >= 4
		})
		if c.kill == "reconnect" {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			reconnect(t, ctx, p2)
			cancel()
		} else {
			p2.mu.Lock()
			cons := append([]*con(nil), p2.cons...)
			p2.mu.Unlock()
			for _, c := range cons {
				c.qp.ToError()
			}
		}
		<-done
		for i := range s.reqs {
			if s.reqs[i].inv.Load() != nil {
				t.Fatalf("%s: request %d still waits for its key's invalidation", name, i)
			}
		}
		testutil.WaitFor(t, 10*time.Second, "path 2 back", func() bool { return p2.State() == StateConnected })
		randomIO(t, s, model, 1000, s.QueueDepth(), 10)
		e.disk.mu.Lock()
		same := string(model) == string(e.disk.disk)
		e.disk.mu.Unlock()
		if !same {
			t.Fatalf("%s: disk differs from the model", name)
		}
		_ = s.Close()
	}
}
