package rnbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// tmpfsDir is a fresh directory on tmpfs (/dev/shm) when there is one, else a temp dir.
func tmpfsDir(t testing.TB) string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "rnbd-test-")
		if err == nil {
			t.Cleanup(func() { os.RemoveAll(d) })
			return d
		}
	}
	return t.TempDir()
}

type testEnv struct {
	prov *soft.Provider
	dir  string
	port uint16
	// intercept, when set, sees every request before the RNBD server: those it returns true
	// for are its to answer.
	intercept atomic.Pointer[func(*transport.SrvRequest) bool]
	// exportIO is the server's ServerOptions.ExportIO.
	exportIO ExportIO
	// copyLocal leaves ServerOptions.ZeroCopyLocal off, as the daemons do: the tests' client
	// is on loopback, and most of them want large READs to take the zero-copy path.
	copyLocal bool

	mu  sync.Mutex
	srv *transport.Server
	rs  *Server
}

// newTestEnv starts an RNBD server over RTRS exporting a fresh tmpfs directory.
func newTestEnv(t testing.TB) *testEnv {
	t.Helper()
	e := &testEnv{prov: soft.New(soft.Options{}), dir: tmpfsDir(t)}
	e.start(t, 0)
	t.Cleanup(e.stop)
	return e
}

func (e *testEnv) start(t testing.TB, port uint16) {
	t.Helper()
	rs, err := NewServer(ServerOptions{SearchPath: e.dir, ExportIO: e.exportIO, ZeroCopyLocal: !e.copyLocal})
	if err != nil {
		t.Fatal(err)
	}
	o := transport.DefaultServerOptions()
	o.Provider, o.Handler, o.Timings = e.prov, envHandler{e: e, rs: rs}, transport.Timings(testutil.FastTimings())
	o.Addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)
	o.QueueDepth = 64
	var srv *transport.Server
	for end := time.Now().Add(5 * time.Second); ; {
		if srv, err = transport.NewServer(o); err == nil || time.Now().After(end) {
			break
		}
		time.Sleep(20 * time.Millisecond) // the old listener's port may linger briefly
	}
	if err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	e.srv, e.rs, e.port = srv, rs, srv.Addr().Port()
	e.mu.Unlock()
}

// envHandler hands the server's requests to the RNBD server, except those the test
// environment's intercept takes.
type envHandler struct {
	e  *testEnv
	rs *Server
}

func (h envHandler) Request(r *transport.SrvRequest) {
	if f := h.e.intercept.Load(); f != nil && (*f)(r) {
		return
	}
	h.rs.Request(r)
}

func (h envHandler) LinkEvent(s *transport.SrvSess, ev transport.LinkEvent) { h.rs.LinkEvent(s, ev) }

func (e *testEnv) stop() {
	e.mu.Lock()
	srv, rs := e.srv, e.rs
	e.srv, e.rs = nil, nil
	e.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
		rs.Close()
	}
}

func (e *testEnv) server() *Server { e.mu.Lock(); defer e.mu.Unlock(); return e.rs }

// rewriteOpen serves OPEN request r as the server does and hands its answer to edit before
// it goes back: a server that says what the test makes it say. For an intercept.
func (e *testEnv) rewriteOpen(t testing.TB, r *transport.SrvRequest, edit func(*MsgOpenRsp)) bool {
	rc, answered := e.server().process(r)
	if answered || rc != 0 {
		if !answered {
			r.Respond(rc)
		}
		return true
	}
	var rsp MsgOpenRsp
	if err := rsp.Unmarshal(r.Data); err != nil {
		t.Error(err)
	}
	edit(&rsp)
	rsp.Put(r.Data)
	r.Respond(0)
	return true
}

// dropPaths disconnects every path of every session from the server's side.
func (e *testEnv) dropPaths() {
	for _, ts := range e.server().sessionsOf() {
		for _, p := range ts.Paths() {
			p.Disconnect()
		}
	}
}

func (e *testEnv) file(t testing.TB, name string, size int) []byte {
	t.Helper()
	data := make([]byte, size)
	fill(rand.New(rand.NewPCG(uint64(size), 1)), data)
	if err := os.WriteFile(filepath.Join(e.dir, name), data, 0o600); err != nil {
		t.Fatal(err)
	}
	return data
}

// fill writes random bytes, eight at a time (len(b) is a multiple of 512).
func fill(rng *rand.Rand, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], rng.Uint64())
	}
}

func (e *testEnv) client(t testing.TB, timeout time.Duration) *Client {
	c := NewClient(ClientOptions{
		Session: transport.ClientOptions{Provider: e.prov, ConPerPath: 3, MaxReconnectAttempts: -1,
			Policy: transport.MinInflight, Timings: transport.Timings(testutil.FastTimings())},
		ReconnectTimeout: timeout,
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c.Close(ctx)
	})
	return c
}

func twoPaths(t testing.TB) []transport.PathAddrs {
	var out []transport.PathAddrs
	for _, s := range []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"} {
		src, dst, err := transport.ParsePathAddrs(s)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, transport.PathAddrs{Src: src, Dst: dst})
	}
	return out
}

func (e *testEnv) mapDev(t testing.TB, c *Client, sess, dev string, mode AccessMode) (*Device, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Map(ctx, MapOptions{SessName: sess, Paths: twoPaths(t), Port: e.port, DevicePath: dev, AccessMode: mode})
}

func mustMap(t testing.TB, e *testEnv, c *Client, sess, dev string, mode AccessMode) *Device {
	t.Helper()
	d, err := e.mapDev(t, c, sess, dev, mode)
	if err != nil {
		t.Fatalf("map %s: %v", dev, err)
	}
	return d
}

