package transport

import (
	"context"
	"errors"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"net/netip"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// holdDisk answers requests like memDisk, except those of one path, which it keeps until
// released.
type holdDisk struct {
	*memDisk
	holdPath atomic.Value // string
	held     chan *SrvRequest
	order    chan string
}

func (d *holdDisk) Request(r *SrvRequest) {
	select {
	case d.order <- r.Path().Name():
	default:
	}
	if hp, _ := d.holdPath.Load().(string); r.Path().Name() == hp {
		d.held <- r
		return
	}
	d.memDisk.Request(r)
}

func TestPolicies(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 32)
	hd := &holdDisk{memDisk: e.disk, held: make(chan *SrvRequest, 64), order: make(chan string, 1024)}
	e.srv.opts.Handler = hd
	s := e.open(t, "pol", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), nil)
	ctx := context.Background()
	names := []string{s.Paths()[0].Name(), s.Paths()[1].Name()}
	drain := func() []string {
		var out []string
		for {
			select {
			case n := <-hd.order:
				out = append(out, n)
			default:
				return out
			}
		}
	}

	t.Run("round-robin alternates", func(t *testing.T) {
		if err := s.SetPolicy(RoundRobin); err != nil {
			t.Fatal(err)
		}
		drain()
		for i := 0; i < 20; i++ {
			if err := s.Do(ctx, Write, offHdr(0), make([]byte, 512)); err != nil {
				t.Fatal(err)
			}
		}
		got := drain()
		for i := 1; i < len(got); i++ {
			if got[i] == got[i-1] {
				t.Fatalf("round-robin sent two in a row to %s: %v", got[i], got)
			}
		}
	})

	t.Run("min-inflight avoids a busy path", func(t *testing.T) {
		if err := s.SetPolicy(MinInflight); err != nil {
			t.Fatal(err)
		}
		// Path 0 keeps its requests unanswered. With both paths idle the request goes to
		// path 0, which is then the busier one.
		hd.holdPath.Store(names[0])
		released := false
		release := func() {
			if released {
				return
			}
			released = true
			hd.holdPath.Store("")
			for len(hd.held) > 0 {
				(<-hd.held).Respond(0)
			}
		}
		defer release()
		if err := s.Request(ctx, Read, offHdr(0), make([]byte, 512), func(error) {}); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 5*time.Second, "the request held", func() bool { return len(hd.held) == 1 })
		drain()
		for i := 0; i < 20; i++ {
			if err := s.Do(ctx, Write, offHdr(0), make([]byte, 512)); err != nil {
				t.Fatal(err)
			}
		}
		for _, n := range drain() {
			if n == names[0] {
				t.Fatal("min-inflight sent a request to the busy path")
			}
		}
		release()
		testutil.WaitFor(t, 5*time.Second, "held requests answered", func() bool { return s.Paths()[0].Inflight() == 0 })
	})

	t.Run("min-latency prefers the faster path", func(t *testing.T) {
		// Path 1's server answers heartbeats 5 ms late.
		sp := e.srvPath(t, "ip:127.0.0.2")
		sp.mu.Lock()
		c := sp.cons[0]
		sp.mu.Unlock()
		var wc [16]rdma.WC
		c.cq.SetHandler(func() { time.Sleep(5 * time.Millisecond); sp.onCompletions(c, wc[:]) })
		p0, p1 := s.Paths()[0], s.Paths()[1]
		testutil.WaitFor(t, 5*time.Second, "latencies", func() bool {
			return p1.CurLatency() > 4*time.Millisecond && p0.CurLatency() > 0 && p0.CurLatency() < 2*time.Millisecond
		})
		if err := s.SetPolicy(MinLatency); err != nil {
			t.Fatal(err)
		}
		drain()
		for i := 0; i < 20; i++ {
			if err := s.Do(ctx, Write, offHdr(0), make([]byte, 512)); err != nil {
				t.Fatal(err)
			}
		}
		for _, n := range drain() {
			if n != names[0] {
				t.Fatalf("min-latency used the slow path (%v vs %v)", p1.CurLatency(), p0.CurLatency())
			}
		}
	})
	if err := s.SetPolicy(Policy(7)); !errors.Is(err, syscall.EINVAL) {
		t.Fatal("unknown policy accepted")
	}
}

