package nbd

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// gateDev completes its asynchronous requests only while its gate is open, on one goroutine,
// and then runs its after-completions hooks, as the RNBD device does (a BatchingDevice): a
// reply gathered by a completion goes out only through the hook.
type gateDev struct {
	*memDev
	mu        sync.Mutex
	open      bool
	held      []func()
	submitted int
	hooks     map[int]func()
	next      int
}

func newGateDev(size int) *gateDev {
	return &gateDev{memDev: &memDev{b: make([]byte, size)}, hooks: map[int]func(){}}
}

func (d *gateDev) submit(f func()) {
	d.mu.Lock()
	d.submitted++
	if !d.open {
		d.held = append(d.held, f)
		d.mu.Unlock()
		return
	}
	d.mu.Unlock()
	d.run([]func(){f})
}

// run completes fs, then calls the hooks, as one round of a transport's completions.
func (d *gateDev) run(fs []func()) {
	for _, f := range fs {
		f()
	}
	d.mu.Lock()
	hooks := make([]func(), 0, len(d.hooks))
	for _, h := range d.hooks {
		hooks = append(hooks, h)
	}
	d.mu.Unlock()
	for _, h := range hooks {
		h()
	}
}

// release opens the gate and completes what it held.
func (d *gateDev) release() {
	d.mu.Lock()
	d.open = true
	held := d.held
	d.held = nil
	d.mu.Unlock()
	d.run(held)
}

func (d *gateDev) count() int { d.mu.Lock(); defer d.mu.Unlock(); return d.submitted }

func (d *gateDev) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.submit(func() { done(d.ReadAtContext(ctx, p, off)) })
}

func (d *gateDev) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	d.submit(func() { done(d.WriteAtContext(ctx, p, off, fua)) })
}

func (d *gateDev) AfterCompletions(fn func()) (remove func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	id := d.next
	d.next++
	d.hooks[id] = fn
	return func() { d.mu.Lock(); delete(d.hooks, id); d.mu.Unlock() }
}

// conns is how many connections s serves.
func conns(s *Server) int { s.mu.Lock(); defer s.mu.Unlock(); return len(s.conns) }