// randomIO runs n random block-aligned reads and writes (512 B to 600 KiB, so some split at
// the max IO size) with depth goroutines, checking every read against the model. Writers
// take disjoint ranges per goroutine so the model stays exact.
func randomIO(t testing.TB, d *Device, model []byte, n, depth int, seed uint64) {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex // the model
	errc := make(chan error, depth)
	region := len(model) / depth
	for g := 0; g < depth; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(g)))
			base := g * region
			for i := 0; i < n/depth; i++ {
				size := (1 + rng.IntN(600)) * 512
				if size > region {
					size = region
				}
				off := base + rng.IntN((region-size)/512+1)*512
				buf := make([]byte, size)
				if rng.IntN(2) == 0 {
					fill(rng, buf)
					if _, err := d.WriteAt(buf, int64(off)); err != nil {
						errc <- err
						return
					}
					mu.Lock()
					copy(model[off:], buf)
					mu.Unlock()
				} else {
					if _, err := d.ReadAt(buf, int64(off)); err != nil {
						errc <- err
						return
					}
					mu.Lock()
					ok := bytes.Equal(buf, model[off:off+size])
					mu.Unlock()
					if !ok {
						errc <- errors.New("read data differs from the model")
						return
					}
				}
			}
		}(g)
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
}

func TestMapRandomIO(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 8<<20)
	c := e.client(t, 5*time.Second)
	d := mustMap(t, e, c, "blk", "disk", AccessRW)
	if d.Size() != 8<<20 || d.BlockSize() != 512 || d.State() != StateMapped {
		t.Fatalf("size %d, block %d, state %v", d.Size(), d.BlockSize(), d.State())
	}
	randomIO(t, d, model, 1500, 8, 1)
	if err := d.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := &e.server().Stats; st.ZeroCopyReads.Value() == 0 || st.ZeroCopyReads.Value() == st.Reads.Value() {
		t.Fatalf("%d of %d reads from the page cache: both ways should have been taken", st.ZeroCopyReads.Value(), st.Reads.Value())
	}
	got, err := os.ReadFile(filepath.Join(e.dir, "disk"))
	if err != nil || !bytes.Equal(got, model) {
		t.Fatalf("backing file differs from the model (%v)", err)
	}
	// Both paths carried IO.
	for _, p := range c.Session("blk").Paths() {
		if p.Stats.ReadCnt.Value()+p.Stats.WriteCnt.Value() == 0 {
			t.Errorf("path %s carried no IO", p.Name())
		}
	}
}

// TestFailoverNoIOError: one path is closed by the server while requests are surely in flight
// on it (the server holds those that reach it over that path, unanswered); they fail over to
// the other path: the block user sees no error, the data matches, and the other path counts
// at least the held requests as failed over to it. (Path 2 may count some too: on a loaded
// machine path 1 can miss heartbeats and hand its own requests over.)
func TestFailoverNoIOError(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 8<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "fo", "disk", AccessRW)
	sess := c.Session("fo")
	p1, p2 := sess.Paths()[0], sess.Paths()[1]
	var mu sync.Mutex
	var held []*transport.SrvRequest
	holding := true
	hold := func(r *transport.SrvRequest) bool {
		if r.Path().SrcAddr().String() != "ip:127.0.0.2" {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if holding {
			held = append(held, r)
		}
		return holding
	}
	e.intercept.Store(&hold)
	defer e.intercept.Store(nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		randomIO(t, d, model, 1600, 16, 2)
	}()
	testutil.WaitFor(t, 10*time.Second, "requests held on path 2", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(held) >= 2
	})
	mu.Lock()
	holding = false // the reconnected path's requests go to the RNBD server
	reqs := held
	mu.Unlock()
	sp := reqs[0].Path()
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		sp.Close()
	}()
	// The path is no longer live on the server once its client sees it go: the held requests'
	// answers go nowhere (their IO is not done: their copies on path 1 do it), and Close,
	// which waits for them, returns.
	testutil.WaitFor(t, 10*time.Second, "path 2 down at the client", func() bool { return p2.State() != transport.StateConnected })
	for _, r := range reqs {
		r.Respond(-int(syscall.EIO))
	}
	<-closed
	<-done
	testutil.WaitFor(t, 10*time.Second, "path 2 back", func() bool { return p2.State() == transport.StateConnected })
	if fo := p1.Stats.Failovered.Value(); fo < uint64(len(reqs)) {
		t.Fatalf("path 1 took %d requests over from path 2; %d were held there when it closed", fo, len(reqs))
	}
	buf := make([]byte, len(model))
	if _, err := d.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, model) {
		t.Fatalf("data after failover differs (%v)", err)
	}
}

// sessionsOf lists the transport sessions the RNBD server has seen.
func (s *Server) sessionsOf() []*transport.SrvSess {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*transport.SrvSess
	for ts := range s.sessions {
		out = append(out, ts)
	}
	return out
}

// TestSessionDownShort: the server drops both paths; IO issued meanwhile waits and completes
// once the session is back and the device is remapped.
func TestSessionDownShort(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "short", "disk", AccessRW)
	e.dropPaths()
	testutil.WaitFor(t, 5*time.Second, "device disconnected", func() bool { return d.State() == StateDisconnected })
	buf := bytes.Repeat([]byte{0x5a}, 64<<10)
	if _, err := d.WriteAt(buf, 4096); err != nil {
		t.Fatalf("write while the session was away: %v", err)
	}
	copy(model[4096:], buf)
	if d.State() != StateMapped {
		t.Fatalf("state %v after the write", d.State())
	}
	got := make([]byte, len(model))
	if _, err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
		t.Fatalf("read back (%v)", err)
	}
}

// TestSessionDownLong: the server is gone for longer than the reconnect timeout: IO fails
// with EIO; when a server comes back on the port the device is remapped and IO works again.
func TestSessionDownLong(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 1<<20)
	c := e.client(t, 400*time.Millisecond)
	d := mustMap(t, e, c, "long", "disk", AccessRW)
	oldID := d.ID()
	port := e.port
	// The timeout runs from the disconnect, which e.stop may cause well before it returns.
	start := time.Now()
	e.stop()
	_, err := d.ReadAt(make([]byte, 4096), 0)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("read with the server gone: %v", err)
	}
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Fatalf("failed after %v, before the timeout", el)
	}
	// Later IO fails at once while the session stays away.
	if _, err := d.WriteAt(make([]byte, 512), 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write: %v", err)
	}
	e.start(t, port)
	testutil.WaitFor(t, 10*time.Second, "remap", func() bool { return d.State() == StateMapped })
	if d.ID() == oldID {
		t.Logf("same id %d after the server restarted", oldID)
	}
	got := make([]byte, len(model))
	if _, err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
		t.Fatalf("read after the server came back (%v)", err)
	}
}