// rawConnect sends one connection request with the given private data and returns the
// errno of the server's reject (0 if accepted).
func rawConnect(t *testing.T, e *env, data []byte) int16 {
	t.Helper()
	return rawConnectFrom(t, e, netip.Addr{}, data)
}

// rawConnectFrom is rawConnect from source address src (unset: the route's).
func rawConnectFrom(t *testing.T, e *env, src netip.Addr, data []byte) int16 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	id := rawIDFrom(t, e, src)
	_, err := id.Connect(ctx, rdma.ConnParam{PrivateData: data})
	if err == nil {
		return 0
	}
	r, ok := rdma.IsReject(err)
	if !ok {
		t.Fatalf("connect: %v", err)
	}
	var m MsgConnRsp
	if m.Unmarshal(r.PrivateData) != nil {
		t.Fatalf("reject without conn_rsp: %x", r.PrivateData)
	}
	return m.Errno
}

// rawID is a connection identifier with a QP, resolved to the server, destroyed at cleanup.
func rawID(t *testing.T, e *env) rdma.ConnID { t.Helper(); return rawIDFrom(t, e, netip.Addr{}) }

// rawIDFrom is rawID bound to source address src.
func rawIDFrom(t *testing.T, e *env, src netip.Addr) rdma.ConnID {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	id, err := e.prov.ResolveAddr(ctx, src, e.srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := id.Device().AllocPD()
	cq, _ := id.Device().CreateCQ(8)
	t.Cleanup(func() { _ = id.Destroy(); _ = cq.Destroy() })
	if _, err := id.CreateQP(pd, rdma.QPInitAttr{SendCQ: cq, RecvCQ: cq, MaxSendWR: 4, MaxRecvWR: 4}); err != nil {
		t.Fatal(err)
	}
	return id
}

func TestServerRejects(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	s := e.open(t, "rej", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	ctx := context.Background()

	// ENXIO: a path that does not create its session, for a session the server lacks.
	m := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: uuid.New()}
	if got := rawConnect(t, e, m.Marshal()); got != -int16(syscall.ENXIO) {
		t.Errorf("unknown session: errno %d", got)
	}
	// ECONNRESET: malformed requests.
	bad := m
	bad.FirstConn, bad.Cid, bad.CidNum = true, 2, 2
	if got := rawConnect(t, e, bad.Marshal()); got != -int16(syscall.ECONNRESET) {
		t.Errorf("cid ≥ cid_num: errno %d", got)
	}
	big := m
	big.FirstConn, big.CidNum = true, MaxConnsPerPath+1
	if got := rawConnect(t, e, big.Marshal()); got != -int16(syscall.ECONNRESET) {
		t.Errorf("cid_num > 4096: errno %d", got)
	}
	magic := m.Marshal()
	magic[2] = 0
	if got := rawConnect(t, e, magic); got != -int16(syscall.ECONNRESET) {
		t.Errorf("bad magic: errno %d", got)
	}
	if got := rawConnect(t, e, []byte{1, 2, 3}); got != -int16(syscall.ECONNRESET) {
		t.Errorf("short private data: errno %d", got)
	}
	// ECONNRESET: a connection slot of a connected path.
	p := s.Paths()[0]
	dup := MsgConnReq{Cid: 1, CidNum: 3, SessUUID: p.uuid, PathsUUID: s.pathsUUID, FirstConn: true}
	if got := rawConnect(t, e, dup.Marshal()); got != -int16(syscall.ECONNRESET) {
		t.Errorf("connection of a connected path: errno %d", got)
	}
	// EEXIST: a second path with the same addresses, returned by add_path.
	if _, err := s.AddPath(ctx, paths(t, "ip:127.0.0.1@ip:127.0.0.1")[0]); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("duplicate path: %v", err)
	}
	if len(s.Paths()) != 1 {
		t.Fatalf("%d paths after a refused add", len(s.Paths()))
	}
	// EPERM: another client session with the same name cannot open.
	o := ClientOptions{Provider: e.prov, SessName: "rej", Paths: paths(t, "ip:127.0.0.2@ip:127.0.0.1"), Port: e.port,
		ConPerPath: 2, MaxReconnectAttempts: -1, Timings: Timings(testutil.FastTimings())}
	if s2, err := Open(ctx, o); err == nil {
		_ = s2.Close()
		t.Fatal("second session with the same name opened")
	}
	if ss := e.srv.Sessions(); len(ss) != 1 || len(ss[0].Paths()) != 1 {
		t.Fatalf("server sessions after the refused one: %v", ss)
	}
	// The session still works.
	if err := s.Do(ctx, Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
}

func TestPathOperations(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 16)
	s := e.open(t, "ops", paths(t, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	ctx := context.Background()
	p2, err := s.AddPath(ctx, paths(t, "ip:127.0.0.2,ip:127.0.0.1")[0])
	if err != nil {
		t.Fatal(err)
	}
	if p2.Name() != "ip:127.0.0.2@ip:127.0.0.1" || p2.State() != StateConnected {
		t.Fatalf("added %s %v", p2.Name(), p2.State())
	}
	srvPaths := func() int { return len(e.srv.Sessions()[0].Paths()) }
	if srvPaths() != 2 {
		t.Fatalf("server has %d paths", srvPaths())
	}
	p2.Disconnect()
	if p2.State() != StateClosed {
		t.Fatalf("after disconnect: %v", p2.State())
	}
	testutil.WaitFor(t, 5*time.Second, "server side gone", func() bool { return srvPaths() == 1 })
	if err := s.Do(ctx, Write, offHdr(0), make([]byte, 4096)); err != nil {
		t.Fatalf("IO with one path disconnected: %v", err)
	}
	if err := p2.Reconnect(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "server side back", func() bool { return srvPaths() == 2 })
	p2.Remove()
	if len(s.Paths()) != 1 || p2.State() != StateDead {
		t.Fatalf("after remove: %d paths, %v", len(s.Paths()), p2.State())
	}
	if err := p2.Reconnect(ctx); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("reconnect of a removed path: %v", err)
	}
	// A path to nothing fails add_path and is not kept.
	if _, err := s.AddPath(ctx, paths(t, "ip:127.0.0.3")[0]); err == nil {
		t.Fatal("add_path to a closed port succeeded")
	}
	if len(s.Paths()) != 1 {
		t.Fatal("failed path kept")
	}
}

// TestZombiePath: a path whose client connects but never sends INFO_REQ is closed after the
// zombie timeout, and its connection with it.
func TestZombiePath(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, false, 16)
	e.srv.opts.Timings.ZombieTimeout = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	id := rawID(t, e)
	m := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: uuid.New(), FirstConn: true}
	if _, err := id.Connect(ctx, rdma.ConnParam{PrivateData: m.Marshal()}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case ev := <-id.Events():
		if ev.Type != rdma.EventDisconnected {
			t.Fatalf("event %v", ev.Type)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the zombie path was not closed")
	}
	if el := time.Since(start); el < 150*time.Millisecond {
		t.Fatalf("closed after %v, before the timeout", el)
	}
	// The path's close finishes on the server after the client saw the disconnect.
	testutil.WaitFor(t, 5*time.Second, "the zombie's session to go", func() bool {
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		return len(e.srv.sessions) == 0
	})
}

