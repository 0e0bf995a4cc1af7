package transport

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// newLimitedEnv is newEnv with the server's options changed by mod.
func newLimitedEnv(t testing.TB, mod func(*ServerOptions)) *env {
	t.Helper()
	return newProvEnv(t, testProvider(t), mod)
}

// newProvEnv is newLimitedEnv over the given provider.
func newProvEnv(t testing.TB, prov rdma.Provider, mod func(*ServerOptions)) *env {
	t.Helper()
	e := &env{prov: prov, disk: newMemDisk(8 << 20)}
	o := DefaultServerOptions()
	o.Provider, o.Handler, o.Timings = e.prov, e.disk, Timings(testutil.FastTimings())
	o.Addr = netip.AddrPortFrom(netip.MustParseAddr(testAddr(1)), 0)
	o.QueueDepth = 16
	mod(&o)
	srv, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	e.srv, e.port = srv, srv.Addr().Port()
	t.Cleanup(func() { _ = srv.Close() })
	return e
}

// connectFrom sends connection request m from src and returns the errno of the answer (0:
// accepted). The identifier lives until the test ends.
func connectFrom(t *testing.T, e *env, src netip.Addr, m MsgConnReq) int16 {
	t.Helper()
	return rawConnectFrom(t, e, src, m.Marshal())
}

// silentPath is the first connection of a new session's path that will never send INFO_REQ.
func silentPath(cidNum uint16) MsgConnReq {
	return MsgConnReq{Cid: 0, CidNum: cidNum, SessUUID: uuid.New(), PathsUUID: uuid.New(), FirstConn: true}
}

// Connection requests that never finish (no INFO_REQ) cost no chunk memory, are bounded in all
// and per client address, and give their slots back at the zombie timeout; a client that is
// already connected keeps doing verified IO meanwhile.
func TestUnfinishedConnectionsBounded(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) {
		o.Limits = ServerLimits{MaxConnecting: 10, MaxConnectingPerAddr: 6, MaxConnsPerPath: 4}
		o.Timings.ZombieTimeout = 1500 * time.Millisecond
	})
	s := e.open(t, "healthy", paths(t, path1()), nil)
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	a1, a2, a3 := netip.MustParseAddr(testAddr(1)), netip.MustParseAddr(testAddr(2)), netip.MustParseAddr(testAddr(3))
	for i := range 6 {
		if got := connectFrom(t, e, a1, silentPath(2)); got != 0 {
			t.Fatalf("unfinished connection %d from %v refused: %d", i, a1, got)
		}
	}
	if got := connectFrom(t, e, a1, silentPath(2)); got != -int16(syscall.ECONNRESET) {
		t.Fatalf("7th unfinished connection from one address: errno %d, want ECONNRESET", got)
	}
	for i := range 4 {
		if got := connectFrom(t, e, a2, silentPath(2)); got != 0 {
			t.Fatalf("unfinished connection %d from %v refused: %d", i, a2, got)
		}
	}
	if got := connectFrom(t, e, a3, silentPath(2)); got != -int16(syscall.ECONNRESET) {
		t.Fatalf("11th unfinished connection: errno %d, want ECONNRESET", got)
	}
	if got := connectFrom(t, e, a3, silentPath(5)); got != -int16(syscall.ECONNRESET) {
		t.Fatalf("cid_num 5 with at most 4 per path: errno %d", got)
	}
	if n := e.srv.ChunkMemory(); n != int64(16*DefaultChunkSize) {
		t.Fatalf("chunk memory %d with one established session of %d", n, 16*DefaultChunkSize)
	}
	randomIO(t, s, model, 300, 8, 1)
	// The zombie timeout closes them and the slots come back.
	testutil.WaitFor(t, 10*time.Second, "unfinished paths closed", func() bool {
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		return e.srv.connecting == 0 && len(e.srv.connectingFrom) == 0
	})
	if got := connectFrom(t, e, a1, silentPath(2)); got != 0 {
		t.Fatalf("after the zombie timeout: errno %d", got)
	}
	randomIO(t, s, model, 300, 8, 2)
}

// rss is the process's resident memory in bytes.
func rss(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	pages, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return pages * int64(os.Getpagesize())
}