func TestOpenRefusals(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(outside, "secret"), filepath.Join(e.dir, "link-out")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("disk", filepath.Join(e.dir, "link-in")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(e.dir, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(e.dir, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := e.client(t, time.Second)
	// Keep the session up between refusals.
	keep := mustMap(t, e, c, "s", "/disk", AccessRO)
	for _, tc := range []struct {
		dev  string
		want syscall.Errno
	}{
		{"../" + filepath.Base(outside) + "/secret", syscall.EACCES},
		{"sub/../../x", syscall.EACCES},
		{"link-out", syscall.EACCES},
		{outside + "/secret", syscall.ENOENT}, // absolute: taken under the export directory
		{"missing", syscall.ENOENT},
		{"sub", syscall.EISDIR},  // a directory is no device
		{"fifo", syscall.ENODEV}, // nor a FIFO (and opening it must not hang)
	} {
		if _, err := e.mapDev(t, c, "s", tc.dev, AccessRW); !errors.Is(err, tc.want) {
			t.Errorf("map %q: %v, want %v", tc.dev, err, tc.want)
		}
	}
	// A read-only open of a FIFO would wait for a writer without O_NONBLOCK.
	if _, err := e.mapDev(t, c, "s", "fifo", AccessRO); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("map a FIFO ro: %v", err)
	}
	if _, err := e.mapDev(t, c, "s", "/disk", AccessRO); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("map twice: %v", err)
	}
	// The same file through a symlink inside is the same device: one session may not have it twice.
	if _, err := e.mapDev(t, c, "s", "link-in", AccessRO); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("map through an inside symlink: %v", err)
	}
	if err := keep.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	if c.Session("s") != nil {
		t.Fatal("session kept after its last device was unmapped")
	}
	// A new session needs a path.
	if _, err := c.Map(context.Background(), MapOptions{SessName: "nopath", DevicePath: "disk"}); !errors.Is(err, syscall.ENXIO) {
		t.Errorf("new session without a path: %v", err)
	}
}

// TestAccessModes: one rw opener across sessions, any number of ro, migration as the second rw.
func TestAccessModes(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	a := mustMap(t, e, c, "a", "disk", AccessRW)
	if _, err := e.mapDev(t, c, "b", "disk", AccessRW); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("second rw: %v", err)
	}
	// The refused map closed "b"; its name is taken again at once.
	ro := mustMap(t, e, c, "b", "disk", AccessRO)
	if _, err := ro.WriteAt(make([]byte, 512), 0); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("write to a ro mapping: %v", err)
	}
	// Migration is a second writer: refused unless the ACL allows it.
	if _, err := e.mapDev(t, c, "m", "disk", AccessMigration); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("migration without an ACL allowing it: %v", err)
	}
	useACL(t, e, "disk * ro,rw,migration\n")
	mig := mustMap(t, e, c, "m", "disk", AccessMigration)
	if _, err := e.mapDev(t, c, "n", "disk", AccessMigration); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("third writer: %v", err)
	}
	if got := len(e.server().Devices()); got != 3 {
		t.Fatalf("server has %d devices open", got)
	}
	// Unmapping the rw opener lets another in.
	ctx := context.Background()
	for _, d := range []*Device{a, mig} {
		if err := d.Unmap(ctx); err != nil {
			t.Fatal(err)
		}
	}
	mustMap(t, e, c, "c", "disk", AccessRW)
	if err := ro.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ro.Unmap(ctx); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("unmap twice: %v", err)
	}
}

// TestBadIO sends IO the client API would not, straight through the session: the server
// refuses each with the right errno and keeps serving.
func TestBadIO(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	e.file(t, "ro", 64<<10)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "bad", "disk", AccessRW)
	rod := mustMap(t, e, c, "bad", "ro", AccessRO)
	s := c.Session("bad")
	ctx := context.Background()
	send := func(m MsgIO, dir transport.Dir, data []byte) error {
		usr := make([]byte, IOSize)
		m.Put(usr)
		return s.Do(ctx, dir, usr, data)
	}
	id := d.ID()
	for _, tc := range []struct {
		name string
		m    MsgIO
		dir  transport.Dir
		data []byte
		want syscall.Errno
	}{
		{"read past the end", MsgIO{DeviceID: id, Sector: 2047, RW: uint32(OpRead), BiSize: 1024}, transport.Read, make([]byte, 1024), syscall.EINVAL},
		{"huge sector", MsgIO{DeviceID: id, Sector: 1 << 62, RW: uint32(OpRead), BiSize: 512}, transport.Read, make([]byte, 512), syscall.EINVAL},
		{"size not in blocks", MsgIO{DeviceID: id, RW: uint32(OpWrite), BiSize: 100}, transport.Write, make([]byte, 100), syscall.EINVAL},
		{"bi_size differs from data", MsgIO{DeviceID: id, RW: uint32(OpWrite), BiSize: 4096}, transport.Write, make([]byte, 512), syscall.EINVAL},
		{"write as rtrs read", MsgIO{DeviceID: id, RW: uint32(OpWrite), BiSize: 512}, transport.Read, make([]byte, 512), syscall.EINVAL},
		{"discard past the end", MsgIO{DeviceID: id, Sector: 2040, RW: uint32(OpDiscard), BiSize: 8192}, transport.Write, nil, syscall.EINVAL},
		{"unknown device", MsgIO{DeviceID: id + 1000, RW: uint32(OpRead), BiSize: 512}, transport.Read, make([]byte, 512), syscall.ENODEV},
		{"unknown op", MsgIO{DeviceID: id, RW: 7, BiSize: 512}, transport.Read, make([]byte, 512), syscall.EOPNOTSUPP},
		{"secure erase", MsgIO{DeviceID: id, RW: uint32(OpSecureErase), BiSize: 512}, transport.Write, nil, syscall.EOPNOTSUPP},
		{"write to ro", MsgIO{DeviceID: rod.ID(), RW: uint32(OpWrite), BiSize: 512}, transport.Write, make([]byte, 512), syscall.EPERM},
		{"zeroes to ro", MsgIO{DeviceID: rod.ID(), RW: uint32(OpWriteZeroes), BiSize: 512}, transport.Write, nil, syscall.EPERM},
		// A FLUSH of a read-only mapping is served, as the kernel's server serves it (its
		// client's fsync of a read-only /dev/rnbdX sends one).
		{"flush of ro", MsgIO{DeviceID: rod.ID(), RW: uint32(OpFlush) | FlagPreflush}, transport.Write, nil, 0},
	} {
		if tc.want == 0 {
			if err := send(tc.m, tc.dir, tc.data); err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if err := send(tc.m, tc.dir, tc.data); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	// Garbage user headers.
	if err := s.Do(ctx, transport.Write, []byte{9, 0}, nil); !errors.Is(err, syscall.EBADMSG) {
		t.Errorf("2-byte header: %v", err)
	}
	if err := s.Do(ctx, transport.Write, []byte{9, 0, 0, 0}, nil); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("type 9: %v", err)
	}
	// The client API refuses what it can see is wrong before sending.
	if _, err := d.ReadAt(make([]byte, 4096), 1<<20); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("client read past the end: %v", err)
	}
	if _, err := d.ReadAt(make([]byte, 4096), 100); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("client unaligned read: %v", err)
	}
	// Still serving.
	if _, err := d.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
}

