package rnbd

import (
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// holdingProxy forwards TCP connections to a server only after release: until then a connect
// to it succeeds and nothing answers, like a server that hangs during the handshake.
type holdingProxy struct {
	ln       net.Listener
	to       string
	accepted atomic.Int32
	release  chan struct{}
	stop     chan struct{}
	once     sync.Once
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newHoldingProxy(t *testing.T, port uint16) *holdingProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &holdingProxy{ln: ln, to: net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))),
		release: make(chan struct{}), stop: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *holdingProxy) port() uint16 { return uint16(p.ln.Addr().(*net.TCPAddr).Port) }

func (p *holdingProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.stop:
		_ = c.Close()
		return false
	default:
	}
	p.conns = append(p.conns, c)
	return true
}

func (p *holdingProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		if !p.track(c) {
			return
		}
		p.wg.Add(1)
		go p.forward(c)
	}
}

func (p *holdingProxy) forward(c net.Conn) {
	defer p.wg.Done()
	select {
	case <-p.release:
	case <-p.stop:
		return
	}
	s, err := net.DialTimeout("tcp", p.to, 5*time.Second)
	if err != nil || !p.track(s) {
		_ = c.Close()
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		_, _ = io.Copy(s, c)
		_ = s.Close()
		_ = c.Close()
	}()
	_, _ = io.Copy(c, s)
	_ = s.Close()
	_ = c.Close()
}

// open lets the held connections through, and every later one at once.
func (p *holdingProxy) open() { close(p.release) }

func (p *holdingProxy) close() {
	p.once.Do(func() {
		p.mu.Lock()
		close(p.stop)
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		_ = p.ln.Close()
		p.wg.Wait()
	})
}

// slowClient is a client whose connect timeout outlasts the test's steps, so only the test
// decides when a held open ends; its heartbeats are slow enough that a loaded machine does
// not make a path reconnect (the test counts connections).
func slowClient(t *testing.T, e *testEnv) *Client {
	tm := transport.Timings(testutil.FastTimings())
	tm.ConnectTimeout = 60 * time.Second
	tm.HeartbeatInterval = time.Second
	c := NewClient(ClientOptions{
		Session: transport.ClientOptions{Provider: e.prov, ConPerPath: 3, MaxReconnectAttempts: -1,
			Policy: transport.MinInflight, Timings: tm},
		ReconnectTimeout: time.Second,
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c.Close(ctx)
	})
	return c
}

func slowOpts(t *testing.T, p *holdingProxy, dev string) MapOptions {
	src, dst, err := transport.ParsePathAddrs("ip:127.0.0.1@ip:127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return MapOptions{SessName: "slow", Paths: []transport.PathAddrs{{Src: src, Dst: dst}}, Port: p.port(),
		DevicePath: dev, AccessMode: AccessRO}
}

// within runs fn and fails the test if it has not returned after d: what it checks must not
// wait for what the test holds back (a session open, the server's answers).
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s blocked for %v behind what the test holds", what, d)
	}
}

// TestSlowOpenBlocksNoReader: while one session's open waits for a server that does not
// answer, the session list, the devices and another session's close are not held up; the
// name is reserved (close_session EBUSY, a request for it waits, bounded by its ctx, and
// starts no second connection); once the server answers, the waiting Map joins the one
// session and the waiting OpenSession is EEXIST.
func TestSlowOpenBlocksNoReader(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "a", 1<<20)
	e.file(t, "b", 1<<20)
	p := newHoldingProxy(t, e.port) // first: its cleanup runs after the client's Close
	c := slowClient(t, e)
	mustMap(t, e, c, "good", "a", AccessRO)

	opened := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		opened <- c.OpenSession(ctx, slowOpts(t, p, ""), nil)
	}()
	testutil.WaitFor(t, 10*time.Second, "the open's first connection", func() bool { return p.accepted.Load() > 0 })

	within(t, 3*time.Second, "SessionNames", func() {
		if got := c.SessionNames(); !slices.Equal(got, []string{"good"}) {
			t.Errorf("sessions %q during the open, want only [good]", got)
		}
	})
	within(t, 3*time.Second, "Devices and Session", func() {
		if d := c.Devices(); len(d) != 1 || d[0].Session() != "good" {
			t.Errorf("%d devices during the open, want good/a", len(d))
		}
		if c.Session("slow") != nil {
			t.Error("the session being opened is visible")
		}
	})
	within(t, 3*time.Second, "CloseSession", func() {
		if err := c.CloseSession("slow"); !errors.Is(err, syscall.EBUSY) {
			t.Errorf("close_session of the session being opened: %v, want EBUSY", err)
		}
	})
	within(t, 3*time.Second, "a same-name request with a short ctx", func() {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		if err := c.OpenSession(ctx, slowOpts(t, p, ""), nil); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("second OpenSession during the open: %v, want its ctx's deadline", err)
		}
	})
	select {
	case err := <-opened:
		t.Fatalf("the open ended before the server answered: %v", err)
	default:
	}
	if n := p.accepted.Load(); n != 1 {
		t.Fatalf("%d connections while the first is held, want 1", n)
	}

	// Requests that wait for the pending open: they end with it.
	mapped := make(chan error, 1)
	var dev *Device
	again := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		d, err := c.Map(ctx, slowOpts(t, p, "b"))
		dev = d
		mapped <- err
	}()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		again <- c.OpenSession(ctx, slowOpts(t, p, ""), nil)
	}()
	time.Sleep(200 * time.Millisecond) // let them reach the wait; either order is right
	p.open()
	if err := <-opened; err != nil {
		t.Fatalf("the held open: %v", err)
	}
	if err := <-mapped; err != nil {
		t.Fatalf("map into the session being opened: %v", err)
	}
	if dev.Session() != "slow" || !dev.Opened() {
		t.Fatalf("device of session %q, opened %v", dev.Session(), dev.Opened())
	}
	if err := <-again; !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("second OpenSession after the open: %v, want EEXIST", err)
	}
	if got := c.SessionNames(); !slices.Equal(got, []string{"good", "slow"}) {
		t.Fatalf("sessions %q, want [good slow]", got)
	}
	// One session: its one path's connections and no more went through the proxy.
	if n := p.accepted.Load(); n != 3 {
		t.Fatalf("%d connections through the proxy, want the 3 of one session's path", n)
	}
	if err := dev.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The session was opened with OpenSession: it stays without devices.
	if c.Session("slow") == nil {
		t.Fatal("the pinned session closed with the device mapped into it")
	}
}

// TestCloseAbortsPendingOpen: closing the client while a session open waits for a server
// that does not answer ends the open at once, leaves no session and no goroutine.
func TestCloseAbortsPendingOpen(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	p := newHoldingProxy(t, e.port)
	c := slowClient(t, e)
	opened := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		opened <- c.OpenSession(ctx, slowOpts(t, p, ""), nil)
	}()
	testutil.WaitFor(t, 10*time.Second, "the open's first connection", func() bool { return p.accepted.Load() > 0 })
	within(t, 10*time.Second, "Close", func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		c.Close(ctx)
	})
	// The open has ended when Close returns; its caller gets the error right after.
	select {
	case err := <-opened:
		if err == nil {
			t.Fatal("the open succeeded on a closed client")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the open Close aborted did not return")
	}
	if got := c.SessionNames(); len(got) != 0 {
		t.Fatalf("sessions %q after Close", got)
	}
}