// TestZombieClockPerConnection (kernel 7.2, rtrs_srv_check_close_path): a path still
// connecting is a zombie only once the zombie timeout has passed since its latest connection
// request, not since its first. Before that a new path from the same addresses is refused
// with EEXIST and the connecting path is kept; after it the connecting path is closed.
func TestZombieClockPerConnection(t *testing.T) {
	leakcheck.Check(t)
	const z = time.Second
	e := newEnv(t, false, 16)
	e.srv.opts.Timings.ZombieTimeout = z
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := MsgConnReq{Cid: 0, CidNum: 2, SessUUID: uuid.New(), PathsUUID: uuid.New(), FirstConn: true}
	id0 := rawID(t, e)
	if _, err := id0.Connect(ctx, rdma.ConnParam{PrivateData: m.Marshal()}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	time.Sleep(z * 6 / 10)
	m.Cid, m.FirstConn = 1, false
	if _, err := rawID(t, e).Connect(ctx, rdma.ConnParam{PrivateData: m.Marshal()}); err != nil {
		t.Fatal(err)
	}
	second := time.Now()
	time.Sleep(time.Until(start.Add(z * 13 / 10)))
	// Past the timeout since the first connection, within it since the second.
	other := MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: m.PathsUUID, FirstConn: true}
	if got := rawConnect(t, e, other.Marshal()); got != -int16(syscall.EEXIST) {
		t.Fatalf("a path from the same addresses %v after the first connection, %v after the latest: errno %d, want EEXIST",
			time.Since(start), time.Since(second), got)
	}
	select {
	case ev := <-id0.Events():
		t.Fatalf("the connecting path was closed %v after its latest connection (%v)", time.Since(second), ev.Type)
	default:
	}
	select {
	case ev := <-id0.Events():
		if ev.Type != rdma.EventDisconnected {
			t.Fatalf("event %v", ev.Type)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the zombie path was not closed")
	}
	if el := time.Since(second); el < z*9/10 {
		t.Fatalf("closed %v after the latest connection, before the timeout", el)
	}
	testutil.WaitFor(t, 5*time.Second, "the zombie's session to go", func() bool {
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		return len(e.srv.sessions) == 0
	})
}

// TestCloseWithIOInFlight: Close waits for the requests in flight (each completes once), and
// requests after it fail with ErrClosed.
func TestCloseWithIOInFlight(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 32)
	e.disk.async, e.disk.delay = true, 2*time.Millisecond
	s := e.open(t, "closing", paths(t, "ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"), nil)
	var completed atomic.Int32
	for i := 0; i < 24; i++ {
		if err := s.Request(context.Background(), Write, offHdr(i*4096), make([]byte, 4096), func(err error) {
			if err != nil {
				t.Errorf("request in flight at close: %v", err)
			}
			completed.Add(1)
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if completed.Load() != 24 {
		t.Fatalf("%d of 24 completed when Close returned", completed.Load())
	}
	if err := s.Do(context.Background(), Read, offHdr(0), make([]byte, 4096)); !errors.Is(err, ErrClosed) {
		t.Fatalf("request after close: %v", err)
	}
	if err := s.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second close: %v", err)
	}
}

// TestReopenSameNameAtOnce: a session closed and opened again under the same name at once (an
// unmap and a map, back to back) opens every time. The server may not have seen the old
// session's paths go when the new one's INFO_REQ comes; the new path waits for the name.
func TestReopenSameNameAtOnce(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 64)
	for i := range 30 {
		o := ClientOptions{Provider: e.prov, SessName: "again", Paths: paths(t, path1(), path2()), Port: e.port,
			ConPerPath: 3, MaxReconnectAttempts: -1, Timings: Timings(testutil.FastTimings())}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		s, err := Open(ctx, o)
		cancel()
		if err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
		if err := s.Close(); err != nil {
			t.Fatalf("close %d: %v", i, err)
		}
	}
}

// TestNameWaitEndsWithServer: a path waiting for a name that a live session holds goes with
// the server's Close, refused for nothing and leaving no goroutine.
func TestNameWaitEndsWithServer(t *testing.T) {
	leakcheck.Check(t)
	e := newEnv(t, true, 16)
	e.open(t, "held", paths(t, path1()), nil)
	errc := make(chan error, 1)
	go func() {
		o := ClientOptions{Provider: e.prov, SessName: "held", Paths: paths(t, path2()), Port: e.port,
			ConPerPath: 2, MaxReconnectAttempts: -1, Timings: Timings(testutil.FastTimings())}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := Open(ctx, o)
		if err == nil {
			_ = s.Close()
		}
		errc <- err
	}()
	// The second session's path waits for the name (up to nameWait) from its INFO_REQ on.
	time.Sleep(nameWait / 4)
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err == nil {
		t.Fatal("a second session of a held name opened")
	}
	e.srv.countsMu.Lock()
	defer e.srv.countsMu.Unlock()
	if n := e.srv.refused["session name in use"]; n != 0 {
		t.Fatalf("%d refusals for the name: the waiting path went with the server", n)
	}
}