// TestFlushFUADiscard checks the effect of each operation on the backing file.
func TestFlushFUADiscard(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 4<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "ops", "disk", AccessRW)
	ctx := context.Background()
	path := filepath.Join(e.dir, "disk")
	st := &e.server().Stats

	pattern := bytes.Repeat([]byte("rnbd"), 1024)
	if err := d.WriteAtContext(ctx, pattern, 8192, true); err != nil {
		t.Fatal(err)
	}
	if st.FUAWrites.Value() != 1 {
		t.Fatalf("FUA writes %d", st.FUAWrites.Value())
	}
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if st.Flushes.Value() != 1 {
		t.Fatalf("flushes %d", st.Flushes.Value())
	}
	f, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(f[8192:8192+4096], pattern) {
		t.Fatalf("FUA write not in the file (%v)", err)
	}

	blocks := func() int64 {
		var s syscall.Stat_t
		if err := syscall.Stat(path, &s); err != nil {
			t.Fatal(err)
		}
		return s.Blocks
	}
	before := blocks()
	if err := d.Discard(ctx, 1<<20, 1<<20); err != nil {
		t.Fatal(err)
	}
	if after := blocks(); after > before-(1<<20)/512 {
		t.Fatalf("discard of 1 MiB: %d → %d blocks allocated", before, after)
	}
	if err := d.WriteZeroes(ctx, 3<<20, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	f, _ = os.ReadFile(path)
	if !bytes.Equal(f[1<<20:2<<20], make([]byte, 1<<20)) || !bytes.Equal(f[3<<20:3<<20+64<<10], make([]byte, 64<<10)) {
		t.Fatal("discarded or zeroed range does not read as zeroes")
	}
	if f[3<<20-1] == 0 && f[3<<20+64<<10] == 0 {
		t.Fatal("write-zeroes spilled over its range")
	}
	// Through the device too.
	got := make([]byte, 64<<10)
	if _, err := d.ReadAt(got, 3<<20); err != nil || !bytes.Equal(got, make([]byte, 64<<10)) {
		t.Fatalf("zeroes via the device (%v)", err)
	}
}

// TestZeroCopyNotLocal: by default a client on this host (here loopback) gets its large
// READs copied through the chunk, not sent from the page cache, and reads the same data.
func TestZeroCopyNotLocal(t *testing.T) {
	leakcheck.Check(t)
	e := &testEnv{prov: soft.New(soft.Options{}), dir: tmpfsDir(t), copyLocal: true}
	e.start(t, 0)
	t.Cleanup(e.stop)
	model := e.file(t, "disk", 4<<20)
	c := e.client(t, 5*time.Second)
	d := mustMap(t, e, c, "local", "disk", AccessRO)
	buf := make([]byte, 1<<20)
	for off := int64(0); off < 4<<20; off += 1 << 20 {
		if _, err := d.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, model[off:off+1<<20]) {
			t.Fatalf("read at %d differs from the file", off)
		}
	}
	p := c.Session("local").Paths()
	if st := &e.server().Stats; st.Reads.Value() == 0 || st.ZeroCopyReads.Value() != 0 {
		t.Fatalf("%d of %d reads from the page cache for a client on %s", st.ZeroCopyReads.Value(), st.Reads.Value(), p[0].Name())
	}
	// The control: with ZeroCopyLocal the same reads do leave from the page cache (they
	// could not on an export off tmpfs, where the count above proves nothing).
	z := newTestEnv(t)
	z.file(t, "disk", 1<<20)
	zd := mustMap(t, z, z.client(t, 5*time.Second), "zc", "disk", AccessRO)
	if _, err := zd.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	// Counted once the answer has gone, which the client may have first.
	for end := time.Now().Add(5 * time.Second); z.server().Stats.ZeroCopyReads.Value() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("no read from the page cache with ZeroCopyLocal: the export is not on a memory file system")
		}
	}
}

// TestDeviceFails: the backing file shrinks under a mapped device; reads past its new end
// fail with EIO, the rest keeps working, and the server survives.
func TestDeviceFails(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "shrink", "disk", AccessRW)
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 512<<10); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ReadAt(make([]byte, 4096), 768<<10); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read past the shrunk end: %v", err)
	}
	if _, err := d.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("read inside: %v", err)
	}
	// So does a READ large enough to leave from the page cache, without costing the
	// connection; inside the file it is served so.
	zc := e.server().Stats.ZeroCopyReads.Value()
	if _, err := d.ReadAt(make([]byte, 256<<10), 384<<10); !errors.Is(err, syscall.EIO) {
		t.Fatalf("large read across the shrunk end: %v", err)
	}
	if _, err := d.ReadAt(make([]byte, 256<<10), 0); err != nil {
		t.Fatalf("large read inside: %v", err)
	}
	// 128 KiB IOs: the first read's half inside the file and both of the second's. The
	// server counts one once its answer has gone, which the client may have before that.
	testutil.WaitFor(t, 5*time.Second, "3 zero-copy reads counted", func() bool { return e.server().Stats.ZeroCopyReads.Value() >= zc+3 })
	if n := e.server().Stats.ZeroCopyReads.Value(); n != zc+3 {
		t.Fatalf("%d zero-copy reads, want %d", n, zc+3)
	}
	for _, p := range c.Session("shrink").Paths() {
		if p.Stats.ReconnectOK.Value()+p.Stats.ReconnectFail.Value() != 0 {
			t.Fatalf("path %s reconnected after reads past the end", p.Name())
		}
	}
	// A write past the end fails too: the device keeps its size, the file does not grow back.
	if _, err := d.WriteAt(make([]byte, 4096), 768<<10); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write past the shrunk end: %v", err)
	}
	if st, err := os.Stat(filepath.Join(e.dir, "disk")); err != nil || st.Size() != 512<<10 {
		t.Fatalf("file after a write past its end: %v %v", st.Size(), err)
	}
	// A deleted export stays readable through the open descriptor, as a block device would.
	if err := os.Remove(filepath.Join(e.dir, "disk")); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("write to a deleted file: %v", err)
	}
}