// A storm of clients, each opening its own session, stays inside the chunk memory bound:
// sessions past it are refused, the healthy session's verified IO has no error, and the
// memory of the sessions that closed goes back to the system.
func TestSessionStormWithinChunkMemory(t *testing.T) {
	const qd, chunk = 16, 512 << 10
	const per = qd * chunk
	e := newLimitedEnv(t, func(o *ServerOptions) {
		o.QueueDepth, o.ChunkSize = qd, chunk
		o.Limits = ServerLimits{MaxChunkMemory: 4 * per, MaxChunkMemoryPerClient: 4 * per}
	})
	s := e.open(t, "healthy", paths(t, path1()), nil)
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	rss0 := rss(t)

	var peak atomic.Int64
	stop := make(chan struct{})
	var watch sync.WaitGroup
	watch.Add(1)
	go func() {
		defer watch.Done()
		for {
			peak.Store(max(peak.Load(), e.srv.ChunkMemory()))
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	ioDone := make(chan struct{})
	go func() {
		defer close(ioDone)
		randomIO(t, s, model, 2000, 8, 3)
	}()
	var mu sync.Mutex
	var opened []*Session
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := ClientOptions{Provider: e.prov, SessName: fmt.Sprintf("storm%d", i), Paths: paths(t, path2()), Port: e.port,
				ConPerPath: 2, MaxReconnectAttempts: 0, Timings: Timings(testutil.FastTimings())}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if ss, err := Open(ctx, o); err == nil {
				mu.Lock()
				opened = append(opened, ss)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	<-ioDone
	close(stop)
	watch.Wait()
	if peak.Load() > 4*per {
		t.Fatalf("chunk memory peaked at %d, bound %d", peak.Load(), 4*per)
	}
	if len(opened) != 3 {
		t.Fatalf("%d storm sessions opened, room for 3", len(opened))
	}
	// Touch the storm sessions' chunks so they are resident, then close them.
	var storm [][]byte
	for _, ss := range e.srv.Sessions() {
		if ss.Name() != "healthy" {
			m := ss.Paths()[0].mem
			for i := 0; i < len(m); i += 4096 {
				m[i] = 1
			}
			storm = append(storm, m)
		}
	}
	rss1 := rss(t)
	for _, ss := range opened {
		_ = ss.Close()
	}
	testutil.WaitFor(t, 10*time.Second, "storm sessions gone", func() bool { return e.srv.ChunkMemory() == per })
	rss2 := rss(t)
	t.Logf("RSS: %d MiB before the storm, %d MiB with it, %d MiB after it", rss0>>20, rss1>>20, rss2>>20)
	// The chunks went back to the system (unmapped by rdma.Free, not left for a collection
	// that unmapped memory would never trigger).
	for i, m := range storm {
		if rdma.Allocated(m) {
			t.Fatalf("storm session %d: chunks still allocated", i)
		}
	}
	// The healthy client is still fine, and a new session fits again.
	randomIO(t, s, model, 300, 8, 4)
	e.open(t, "late", paths(t, path2()), nil)
}

// One client cannot take the chunk memory every other client needs: past
// MaxChunkMemoryPerClient its sessions are refused (logged and counted under their own
// cause), another client's session still opens, and a session that closes gives its client
// the room back.
func TestChunkMemoryPerClient(t *testing.T) {
	const qd, chunk = 16, 512 << 10
	const per = qd * chunk
	e := newLimitedEnv(t, func(o *ServerOptions) {
		o.QueueDepth, o.ChunkSize = qd, chunk
		o.Limits = ServerLimits{MaxChunkMemory: 4 * per, MaxChunkMemoryPerClient: 2 * per}
	})
	// path2's sessions come from testAddr(2), path1's from testAddr(1): two clients.
	a := e.open(t, "a0", paths(t, path2()), nil)
	e.open(t, "a1", paths(t, path2()), nil)
	if err := tryOpen(e, "a2", paths(t, path2())); err == nil {
		t.Fatal("a third session of one client opened past its chunk memory")
	}
	if n := e.srv.Refused()["chunk memory per client"]; n == 0 {
		t.Fatalf("refusals %v: none under the per-client cause", e.srv.Refused())
	}
	if got := e.srv.ChunkMemory(); got != 2*per {
		t.Fatalf("chunk memory %d after the refusal, want %d", got, 2*per)
	}
	b := e.open(t, "b0", paths(t, path1()), nil)
	model := make([]byte, len(e.disk.disk))
	copy(model, e.disk.disk)
	randomIO(t, b, model, 200, 8, 5)
	_ = a.Close()
	testutil.WaitFor(t, 10*time.Second, "a0's memory given back", func() bool { return e.srv.ChunkMemory() == 2*per })
	e.open(t, "a2", paths(t, path2()), nil)
}

// The default per-client bound is a quarter of the server's, and never less than one session.
func TestChunkMemoryPerClientDefault(t *testing.T) {
	const qd, chunk = 16, 512 << 10
	for _, tc := range []struct{ total, want int64 }{
		{16 * qd * chunk, 4 * qd * chunk},
		{2 * qd * chunk, qd * chunk},
		{qd * chunk / 2, qd * chunk / 2},
	} {
		e := newLimitedEnv(t, func(o *ServerOptions) {
			o.QueueDepth, o.ChunkSize = qd, chunk
			o.Limits = ServerLimits{MaxChunkMemory: tc.total}
		})
		if got := e.srv.opts.Limits.MaxChunkMemoryPerClient; got != tc.want {
			t.Errorf("MaxChunkMemory %d: per client %d, want %d", tc.total, got, tc.want)
		}
	}
}

// A client refuses a server that offers more chunk memory than it allows.
func TestClientRefusesOversizedServer(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) { o.QueueDepth, o.ChunkSize = 16, 512<<10 })
	o := ClientOptions{Provider: e.prov, SessName: "small", Paths: paths(t, path1()), Port: e.port,
		ConPerPath: 2, MaxReconnectAttempts: 0, Timings: Timings(testutil.FastTimings()), MaxChunkMemory: 4 << 20}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if s, err := Open(ctx, o); err == nil {
		_ = s.Close()
		t.Fatal("a server offering 8 MiB of chunks was taken with a 4 MiB bound")
	} else if !strings.Contains(err.Error(), "MaxChunkMemory") {
		t.Fatalf("refused for another reason: %v", err)
	}
	// The per-permit header buffers count too: 8 MiB of chunks do not fit in 8 MiB.
	o.MaxChunkMemory = 8 << 20
	if s, err := Open(ctx, o); err == nil {
		_ = s.Close()
		t.Fatal("8 MiB of chunks and 64 KiB of headers taken with an 8 MiB bound")
	} else if !strings.Contains(err.Error(), "MaxChunkMemory") {
		t.Fatalf("refused for another reason: %v", err)
	}
	o.MaxChunkMemory = 8<<20 + 16*MaxHdrSize
	s, err := Open(ctx, o)
	if err != nil {
		t.Fatalf("a bound that holds chunks and headers: %v", err)
	}
	_ = s.Close()
}

// A session taking its chunk memory never holds its own lock while it waits for the server's:
// with the other order (everywhere else) the two deadlocked when one session took memory while
// another's INFO_REQ looked for its name among the sessions.
func TestChunkMemLockOrder(t *testing.T) {
	e := newLimitedEnv(t, func(o *ServerOptions) { o.QueueDepth, o.ChunkSize = 1, MinChunkSize })
	srv := e.srv
	var takers sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		takers.Add(1)
		go func() {
			defer takers.Done()
			for i := 0; i < 5000; i++ {
				ss := &SrvSess{srv: srv, uuid: uuid.New(), paths: map[uuid.UUID]*SrvPath{}}
				srv.mu.Lock()
				srv.sessions[sessKey{uuid: ss.uuid}] = ss
				srv.mu.Unlock()
				if _, err := ss.chunkMem(); err != nil {
					t.Error(err)
					return
				}
				srv.mu.Lock()
				delete(srv.sessions, sessKey{uuid: ss.uuid})
				ss.mu.Lock()
				ss.gone = true
				ss.mu.Unlock()
				srv.mu.Unlock()
				ss.freeMem()
			}
		}()
	}
	for range 2 {
		go func() {
			for {
				select {
				case <-stop:
					return
				default:
					srv.Sessions()
				}
			}
		}()
	}
	defer close(stop)
	done := make(chan struct{})
	go func() { takers.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("chunkMem and Sessions deadlocked")
	}
	if n := srv.ChunkMemory(); n != 0 {
		t.Fatalf("%d bytes of chunk memory still charged", n)
	}
}