// TestGoneWithRepliesInFlight: a client that sends reads and goes before their replies (a
// socket closed, or the kernel's nbd after a timeout) ends its connection once the device
// answers them: the replies, gathered for the after-completions hook, are still sent (to
// nobody), and the server's Close does not wait for them forever.
func TestGoneWithRepliesInFlight(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(1 << 20)
	sock, s := startServerOpts(t, Options{}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	for i := range 4 {
		cl.send(Request{Type: CmdRead, Cookie: uint64(i), Offset: uint64(i) * 4096, Length: 4096}, nil)
	}
	testutil.WaitFor(t, 5*time.Second, "the reads at the device", func() bool { return dev.count() == 4 })
	cl.c.Close()
	time.Sleep(100 * time.Millisecond) // the server sees the close first
	dev.release()
	testutil.WaitFor(t, 5*time.Second, "the connection ended", func() bool { return conns(s) == 0 })
}

// TestCloseBounded: Close returns after closeWait even when a device never answers a request
// in flight (a server that answers heartbeats but not IO held a daemon's stop for ever); the
// connection ends once the device answers after all.
func TestCloseBounded(t *testing.T) {
	leakcheck.Check(t)
	defer func(d, c time.Duration) { drainWait, closeWait = d, c }(drainWait, closeWait)
	drainWait, closeWait = 100*time.Millisecond, 200*time.Millisecond
	dev := newGateDev(1 << 20)
	sock, s := startServerOpts(t, Options{}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	cl.send(Request{Type: CmdRead, Cookie: 1, Length: 4096}, nil)
	testutil.WaitFor(t, 5*time.Second, "the read at the device", func() bool { return dev.count() == 1 })
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waits for a request its device never answers")
	}
	if conns(s) != 1 {
		t.Fatalf("%d connections after Close, want the one whose request is unanswered", conns(s))
	}
	dev.release()
	testutil.WaitFor(t, 5*time.Second, "the connection ended", func() bool { return conns(s) == 0 })
}

// TestOrderlyShutdown: Close answers the requests in flight first, as the spec asks of a
// server that shuts down: a request read meanwhile gets ESHUTDOWN and an option ERR_SHUTDOWN;
// then the connections end.
func TestOrderlyShutdown(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(1 << 20)
	for i := range dev.b {
		dev.b[i] = byte(i)
	}
	sock, s := startServerOpts(t, Options{}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	haggling := hello(t, sock)
	cl.send(Request{Type: CmdRead, Cookie: 1, Offset: 4096, Length: 4096}, nil)
	testutil.WaitFor(t, 5*time.Second, "the read at the device", func() bool { return dev.count() == 1 })
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	testutil.WaitFor(t, 5*time.Second, "the server draining", s.draining.Load)
	cl.send(Request{Type: CmdRead, Cookie: 2, Length: 4096}, nil)
	if ck, e, _ := cl.recv(0); ck != 2 || e != errShutdown {
		t.Fatalf("a request during the shutdown: cookie %d errno %d, want ESHUTDOWN", ck, e)
	}
	sendOpt(t, haggling, optList, nil)
	if _, typ, _ := readOptReply(t, haggling); typ != repErrShutdown {
		t.Fatalf("an option during the shutdown: reply %#x, want ERR_SHUTDOWN", typ)
	}
	dev.release()
	if ck, e, data := cl.recv(4096); ck != 1 || e != 0 || !bytes.Equal(data, dev.b[4096:8192]) {
		t.Fatalf("the request in flight: cookie %d errno %d", ck, e)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the requests in flight were answered")
	}
	if _, err := cl.c.Read(make([]byte, 1)); err == nil {
		t.Fatal("the connection outlived Close")
	}
}

// TestStalledClientDropped: a client that sends reads and takes none of the replies is
// disconnected once a reply has waited ReplyTimeout for it, and holds nothing after that.
func TestStalledClientDropped(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(64 << 20)
	dev.open = true
	sock, s := startServerOpts(t, Options{ReplyTimeout: 300 * time.Millisecond}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	// Far more reply data than the socket's buffers take.
	go func() {
		for i := range 64 {
			b := make([]byte, requestSize)
			Request{Type: CmdRead, Cookie: uint64(i), Offset: uint64(i) << 20, Length: 1 << 20}.Put(b)
			if _, err := cl.c.Write(b); err != nil {
				return
			}
		}
	}()
	testutil.WaitFor(t, 10*time.Second, "the stalled client disconnected", func() bool { return conns(s) == 0 })
	cl.c.Close()
}

// TestConnMemoryBound: a connection holds at most MaxConnMemory of request data: past it,
// reads wait to be read from the socket until replies free their bytes, and all are
// answered in the end.
func TestConnMemoryBound(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(64 << 20)
	sock, _ := startServerOpts(t, Options{MaxConnMemory: MaxRequest}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	const n, size = 48, 1 << 20
	for i := range n {
		cl.send(Request{Type: CmdRead, Cookie: uint64(i), Offset: uint64(i) * size, Length: size}, nil)
	}
	want := MaxRequest / size
	testutil.WaitFor(t, 5*time.Second, "the reads the bound admits at the device", func() bool { return dev.count() == want })
	time.Sleep(200 * time.Millisecond)
	if got := dev.count(); got != want {
		t.Fatalf("%d reads of %d bytes at the device, want %d (%d bytes)", got, size, want, MaxRequest)
	}
	go dev.release()
	_ = cl.c.SetDeadline(time.Now().Add(20 * time.Second))
	for range n {
		if _, e, _ := cl.recv(size); e != 0 {
			t.Fatalf("errno %d", e)
		}
	}
	cl.c.Close()
}

// TestSlowTLSReader: over TLS, where replies cannot be written without waiting, a client
// that does not read its small replies holds up neither the device's completions nor
// another client's replies; once it goes, nothing of its connection is left.
func TestSlowTLSReader(t *testing.T) {
	leakcheck.Check(t)
	pki := testutil.NewPKI(t, "nbd")
	dev := newSerialDev(t, 64<<20)
	addr := startTLSServer(t, pki, Export{Name: "d", Dev: dev})
	cert := pki.Issue(t, "client", false)
	// A receive buffer that fills at once, set before the connection (its window scale).
	small := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	tlsClient := func(d *net.Dialer) *client {
		tcp, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		tc, err := startTLS(t, helloConn(t, tcp), &cert, pki)
		if err != nil {
			t.Fatal(err)
		}
		return goOn(t, tc, "d")
	}
	slow := tlsClient(&small)
	// 12.5 MiB of replies in 32 KiB reads: more than the sockets' buffers take (the
	// server's send buffer may be 8 MiB), from a goroutine, since the client's writes stop
	// once the server stops reading.
	const n = 400
	go func() {
		for i := range n {
			b := make([]byte, requestSize)
			Request{Type: CmdRead, Cookie: uint64(i), Offset: uint64(i%1024) << 15, Length: 32 << 10}.Put(b)
			if _, err := slow.c.Write(b); err != nil {
				return
			}
		}
	}()
	testutil.WaitFor(t, 10*time.Second, "the server holding replies it cannot write", func() bool { return dev.submitted.Load() >= 150 })
	time.Sleep(300 * time.Millisecond)
	fast := tlsClient(&net.Dialer{})
	fastReads(t, fast, 10)
	fast.c.Close()
	slow.c.Close()
}

// TestDeadlineAfterLargeReply: a large reply, written by a goroutine that may wait (with a
// deadline), leaves no deadline behind: a small reply long after it still goes out.
func TestDeadlineAfterLargeReply(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(4 << 20)
	dev.open = true
	sock, _ := startServerOpts(t, Options{ReplyTimeout: time.Second}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	_ = cl.c.SetDeadline(time.Now().Add(10 * time.Second))
	cl.send(Request{Type: CmdRead, Cookie: 1, Length: 1 << 20}, nil)
	if _, e, _ := cl.recv(1 << 20); e != 0 {
		t.Fatalf("errno %d", e)
	}
	time.Sleep(1500 * time.Millisecond)
	cl.send(Request{Type: CmdRead, Cookie: 2, Length: 4096}, nil)
	if ck, e, _ := cl.recv(4096); ck != 2 || e != 0 {
		t.Fatalf("reply %d errno %d after a pause", ck, e)
	}
	cl.c.Close()
}

// TestSlowSteadyReader: a client that takes a large reply slowly but steadily is not cut by
// the reply timeout, which bounds a wait without progress, not the whole reply.
func TestSlowSteadyReader(t *testing.T) {
	leakcheck.Check(t)
	dev := newGateDev(MaxRequest)
	dev.open = true
	sock, _ := startServerOpts(t, Options{ReplyTimeout: time.Second}, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	_ = cl.c.SetDeadline(time.Now().Add(20 * time.Second))
	cl.send(Request{Type: CmdRead, Cookie: 1, Length: MaxRequest}, nil)
	// 32 MiB, more than the socket buffers hold, at about 10 MiB/s: three times the timeout
	// in all, a tenth of it per megabyte.
	var h [replySize]byte
	if _, err := io.ReadFull(cl.c, h[:]); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256<<10)
	for left := MaxRequest; left > 0; {
		n, err := io.ReadFull(cl.c, buf[:min(len(buf), left)])
		if err != nil {
			t.Fatalf("after %d bytes: %v", MaxRequest-left, err)
		}
		left -= n
		time.Sleep(25 * time.Millisecond)
	}
	cl.send(Request{Type: CmdRead, Cookie: 2, Length: 4096}, nil)
	if ck, e, _ := cl.recv(4096); ck != 2 || e != 0 {
		t.Fatalf("reply %d errno %d after the slow read", ck, e)
	}
	cl.c.Close()
}

// TestRawWriteBounded: one raw writev of a blocking write copies no more than the deadline
// still covers, whatever the socket's buffer would take, and the bytes arrive in order.
func TestRawWriteBounded(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	if err := syscall.SetsockoptInt(fds[0], syscall.SOL_SOCKET, syscall.SO_SNDBUF, 1<<20); err != nil {
		t.Fatal(err)
	}
	x, y := make([]byte, 10000), make([]byte, 10000)
	for i := range x {
		x[i], y[i] = byte(i), byte(i+1)
	}
	c := &conn{bufs: net.Buffers{x, y}}
	n, e := c.writev(uintptr(fds[0]), 15000)
	if e != 0 || n != 15000 {
		t.Fatalf("writev of at most 15000 bytes: %d, %v", n, e)
	}
	got := make([]byte, 20000)
	if k, err := syscall.Read(fds[1], got); err != nil || k != 15000 {
		t.Fatalf("read %d, %v", k, err)
	}
	consume(&c.bufs, n)
	if len(c.bufs) != 1 || len(c.bufs[0]) != 5000 || c.bufs[0][0] != y[5000] {
		t.Fatalf("left %d buffers, the first of %d bytes", len(c.bufs), len(c.bufs[0]))
	}
	if got[9999] != x[9999] || got[10000] != y[0] || got[14999] != y[4999] {
		t.Fatal("the bytes came out of order")
	}
}