// TestDeviceFull: a sparse export on a file system that fills up; writes into holes that
// find no space fail with ENOSPC, written data stays, and the device keeps working.
func TestDeviceFull(t *testing.T) {
	leakcheck.Check(t)
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	e := newTestEnv(t)
	small := filepath.Join(e.dir, "small")
	if err := os.Mkdir(small, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", small, "tmpfs", 0, "size=256k"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(small, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(small, "disk"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(small, "disk"), 4<<20); err != nil {
		t.Fatal(err)
	}
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "full", "small/disk", AccessRW)
	block := bytes.Repeat([]byte{0xa5}, 64<<10)
	var full int64 = -1
	for off := int64(0); off < 4<<20; off += int64(len(block)) {
		if _, err := d.WriteAt(block, off); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("write at %d: %v, want ENOSPC", off, err)
			}
			full = off
			break
		}
	}
	if full <= 0 {
		t.Fatalf("a 256 KiB file system took 4 MiB (full at %d)", full)
	}
	got := make([]byte, full)
	if _, err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0xa5}, int(full))) {
		t.Fatalf("reading back %d written bytes: %v", full, err)
	}
	// Space comes back with a discard, and the device takes writes again.
	if err := d.Discard(context.Background(), 0, full); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(block, full); err != nil {
		t.Fatalf("write after a discard freed space: %v", err)
	}
}

// TestSparseRead: reading a sparse export returns zeroes and allocates nothing, writing
// allocates what it writes.
func TestSparseRead(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	name := filepath.Join(e.dir, "sparse")
	if err := os.WriteFile(name, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(name, 8<<20); err != nil {
		t.Fatal(err)
	}
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "sparse", "sparse", AccessRW)
	buf := make([]byte, 1<<20)
	for off := int64(0); off < 8<<20; off += int64(len(buf)) {
		if _, err := d.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, make([]byte, len(buf))) {
			t.Fatalf("hole at %d reads as non-zero", off)
		}
	}
	allocated := func() int64 {
		var st unix.Stat_t
		if err := unix.Stat(name, &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks * 512
	}
	if a := allocated(); a != 0 {
		t.Fatalf("reading 8 MiB of holes allocated %d bytes", a)
	}
	if _, err := d.WriteAt(bytes.Repeat([]byte{1}, 64<<10), 1<<20); err != nil {
		t.Fatal(err)
	}
	if a := allocated(); a < 64<<10 || a > 1<<20 {
		t.Fatalf("a 64 KiB write allocated %d bytes", a)
	}
}

// TestDevicesListing checks the listing and states of mapped devices.
func TestDevicesListing(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "a", 1<<20)
	e.file(t, "b", 2<<20)
	c := e.client(t, time.Second)
	mustMap(t, e, c, "s2", "b", AccessRO)
	mustMap(t, e, c, "s1", "a", AccessRW)
	mustMap(t, e, c, "s1", "b", AccessRO)
	var got []string
	for _, d := range c.Devices() {
		got = append(got, d.Session()+"/"+d.Path()+":"+d.AccessMode().String()+":"+d.State().String())
	}
	want := "s1/a:rw:open s1/b:ro:open s2/b:ro:open"
	if s := joinSpace(got); s != want {
		t.Fatalf("devices %q, want %q", s, want)
	}
}

func joinSpace(v []string) string {
	var b bytes.Buffer
	for i, s := range v {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(s)
	}
	return b.String()
}

// TestPopulate: opening a memfs export rw maps the pages the file has into the write
// mapping (so writes take no page faults: one per page had been the largest cost of small
// random writes until each page had been written once), and leaves its holes unmapped and
// unallocated.
func TestPopulate(t *testing.T) {
	dir := tmpfsDir(t)
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Skip("needs tmpfs")
	}
	const page, pages = 4096, 256
	f, err := os.Create(filepath.Join(dir, "disk"))
	if err != nil {
		t.Fatal(err)
	}
	// Data in pages [0,64) and [192,256); a hole between.
	if _, err := f.WriteAt(bytes.Repeat([]byte{7}, 64*page), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{9}, 64*page), 192*page); err != nil {
		t.Fatal(err)
	}
	f.Close()
	root, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	b, err := openBeneath(root, "disk", true)
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	if len(b.mem) != pages*page {
		t.Fatalf("mapping of %d bytes", len(b.mem))
	}
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Skip(err)
	}
	defer pm.Close()
	ent := make([]byte, 8*pages)
	if _, err := pm.ReadAt(ent, int64(uintptr(unsafe.Pointer(&b.mem[0])))/page*8); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < pages; i++ {
		present := binary.LittleEndian.Uint64(ent[8*i:])&(1<<63) != 0
		if want := i < 64 || i >= 192; present != want {
			t.Fatalf("page %d mapped %v, want %v", i, present, want)
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(b.fd, &st); err != nil || st.Blocks*512 != 128*page {
		t.Fatalf("%d bytes allocated after the open, want %d (%v)", st.Blocks*512, 128*page, err)
	}
}

// rawOpen sends an OPEN for name in mode through session s, as a client that does not use
// the API would, and returns the answer.
func rawOpen(s *transport.Session, name string, mode AccessMode) (MsgOpenRsp, error) {
	var usr [OpenSize]byte
	var rsp MsgOpenRsp
	if err := (MsgOpen{AccessMode: mode, DevName: name}).Put(usr[:]); err != nil {
		return rsp, err
	}
	var buf [OpenRspSize]byte
	if err := s.DoAdmin(context.Background(), transport.Read, usr[:], buf[:]); err != nil {
		return rsp, err
	}
	return rsp, rsp.Unmarshal(buf[:])
}

// useACL gives the server the ACL text.
func useACL(t *testing.T, e *testEnv, text string) {
	t.Helper()
	acl, err := ParseACL(strings.NewReader(text), "test.acl")
	if err != nil {
		t.Fatal(err)
	}
	e.server().SetACL(acl)
}

// An ro OPEN of a device the session holds rw is refused instead of answered with the rw
// handle; the same mode is answered again (a remap after a reconnect).
func TestOpenROOfHeldRWDevice(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "holder", "disk", AccessRW)
	s := c.Session("holder")
	if rsp, err := rawOpen(s, "disk", AccessRO); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("ro open of the session's rw device: handle %d, %v; want EEXIST", rsp.DeviceID, err)
	}
	rsp, err := rawOpen(s, "disk", AccessRW)
	if err != nil || rsp.DeviceID != d.ID() {
		t.Fatalf("rw open again: handle %d (mapped %d), %v", rsp.DeviceID, d.ID(), err)
	}
}