// TestSendAfterInfoRefused: a SEND or SEND_WITH_IMM on an established connection, which the
// protocol does not have after the info exchange, is refused (counted, logged) and closes
// the path; each used up a receive that is never posted again, so ignoring them would let a
// client stall its connection unseen.
func TestSendAfterInfoRefused(t *testing.T) {
	leakcheck.Check(t)
	for _, op := range []rdma.Opcode{rdma.OpSend, rdma.OpSendWithImm} {
		e := newEnv(t, false, 8)
		s := e.open(t, "sends", paths(t, path1()), func(o *ClientOptions) { o.MaxReconnectAttempts = 0 })
		p := s.Paths()[0]
		p.mu.Lock()
		c := p.cons[1]
		p.mu.Unlock()
		if _, err := c.qp.PostSend([]rdma.SendWR{{Opcode: op, Imm: 0x12345678, Flags: rdma.SendSignaled}}); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 10*time.Second, fmt.Sprintf("%v refused, the path closed", op), func() bool {
			return e.srv.Refused()["malformed request"] == 1 && len(e.srv.Sessions()) == 0
		})
		_ = s.Close()
	}
}

// TestPeerFaultRefused: an RDMA access the client has no right to (a WRITE_WITH_IMM past the
// last chunk or past its chunk, a READ of a chunk) is stopped by the provider and closes the
// path, and the server counts and logs it as a refusal with the peer, not only as a
// disconnect.
func TestPeerFaultRefused(t *testing.T) {
	leakcheck.Check(t)
	for _, tc := range []struct {
		name string
		inv  bool
		op   rdma.Opcode
		off  uint64
	}{
		{"WRITE_WITH_IMM past the last chunk", false, rdma.OpRDMAWriteWithImm, 8 * DefaultChunkSize},
		{"WRITE_WITH_IMM past its chunk (always_invalidate)", true, rdma.OpRDMAWriteWithImm, DefaultChunkSize - 16},
		{"READ of a chunk", false, rdma.OpRDMARead, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.inv, 8)
			s := e.open(t, "fault", paths(t, path1()), func(o *ClientOptions) { o.MaxReconnectAttempts = 0 })
			p := s.Paths()[0]
			p.mu.Lock()
			c, rb, pd := p.cons[1], &p.rbufs[0], p.res.pd
			p.mu.Unlock()
			mr, err := pd.RegMR(make([]byte, 4096), rdma.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = mr.Dereg() }()
			wr := rdma.SendWR{Opcode: tc.op, Imm: IOReqImm(0, 100, MemBits(8)), Flags: rdma.SendSignaled,
				SGList: []rdma.SGE{rdma.SGEOf(mr, 0, 64)}, RemoteAddr: rb.addr + tc.off, RKey: rb.rkey.Load()}
			if _, err := c.qp.PostSend([]rdma.SendWR{wr}); err != nil {
				t.Fatal(err)
			}
			testutil.WaitFor(t, 10*time.Second, "the fault refused and the path closed", func() bool {
				return e.srv.Refused()["peer fault"] == 1 && len(e.srv.Sessions()) == 0
			})
			_ = s.Close()
		})
	}
}

// TestEstablishCapped: each connection of a path restarts its establish clock (as the
// kernel's does), but within a cap from its first: a client trickling in one more connection
// just before each timeout, never sending INFO_REQ, loses the path (refused, counted) after
// establishCap timeouts rather than holding it for one timeout per connection.
func TestEstablishCapped(t *testing.T) {
	leakcheck.Check(t)
	const z = 500 * time.Millisecond
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Timings.ZombieTimeout = z })
	m := silentPath(64)
	start := time.Now()
	var refusedAt time.Duration
	for cid := uint16(0); time.Since(start) < (establishCap+2)*z; cid++ {
		m.Cid, m.FirstConn = cid, cid == 0
		if got := connectFrom(t, e, netip.MustParseAddr(testAddr(1)), m); got != 0 {
			refusedAt = time.Since(start)
			break // refused: the path is gone
		}
		time.Sleep(z * 8 / 10)
	}
	if refusedAt == 0 || refusedAt > (establishCap+1)*z {
		t.Fatalf("a connection of the trickling path refused after %v; want within %v", refusedAt, (establishCap+1)*z)
	}
	if e.srv.Refused()["path not established in time"] == 0 {
		t.Fatalf("the path's end not refused: %v", e.srv.Refused())
	}
}