// The export ACL admits and refuses by export, client and mode, and a reload takes effect for
// the opens after it.
func TestExportACL(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "db1", 1<<20)
	e.file(t, "scratch", 1<<20)
	useACL(t, e, `
# export  client        modes
db*       127.0.0.0/8   ro     # everyone local reads the databases
db1       127.0.0.1     rw
scratch   10.0.0.0/8    rw     # not us
`)
	c := e.client(t, time.Second)
	if _, err := e.mapDev(t, c, "a", "db1", AccessRO); err != nil {
		t.Fatalf("ro of db1: %v", err)
	}
	if _, err := e.mapDev(t, c, "b", "db1", AccessRW); err != nil {
		t.Fatalf("rw of db1 from 127.0.0.1: %v", err)
	}
	if _, err := e.mapDev(t, c, "c", "db1", AccessMigration); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("migration of db1: %v, want EACCES", err)
	}
	if _, err := e.mapDev(t, c, "d", "scratch", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("scratch, which no rule gives us: %v, want EACCES", err)
	}
	useACL(t, e, "* * ro,rw\n")
	if _, err := e.mapDev(t, c, "d", "scratch", AccessRW); err != nil {
		t.Fatalf("scratch after the reload: %v", err)
	}
	for _, bad := range []string{"db1 127.0.0.1", "db1 127.0.0.1 rw,wr", "[ * rw", "db1 nothost rw", "db1 subject= rw"} {
		if _, err := ParseACL(strings.NewReader(bad), "bad.acl"); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("ACL line %q: %v", bad, err)
		}
	}
}

// Device paths that a config file or a tree could not carry are refused by the client before
// they are sent and by the server when a client sends them anyway.
func TestDevicePathText(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	e.file(t, "disk#x", 1<<20)
	c := e.client(t, time.Second)
	if _, err := e.mapDev(t, c, "s", "disk#x", AccessRO); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("map of disk#x: %v, want EINVAL", err)
	}
	mustMap(t, e, c, "s", "disk", AccessRO)
	for _, bad := range []string{"disk#x", "disk x", "disk\x01", "d\xffisk"} {
		if _, err := rawOpen(c.Session("s"), bad, AccessRO); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("raw OPEN of %q: %v, want EINVAL", bad, err)
		}
	}
}

// The ACL matches the export as the server resolves it, not as the client spelled it.
func TestACLNormalizesPaths(t *testing.T) {
	acl, err := ParseACL(strings.NewReader("db/vol1 * rw\npub/* * ro\n"), "t.acl")
	if err != nil {
		t.Fatal(err)
	}
	who := transport.Identity{Addr: netip.MustParseAddr("10.0.0.1")}
	for _, tc := range []struct {
		name string
		mode AccessMode
		want bool
	}{
		{"db/vol1", AccessRW, true},
		{"/db/vol1", AccessRW, true},
		{"db//vol1", AccessRW, true},
		{"db/./vol1", AccessRW, true},
		{"pub/a", AccessRO, true},
		{"pub/../secret", AccessRO, false},
		{"pub/a/../../secret", AccessRO, false},
		{"../pub/a", AccessRO, false},
		{"pub/a/../b", AccessRO, false}, // ".." resolves after links: never matched as text
		{"db/x/../vol1", AccessRW, false},
		{"db/vol1", AccessMigration, false},
	} {
		if got := acl.allows(tc.name, who, tc.mode); got != tc.want {
			t.Errorf("%q %v: %v, want %v", tc.name, tc.mode, got, tc.want)
		}
	}
}

// TestUnmapWhileMapping: an unmap of a device whose OPEN is still on the wire is refused
// (EBUSY) and closes nothing on the server: the kernel's server numbers a session's devices
// from 0, so a CLOSE with the id the device does not have yet would close another one.
func TestUnmapWhileMapping(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "first", 1<<20)
	e.file(t, "second", 1<<20)
	c := e.client(t, 10*time.Second)
	first := mustMap(t, e, c, "um", "first", AccessRW)
	held := make(chan *transport.SrvRequest, 1)
	hold := func(r *transport.SrvRequest) bool {
		var m MsgOpen
		if typ, _ := PeekType(r.Usr); typ != MsgTypeOpen || m.Unmarshal(r.Usr) != nil || m.DevName != "second" {
			return false
		}
		held <- r
		return true
	}
	e.intercept.Store(&hold)
	defer e.intercept.Store(nil)
	mapped := make(chan error, 1)
	go func() {
		_, err := e.mapDev(t, c, "um", "second", AccessRW)
		mapped <- err
	}()
	r := <-held
	var second *Device
	for _, d := range c.Devices() {
		if d.Path() == "second" {
			second = d
		}
	}
	if second == nil {
		t.Fatal("the device being mapped is not listed")
	}
	if err := second.Unmap(context.Background()); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("unmap while the OPEN is on the wire: %v, want EBUSY", err)
	}
	e.server().Request(r)
	if err := <-mapped; err != nil {
		t.Fatalf("map after the refused unmap: %v", err)
	}
	if n := len(e.server().Devices()); n != 2 {
		t.Fatalf("the server has %d devices open, want 2: %+v", n, e.server().Devices())
	}
	buf := make([]byte, 4096)
	if _, err := first.ReadAt(buf, 0); err != nil {
		t.Fatalf("the first device after it all: %v", err)
	}
	if err := second.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestIOFailingForeverEnds: a server that answers every IO of a device with ENODEV (as if
// it had lost the session) while every remap succeeds gets each IO sent again only for the
// reconnect timeout; then it fails with EIO instead of looping, a remap at a time, for ever.
func TestIOFailingForeverEnds(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "nodev", "disk", AccessRW)
	var answered atomic.Int64
	nodev := func(r *transport.SrvRequest) bool {
		if typ, _ := PeekType(r.Usr); typ != MsgTypeIO {
			return false
		}
		answered.Add(1)
		r.Respond(-int(syscall.ENODEV))
		return true
	}
	e.intercept.Store(&nodev)
	defer e.intercept.Store(nil)
	done := make(chan error, 1)
	go func() {
		_, err := d.ReadAt(make([]byte, 4096), 0)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("read answered ENODEV again and again: %v, want EIO", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("read still resent after 20 s (%d answers), with a reconnect timeout of 1 s", answered.Load())
	}
	if answered.Load() < 2 {
		t.Fatalf("%d answers: the read was not resent after a remap", answered.Load())
	}
	e.intercept.Store(nil)
	if _, err := d.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("read once the server answers: %v", err)
	}
}

// TestRemapResized: an export grown while its session was down is taken with its new size
// at the remap, as the kernel's client takes it, and the front ends are told; IO reaches the
// new end.
func TestRemapResized(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "geo", "disk", AccessRW)
	told := make(chan [2]int64, 1)
	d.OnResize(func(_ context.Context, old, size int64) error {
		told <- [2]int64{old, size}
		return nil
	})
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 2<<20); err != nil {
		t.Fatal(err)
	}
	id := d.ID()
	e.dropPaths()
	testutil.WaitFor(t, 10*time.Second, "the device remapped", func() bool { return d.State() == StateMapped && d.ID() != id })
	select {
	case got := <-told:
		if got != [2]int64{1 << 20, 2 << 20} {
			t.Fatalf("front ends told %v, want 1 MiB to 2 MiB", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the front ends were not told the new size")
	}
	if d.Size() != 2<<20 {
		t.Fatalf("size %d after the remap, want %d", d.Size(), 2<<20)
	}
	data := bytes.Repeat([]byte{0x5a}, 4096)
	if _, err := d.WriteAt(data, 2<<20-4096); err != nil {
		t.Fatalf("write at the new end: %v", err)
	}
	got := make([]byte, 4096)
	if _, err := d.ReadAt(got, 2<<20-4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read at the new end: %v", err)
	}
}

// TestRemapChangedBlockSize: an export whose block size changed while its session was down
// is not taken as the device that was mapped: the remap closes it on the server (which
// would otherwise hold it open, rw, for this session) and the device turns closed, its IO
// failing with EIO at once and no remap retrying it; unmap and map take it as it is.
func TestRemapChangedBlockSize(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "geo", "disk", AccessRW)
	// The server's answer to the remap's OPEN, with 4 KiB blocks: it opened the device as
	// usual (the answer's id is a real one, which the client must close).
	var opened atomic.Uint32
	var closes atomic.Int32
	reblock := func(r *transport.SrvRequest) bool {
		switch typ, _ := PeekType(r.Usr); typ {
		case MsgTypeOpen:
			return e.rewriteOpen(t, r, func(rsp *MsgOpenRsp) {
				rsp.LogicalBlockSize, rsp.PhysicalBlockSize = 4096, 4096
				opened.Store(rsp.DeviceID + 1)
			})
		case MsgTypeClose:
			closes.Add(1)
		}
		return false
	}
	e.intercept.Store(&reblock)
	defer e.intercept.Store(nil)
	e.dropPaths()
	testutil.WaitFor(t, 10*time.Second, "the device closed at its remap", func() bool { return d.State() == StateClosedByServer })
	testutil.WaitFor(t, 10*time.Second, "the server holding no device for the session", func() bool { return len(e.server().Devices()) == 0 })
	if opened.Load() == 0 || closes.Load() != 1 {
		t.Fatalf("OPEN answered %v, CLOSEs %d: want the reopened id closed once", opened.Load() != 0, closes.Load())
	}
	if _, err := d.ReadAt(make([]byte, 4096), 0); !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "block size changed") {
		t.Fatalf("IO to the closed device: %v, want EIO saying why", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The unmap sends no second CLOSE of the id the remap closed: a server that gives the
	// id to another device (the kernel's takes the lowest free) would close that one.
	if err := d.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	if n := closes.Load(); n != 1 {
		t.Fatalf("the unmap of the device the remap closed sent %d more CLOSEs", n-1)
	}
}

// TestResize: the kernel's resize. The export is grown on the server under an open device
// (no reopen) and the device after it: IO reaches the new end. A front end that cannot
// follow leaves the size as it was; a larger size is taken before the front ends are told,
// a smaller one after; bad sizes and a device not open are refused.
func TestResize(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "rs", "disk", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var seen [][3]int64 // old, new, the device's size when told
	var fail error
	d.OnResize(func(_ context.Context, old, size int64) error {
		seen = append(seen, [3]int64{old, size, d.Size()})
		return fail
	})
	for _, bad := range []uint64{0, maxSectors + 1} {
		if err := d.Resize(ctx, bad); !errors.Is(err, syscall.EINVAL) || d.Size() != 1<<20 {
			t.Fatalf("resize to %d sectors: %v, size %d", bad, err, d.Size())
		}
	}
	if err := d.Resize(ctx, 2048); err != nil || len(seen) != 0 {
		t.Fatalf("resize to its own size: %v, front ends told %v", err, seen)
	}
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 2<<20); err != nil {
		t.Fatal(err)
	}
	fail = syscall.EOPNOTSUPP
	if err := d.Resize(ctx, 4096); !errors.Is(err, syscall.EOPNOTSUPP) || d.Size() != 1<<20 {
		t.Fatalf("resize a front end refused: %v, size %d", err, d.Size())
	}
	if _, err := d.ReadAt(make([]byte, 4096), 1<<20); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past the end kept: %v", err)
	}
	fail, seen = nil, nil
	if err := d.Resize(ctx, 4096); err != nil || d.Size() != 2<<20 {
		t.Fatalf("resize to 2 MiB: %v, size %d", err, d.Size())
	}
	if len(seen) != 1 || seen[0] != [3]int64{1 << 20, 2 << 20, 2 << 20} {
		t.Fatalf("front ends told %v, want 1 MiB to 2 MiB with the device at 2 MiB", seen)
	}
	// Past the old end, through the server's write mapping of the old size and beyond it.
	data := bytes.Repeat([]byte{0xc3}, 8192)
	if _, err := d.WriteAt(data, 1<<20-4096); err != nil {
		t.Fatalf("write across the old end: %v", err)
	}
	got := make([]byte, 8192)
	if _, err := d.ReadAt(got, 1<<20-4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read across the old end: %v", err)
	}
	seen = nil
	if err := d.Resize(ctx, 1024); err != nil || d.Size() != 512<<10 {
		t.Fatalf("resize to 512 KiB: %v, size %d", err, d.Size())
	}
	if len(seen) != 1 || seen[0] != [3]int64{2 << 20, 512 << 10, 2 << 20} {
		t.Fatalf("front ends told %v, want 2 MiB to 512 KiB with the device still at 2 MiB", seen)
	}
	if _, err := d.ReadAt(make([]byte, 4096), 512<<10); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past the new end: %v", err)
	}
	if err := d.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Resize(ctx, 4096); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("resize after unmap: %v, want ENOENT", err)
	}
}

// TestDeviceIDWrap: past a wrap of the server's id counter, an id its session still holds is
// skipped, never given to a second device over the first.
func TestDeviceIDWrap(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "a", 64<<10)
	e.file(t, "b", 64<<10)
	c := e.client(t, time.Second)
	a := mustMap(t, e, c, "w", "a", AccessRW)
	s := e.server()
	s.mu.Lock()
	s.nextID = a.ID() // as after 2^32 OPENs
	s.mu.Unlock()
	b := mustMap(t, e, c, "w", "b", AccessRW)
	if b.ID() == a.ID() {
		t.Fatalf("the second device got the first's id %d", a.ID())
	}
	data := bytes.Repeat([]byte{0xa7}, 4096)
	if _, err := a.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := b.ReadAt(got, 0); err != nil || bytes.Equal(got, data) {
		t.Fatalf("the write to the first device reached the second: %v", err)
	}
}

// TestRangeLimitUnderABlock: a server that announces a DISCARD and WRITE_ZEROES limit of less
// than one block (one sector, with 4 KiB blocks) gets neither: EOPNOTSUPP at once, where the
// split made pieces of nothing for ever.
func TestRangeLimitUnderABlock(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	lie := func(r *transport.SrvRequest) bool {
		if typ, _ := PeekType(r.Usr); typ != MsgTypeOpen {
			return false
		}
		return e.rewriteOpen(t, r, func(rsp *MsgOpenRsp) {
			rsp.LogicalBlockSize, rsp.PhysicalBlockSize = 4096, 4096
			rsp.MaxDiscardSectors, rsp.MaxWriteZeroesSectors = 1, 7
		})
	}
	e.intercept.Store(&lie)
	defer e.intercept.Store(nil)
	d := mustMap(t, e, c, "lim", "disk", AccessRW)
	if d.CanDiscard() || d.CanWriteZeroes() {
		t.Fatalf("discard %v, write-zeroes %v with limits under a block", d.CanDiscard(), d.CanWriteZeroes())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := d.Discard(ctx, 0, 4096); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Fatalf("discard: %v, want EOPNOTSUPP", err)
	}
	if err := d.WriteZeroes(ctx, 0, 8192, false); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Fatalf("write-zeroes: %v, want EOPNOTSUPP", err)
	}
}

// TestReopenSeesSizeNow: an OPEN of a device the session still has open (a remap after a
// reconnect the server did not notice) is answered with the export's size now: a device grown
// on the server and by resize is not shrunk back by it, and a grow is seen.
func TestReopenSeesSizeNow(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "now", "disk", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var told [][2]int64
	d.OnResize(func(_ context.Context, old, size int64) error {
		told = append(told, [2]int64{old, size})
		return nil
	})
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := d.Resize(ctx, 4096); err != nil {
		t.Fatal(err)
	}
	d.setDown() // as the remap after a path came back finds it
	if err := d.open(ctx); err != nil {
		t.Fatal(err)
	}
	if d.Size() != 2<<20 || len(told) != 1 {
		t.Fatalf("after a reopen in the same session: %d bytes, front ends told %v", d.Size(), told)
	}
	// Grown again on the server only: the reopen takes the new size.
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 3<<20); err != nil {
		t.Fatal(err)
	}
	d.setDown()
	if err := d.open(ctx); err != nil {
		t.Fatal(err)
	}
	if d.Size() != 3<<20 || len(told) != 2 || told[1] != [2]int64{2 << 20, 3 << 20} {
		t.Fatalf("a grow seen at a reopen: %d bytes, front ends told %v", d.Size(), told)
	}
}

// TestResizeDuringRemap: a front end told of a resize may wait for IO in flight (the kernel
// freezes /dev/nbdX's queue to change its size), and that IO may wait for a remap: the
// remap's OPEN must not wait for the resize, or neither ends.
func TestResizeDuringRemap(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 10*time.Second)
	d := mustMap(t, e, c, "rr", "disk", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 2<<20); err != nil {
		t.Fatal(err)
	}
	reopened := make(chan error, 1)
	d.OnResize(func(ctx context.Context, old, size int64) error {
		// The path dropped as the resize began: the remap runs while this waits for the
		// device to take IO again, as a queue freeze waits for the IO in flight.
		d.setDown()
		go func() { reopened <- d.open(ctx) }()
		for end := time.Now().Add(5 * time.Second); d.State() != StateMapped; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(end) {
				return fmt.Errorf("the remap waited for the resize: %w", syscall.ETIMEDOUT)
			}
		}
		return nil
	})
	if err := d.Resize(ctx, 4096); err != nil {
		t.Fatal(err)
	}
	if err := <-reopened; err != nil || d.Size() != 2<<20 {
		t.Fatalf("the remap: %v, size %d", err, d.Size())
	}
}
