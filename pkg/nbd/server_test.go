package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// memDev is a Device in memory that counts flushes, FUA writes, and zeroings by kind.
type memDev struct {
	mu                       sync.Mutex
	b                        []byte
	flushes                  int
	fua                      int
	discards, zeroes, noHole int
}

func (m *memDev) Size() int64    { return int64(len(m.b)) }
func (m *memDev) BlockSize() int { return 512 }
func (m *memDev) ReadAtContext(_ context.Context, p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(p, m.b[off:])
	return nil
}
func (m *memDev) WriteAtContext(_ context.Context, p []byte, off int64, fua bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(m.b[off:], p)
	if fua {
		m.fua++
	}
	return nil
}
func (m *memDev) Flush(context.Context) error { m.mu.Lock(); m.flushes++; m.mu.Unlock(); return nil }
func (m *memDev) Discard(_ context.Context, off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.discards++
	clear(m.b[off : off+n])
	return nil
}
func (m *memDev) WriteZeroes(_ context.Context, off, n int64, noUnmap bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.zeroes++
	if noUnmap {
		m.noHole++
	}
	clear(m.b[off : off+n])
	return nil
}

// rangeDev is a memDev whose backend takes DISCARD or WRITE_ZEROES only as told (RangeOps).
type rangeDev struct {
	*memDev
	discard, writeZeroes bool
}

func (r rangeDev) CanDiscard() bool     { return r.discard }
func (r rangeDev) CanWriteZeroes() bool { return r.writeZeroes }

// client is a minimal NBD client for tests: handshake with GO, then requests.
type client struct {
	t     testing.TB
	c     net.Conn
	size  uint64
	flags uint16
}

func readOptReply(t testing.TB, c net.Conn) (opt, typ uint32, data []byte) {
	t.Helper()
	var h [20]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		t.Fatal(err)
	}
	if binary.BigEndian.Uint64(h[:]) != optReplyMagic {
		t.Fatalf("option reply magic %x", h[:8])
	}
	data = make([]byte, binary.BigEndian.Uint32(h[16:]))
	if _, err := io.ReadFull(c, data); err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint32(h[8:]), binary.BigEndian.Uint32(h[12:]), data
}

func sendOpt(t testing.TB, c net.Conn, opt uint32, data []byte) {
	t.Helper()
	b := binary.BigEndian.AppendUint64(nil, optMagic)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	if _, err := c.Write(append(b, data...)); err != nil {
		t.Fatal(err)
	}
}

func hello(t testing.TB, addr string) net.Conn { t.Helper(); return helloOn(t, "unix", addr) }

// helloOn connects to addr on network and does the fixed-newstyle greeting.
func helloOn(t testing.TB, network, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	return helloConn(t, c)
}

// helloConn does the fixed-newstyle greeting on c, which the test's end closes.
func helloConn(t testing.TB, c net.Conn) net.Conn {
	t.Helper()
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	var h [18]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		t.Fatal(err)
	}
	if binary.BigEndian.Uint64(h[:]) != nbdMagic || binary.BigEndian.Uint64(h[8:]) != optMagic ||
		binary.BigEndian.Uint16(h[16:]) != flagFixedNewstyle|flagNoZeroes {
		t.Fatalf("greeting %x", h)
	}
	if _, err := c.Write([]byte{0, 0, 0, flagFixedNewstyle | flagNoZeroes}); err != nil {
		t.Fatal(err)
	}
	return c
}

func goData(name string, infos ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = binary.BigEndian.AppendUint16(b, i)
	}
	return b
}

func dial(t testing.TB, addr, name string) *client {
	t.Helper()
	return goOn(t, hello(t, addr), name)
}

// goOn selects export name on c, past the greeting (and STARTTLS, if any).
func goOn(t testing.TB, c net.Conn, name string) *client {
	t.Helper()
	sendOpt(t, c, optGo, goData(name, infoBlockSize))
	cl := &client{t: t, c: c}
	for {
		_, typ, data := readOptReply(t, c)
		if typ == repAck {
			return cl
		}
		if typ != repInfo {
			t.Fatalf("GO %q: reply %#x %q", name, typ, data)
		}
		if binary.BigEndian.Uint16(data) == infoExport {
			cl.size, cl.flags = binary.BigEndian.Uint64(data[2:]), binary.BigEndian.Uint16(data[10:])
		}
	}
}

func (cl *client) send(r Request, payload []byte) {
	b := make([]byte, requestSize, requestSize+len(payload))
	r.Put(b)
	if _, err := cl.c.Write(append(b, payload...)); err != nil {
		cl.t.Fatal(err)
	}
}

// recv reads one simple reply; n is the read payload to take on success.
func (cl *client) recv(n int) (cookie uint64, errno uint32, data []byte) {
	var h [replySize]byte
	if _, err := io.ReadFull(cl.c, h[:]); err != nil {
		cl.t.Fatal(err)
	}
	if binary.BigEndian.Uint32(h[:]) != simpleReplyMagic {
		cl.t.Fatalf("reply magic %x", h[:4])
	}
	errno, cookie = binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
	if errno == 0 && n > 0 {
		data = make([]byte, n)
		if _, err := io.ReadFull(cl.c, data); err != nil {
			cl.t.Fatal(err)
		}
	}
	return cookie, errno, data
}

func startServer(t testing.TB, exps ...Export) string {
	t.Helper()
	sock, _ := startServerOpts(t, Options{}, exps...)
	return sock
}

// startServerOpts starts a server with o (its Exports set to exps) on a unix socket; Close
// at the test's end must return within 10 s.
func startServerOpts(t testing.TB, o Options, exps ...Export) (string, *Server) {
	t.Helper()
	sock := t.TempDir() + "/nbd.sock"
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	o.Exports = func() []Export { return exps }
	s := NewServer(o)
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	t.Cleanup(func() {
		closed := make(chan struct{})
		go func() { s.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Error("the server's Close did not return in 10 s")
			return
		}
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return sock, s
}

func TestHandshakeOptions(t *testing.T) {
	leakcheck.Check(t)
	dev := &memDev{b: make([]byte, 1<<20)}
	sock := startServer(t, Export{Name: "a", Description: "first", Dev: dev}, Export{Name: "b", Dev: dev, ReadOnly: true})
	c := hello(t, sock)
	sendOpt(t, c, optList, nil)
	var names []string
	for {
		_, typ, data := readOptReply(t, c)
		if typ == repAck {
			break
		}
		if typ != repServer {
			t.Fatalf("LIST reply %#x", typ)
		}
		n := binary.BigEndian.Uint32(data)
		names = append(names, string(data[4:4+n])+"|"+string(data[4+n:]))
	}
	if got := names; len(got) != 2 || got[0] != "a|first" || got[1] != "b|" {
		t.Fatalf("LIST %q", got)
	}
	for _, tc := range []struct {
		opt  uint32
		data []byte
		want uint32
	}{
		{optInfo, goData("nope"), repErrUnknwn},
		{optInfo, []byte{0, 0, 0, 9, 'a'}, repErrInval}, // name longer than the option
		{optInfo, append(goData("a"), 0), repErrInval},  // trailing byte
		{optList, []byte{1}, repErrInval},               // LIST takes no data
		{optStructuredRepl, nil, repErrUnsup},           // simple replies only
		{optStartTLS, nil, repErrUnsup},
		{99, []byte("x"), repErrUnsup},
	} {
		sendOpt(t, c, tc.opt, tc.data)
		if _, typ, _ := readOptReply(t, c); typ != tc.want {
			t.Errorf("option %d %x: reply %#x, want %#x", tc.opt, tc.data, typ, tc.want)
		}
	}
	// INFO on b: read-only, no trim; the block sizes.
	sendOpt(t, c, optInfo, goData("b", infoName, infoBlockSize))
	seen := map[uint16][]byte{}
	for {
		_, typ, data := readOptReply(t, c)
		if typ == repAck {
			break
		}
		seen[binary.BigEndian.Uint16(data)] = data[2:]
	}
	if f := binary.BigEndian.Uint16(seen[infoExport][8:]); f&tflagReadOnly == 0 || f&tflagSendTrim != 0 {
		t.Errorf("flags of a read-only export %#x", f)
	}
	if string(seen[infoName]) != "b" {
		t.Errorf("name %q", seen[infoName])
	}
	if bs := seen[infoBlockSize]; binary.BigEndian.Uint32(bs) != 512 || binary.BigEndian.Uint32(bs[8:]) != MaxRequest {
		t.Errorf("block sizes %x", bs)
	}
	// A large option is skipped and refused, the stream still in step: TOO_BIG for a known
	// one, UNSUP for an unknown one; the next option is answered.
	sendOpt(t, c, optInfo, make([]byte, maxOptLen+1))
	if _, typ, _ := readOptReply(t, c); typ != repErrTooBig {
		t.Fatalf("INFO of 64 KiB+1: reply %#x, want ERR_TOO_BIG", typ)
	}
	sendOpt(t, c, 99, make([]byte, maxOptLen+1))
	if _, typ, _ := readOptReply(t, c); typ != repErrUnsup {
		t.Fatalf("unknown option of 64 KiB+1: reply %#x, want ERR_UNSUP", typ)
	}
	sendOpt(t, c, optList, nil)
	if _, typ, _ := readOptReply(t, c); typ != repServer {
		t.Fatalf("LIST after the large options: reply %#x", typ)
	}
	for {
		if _, typ, _ := readOptReply(t, c); typ == repAck {
			break
		}
	}
	// A huge one ends the connection.
	var oh [16]byte
	binary.BigEndian.PutUint64(oh[:], optMagic)
	binary.BigEndian.PutUint32(oh[8:], optInfo)
	binary.BigEndian.PutUint32(oh[12:], maxOptSkip+1)
	if _, err := c.Write(oh[:]); err != nil { // the header only: the server reads no further
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection survived a 16 MiB+1 option")
	}
	// Old-style NBD_OPT_EXPORT_NAME.
	c = hello(t, sock)
	sendOpt(t, c, optExportName, []byte("a"))
	var h [10]byte
	if _, err := io.ReadFull(c, h[:]); err != nil || binary.BigEndian.Uint64(h[:]) != 1<<20 {
		t.Fatalf("EXPORT_NAME reply %x %v", h, err)
	}
}

func TestTransmission(t *testing.T) {
	leakcheck.Check(t)
	dev := &memDev{b: make([]byte, 1<<20)}
	sock := startServer(t, Export{Name: "d", Dev: dev}, Export{Name: "ro", Dev: dev, ReadOnly: true})
	cl := dial(t, sock, "d")
	if cl.size != 1<<20 || cl.flags&(tflagSendFlush|tflagSendFUA|tflagSendTrim|tflagWriteZeroes|tflagCanMultiConn) == 0 {
		t.Fatalf("size %d flags %#x", cl.size, cl.flags)
	}
	// Pipeline 64 writes, then 64 reads, and match replies by cookie.
	for i := 0; i < 64; i++ {
		cl.send(Request{Type: CmdWrite, Cookie: uint64(i), Offset: uint64(i) * 4096, Length: 4096}, bytes.Repeat([]byte{byte(i)}, 4096))
	}
	got := map[uint64]bool{}
	for i := 0; i < 64; i++ {
		ck, e, _ := cl.recv(0)
		if e != 0 || got[ck] {
			t.Fatalf("write reply %d errno %d", ck, e)
		}
		got[ck] = true
	}
	for i := 0; i < 64; i++ {
		cl.send(Request{Type: CmdRead, Cookie: 1000 + uint64(i), Offset: uint64(i) * 4096, Length: 4096}, nil)
		ck, e, data := cl.recv(4096)
		if e != 0 || ck != 1000+uint64(i) || !bytes.Equal(data, bytes.Repeat([]byte{byte(i)}, 4096)) {
			t.Fatalf("read %d: errno %d", i, e)
		}
	}
	cl.send(Request{Type: CmdWrite, Flags: CmdFlagFUA, Cookie: 1, Length: 512}, make([]byte, 512))
	cl.recv(0)
	cl.send(Request{Type: CmdFlush, Cookie: 2}, nil)
	cl.recv(0)
	cl.send(Request{Type: CmdTrim, Cookie: 3, Offset: 4096, Length: 4096}, nil)
	cl.recv(0)
	dev.mu.Lock()
	if dev.fua != 1 || dev.flushes != 1 || dev.b[4096] != 0 || dev.b[8192] != 2 {
		t.Errorf("fua %d flushes %d trimmed %d next %d", dev.fua, dev.flushes, dev.b[4096], dev.b[8192])
	}
	dev.mu.Unlock()
	for _, tc := range []struct {
		r    Request
		want uint32
	}{
		{Request{Type: CmdRead, Offset: 1<<20 - 512, Length: 1024}, errInval},
		{Request{Type: CmdRead, Offset: 1, Length: 512}, errInval},
		{Request{Type: CmdRead, Offset: 1 << 63, Length: 1 << 31}, errInval},
		{Request{Type: CmdRead, Length: MaxRequest + 1}, errInval},
		{Request{Type: CmdWriteZeroes, Offset: 1 << 20, Length: 512}, errNoSpc},
		{Request{Type: CmdCache, Length: 512}, errInval},
		{Request{Type: CmdBlockStatus, Length: 512}, errInval},
		{Request{Type: 77}, errInval},
		// Flags the command or the handshake does not allow.
		{Request{Type: CmdRead, Flags: CmdFlagDF, Length: 512}, errInval},
		{Request{Type: CmdWriteZeroes, Flags: CmdFlagFastZero, Offset: 8192, Length: 512}, errInval},
		{Request{Type: CmdTrim, Flags: CmdFlagNoHole, Offset: 8192, Length: 512}, errInval},
		{Request{Type: CmdFlush, Flags: 1 << 9}, errInval},
		// Zero-length requests succeed without reaching the device, but only inside it.
		{Request{Type: CmdWriteZeroes, Offset: 8192}, 0},
		{Request{Type: CmdTrim, Offset: 1 << 20}, 0},
		{Request{Type: CmdRead, Offset: 1<<20 + 512}, errInval},
	} {
		tc.r.Cookie = 42
		cl.send(tc.r, nil)
		if ck, e, _ := cl.recv(0); ck != 42 || e != tc.want {
			t.Errorf("%+v: errno %d, want %d", tc.r, e, tc.want)
		}
	}
	// FUA on a read is accepted; a zero-length read and write answer with no payload, and
	// the stream stays in step (the read after them gets its own reply and data).
	cl.send(Request{Type: CmdRead, Flags: CmdFlagFUA, Cookie: 43, Offset: 8192, Length: 512}, nil)
	if ck, e, data := cl.recv(512); ck != 43 || e != 0 || data[0] != 2 {
		t.Errorf("FUA read: cookie %d errno %d data %d", ck, e, data[0])
	}
	cl.send(Request{Type: CmdWrite, Cookie: 44, Offset: 8192}, nil)
	cl.send(Request{Type: CmdRead, Cookie: 45, Offset: 8192}, nil)
	cl.send(Request{Type: CmdRead, Cookie: 46, Offset: 8192, Length: 512}, nil)
	for _, want := range []uint64{44, 45} {
		if ck, e, _ := cl.recv(0); ck != want || e != 0 {
			t.Errorf("zero-length request %d: reply %d errno %d", want, ck, e)
		}
	}
	if ck, e, data := cl.recv(512); ck != 46 || e != 0 || data[0] != 2 {
		t.Errorf("read after zero-length ones: cookie %d errno %d data %d", ck, e, data[0])
	}
	dev.mu.Lock()
	if dev.b[8192] != 2 || dev.zeroes != 0 || dev.discards != 1 {
		t.Errorf("refused or empty requests reached the device: data %d zeroings %d discards %d", dev.b[8192], dev.zeroes, dev.discards)
	}
	dev.mu.Unlock()
	ro := dial(t, sock, "ro")
	ro.send(Request{Type: CmdWrite, Cookie: 5, Length: 512}, make([]byte, 512))
	if _, e, _ := ro.recv(0); e != errPerm {
		t.Errorf("write to read-only: %d", e)
	}
	// DISC: the server closes after answering what is in flight.
	cl.send(Request{Type: CmdRead, Cookie: 9, Length: 512}, nil)
	cl.send(Request{Type: CmdDisc}, nil)
	if ck, e, _ := cl.recv(512); ck != 9 || e != 0 {
		t.Fatalf("read before DISC: %d %d", ck, e)
	}
	if _, err := cl.c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after DISC: %v", err)
	}
	// A bad magic ends the connection.
	bad := dial(t, sock, "d")
	if _, err := bad.c.Write(make([]byte, requestSize)); err != nil {
		t.Fatal(err)
	}
	if _, err := bad.c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection survived a bad magic")
	}
}

func TestWireErrors(t *testing.T) {
	for err, want := range map[error]uint32{
		syscall.EROFS: errPerm, syscall.ENOSPC: errNoSpc, syscall.ENODEV: errIO,
		io.ErrUnexpectedEOF: errIO, syscall.EOPNOTSUPP: errInval, syscall.ENOMEM: errNoMem,
		syscall.EOVERFLOW: errInval, syscall.ESHUTDOWN: errShutdown, syscall.EDQUOT: errNoSpc,
		syscall.EFBIG: errNoSpc,
	} {
		if got := wireError(err); got != want {
			t.Errorf("%v → %d, want %d", err, got, want)
		}
	}
}

// FuzzRequest decodes arbitrary request headers: no panic, and what decodes re-encodes.
func FuzzRequest(f *testing.F) {
	b := make([]byte, requestSize)
	Request{Type: CmdWrite, Flags: CmdFlagFUA, Cookie: 7, Offset: 4096, Length: 512}.Put(b)
	f.Add(b)
	f.Add(make([]byte, 10))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		if err != nil {
			return
		}
		out := make([]byte, requestSize)
		r.Put(out)
		if !bytes.Equal(out, b[:requestSize]) {
			t.Fatalf("%x → %+v → %x", b[:requestSize], r, out)
		}
	})
}

// FuzzSession feeds an arbitrary client byte stream to a live server connection: whatever
// it sends, the server answers or hangs up, and never panics or touches memory outside the
// export.
func FuzzSession(f *testing.F) {
	var seed []byte
	seed = append(seed, 0, 0, 0, 3)
	seed = binary.BigEndian.AppendUint64(seed, optMagic)
	seed = binary.BigEndian.AppendUint32(seed, optGo)
	g := goData("d")
	seed = binary.BigEndian.AppendUint32(seed, uint32(len(g)))
	seed = append(seed, g...)
	req := make([]byte, requestSize)
	Request{Type: CmdWrite, Cookie: 1, Offset: 512, Length: 512}.Put(req)
	seed = append(append(seed, req...), make([]byte, 512)...)
	Request{Type: CmdRead, Cookie: 2, Offset: 0, Length: 4096}.Put(req)
	f.Add(append(seed, req...))
	f.Fuzz(func(t *testing.T, in []byte) {
		dev := &memDev{b: make([]byte, 64<<10)}
		s := NewServer(Options{Exports: func() []Export { return []Export{{Name: "d", Dev: dev}} }, HandshakeTimeout: time.Second})
		a, b := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.serveConn(a, nil)
			a.Close()
		}()
		go func() { _, _ = io.Copy(io.Discard, b) }()
		_ = b.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, _ = b.Write(in)
		b.Close()
		<-done
		s.Close()
	})
}

// serialDev completes its asynchronous requests one after another on one goroutine, as a
// transport connection does: a done callback that blocked would stop every later one.
type serialDev struct {
	*memDev
	work      chan func()
	submitted atomic.Int32
}

func newSerialDev(t *testing.T, size int) *serialDev {
	d := &serialDev{memDev: &memDev{b: make([]byte, size)}, work: make(chan func(), 1024)}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case f := <-d.work:
				f()
			case <-stop:
				return
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return d
}

func (d *serialDev) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.submitted.Add(1)
	d.work <- func() { done(d.ReadAtContext(ctx, p, off)) }
}

func (d *serialDev) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	d.submitted.Add(1)
	d.work <- func() { done(d.WriteAtContext(ctx, p, off, fua)) }
}

// TestSlowReader: a client that does not read its replies holds up neither the device's
// completions nor another client's replies.
func TestSlowReader(t *testing.T) {
	leakcheck.Check(t)
	dev := newSerialDev(t, 64<<20)
	sock := startServer(t, Export{Name: "d", Dev: dev})
	slow := dial(t, sock, "d")
	const n = 48 // 48 MiB of replies: far more than a socket buffer holds
	for i := range n {
		slow.send(Request{Type: CmdRead, Cookie: uint64(i), Offset: uint64(i) << 20, Length: 1 << 20}, nil)
	}
	// All of them ahead of the fast client's in the device's queue.
	testutil.WaitFor(t, 10*time.Second, "slow requests submitted", func() bool { return dev.submitted.Load() == n })
	fast := dial(t, sock, "d")
	fastReads(t, fast, 20)
	// The slow client gets every reply once it reads.
	_ = slow.c.SetDeadline(time.Now().Add(10 * time.Second))
	seen := map[uint64]bool{}
	for range n {
		cookie, errno, _ := slow.recv(1 << 20)
		if errno != 0 || cookie >= n || seen[cookie] {
			t.Fatalf("slow client: reply %d errno %d", cookie, errno)
		}
		seen[cookie] = true
	}
	fast.c.Close()
	slow.c.Close()
}

// fastReads has cl read 4 KiB n times, each answered within 10 s of the first.
func fastReads(t *testing.T, cl *client, n int) {
	t.Helper()
	_ = cl.c.SetDeadline(time.Now().Add(10 * time.Second))
	for i := range n {
		cl.send(Request{Type: CmdRead, Cookie: uint64(1000 + i), Offset: 4096, Length: 4096}, nil)
		if cookie, errno, _ := cl.recv(4096); cookie != uint64(1000+i) || errno != 0 {
			t.Fatalf("fast client: reply %d errno %d", cookie, errno)
		}
	}
}

// holdDev holds the requests started while it is plugged until the last Unplug, as the
// transport holds posts: a plug the server forgot to release before waiting shows as a reply
// that never comes.
type holdDev struct {
	*memDev
	mu      sync.Mutex
	plugs   int
	held    []func()
	maxHeld int
	wg      sync.WaitGroup
}

func (d *holdDev) Plug() { d.mu.Lock(); d.plugs++; d.mu.Unlock() }

func (d *holdDev) Unplug() {
	d.mu.Lock()
	d.plugs--
	var run []func()
	if d.plugs == 0 {
		run, d.held = d.held, nil
	}
	d.mu.Unlock()
	for _, f := range run {
		d.start(f)
	}
}

func (d *holdDev) start(f func()) {
	d.wg.Add(1)
	go func() { defer d.wg.Done(); f() }()
}

func (d *holdDev) submit(f func()) {
	d.mu.Lock()
	if d.plugs > 0 {
		d.held = append(d.held, f)
		d.maxHeld = max(d.maxHeld, len(d.held))
		d.mu.Unlock()
		return
	}
	d.mu.Unlock()
	d.start(f)
}

func (d *holdDev) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.submit(func() { done(d.ReadAtContext(ctx, p, off)) })
}

func (d *holdDev) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	d.submit(func() { done(d.WriteAtContext(ctx, p, off, fua)) })
}

// TestPlugging: requests read together are plugged together, and the plug is let go before
// the server waits — for the next request, for the rest of a write payload, for a slot —
// and after maxPlugged requests in a row.
func TestPlugging(t *testing.T) {
	leakcheck.Check(t)
	dev := &holdDev{memDev: &memDev{b: make([]byte, 1<<20)}}
	t.Cleanup(dev.wg.Wait)
	sock := startServer(t, Export{Name: "d", Dev: dev})
	cl := dial(t, sock, "d")
	_ = cl.c.SetDeadline(time.Now().Add(20 * time.Second))
	req := func(typ uint16, cookie uint64) []byte {
		b := make([]byte, requestSize)
		Request{Type: typ, Cookie: cookie, Offset: cookie % 64 * 4096, Length: 4096}.Put(b)
		return b
	}
	// A burst in one write, then nothing: every reply comes.
	var burst []byte
	for i := range 200 { // more than the 128 slots
		burst = append(burst, req(CmdRead, uint64(i))...)
	}
	if _, err := cl.c.Write(burst); err != nil {
		t.Fatal(err)
	}
	for range 200 {
		if _, e, _ := cl.recv(4096); e != 0 {
			t.Fatalf("errno %d", e)
		}
	}
	dev.mu.Lock()
	maxHeld := dev.maxHeld
	dev.mu.Unlock()
	if maxHeld > maxPlugged {
		t.Fatalf("a plug held %d requests back, more than %d", maxHeld, maxPlugged)
	}
	// A read, then a write whose payload is still on its way: the read is answered while
	// the server waits for the payload.
	first := append(req(CmdRead, 500), req(CmdWrite, 501)...)
	if _, err := cl.c.Write(append(first, make([]byte, 1000)...)); err != nil {
		t.Fatal(err)
	}
	if ck, e, _ := cl.recv(4096); ck != 500 || e != 0 {
		t.Fatalf("reply %d errno %d while the write's payload was outstanding", ck, e)
	}
	if _, err := cl.c.Write(make([]byte, 4096-1000)); err != nil {
		t.Fatal(err)
	}
	if ck, e, _ := cl.recv(0); ck != 501 || e != 0 {
		t.Fatalf("write reply %d errno %d", ck, e)
	}
	// One at a time.
	for i := range 20 {
		cl.send(Request{Type: CmdRead, Cookie: uint64(600 + i), Length: 4096}, nil)
		if ck, e, _ := cl.recv(4096); ck != uint64(600+i) || e != 0 {
			t.Fatalf("reply %d errno %d", ck, e)
		}
	}
	dev.mu.Lock()
	plugs, held := dev.plugs, len(dev.held)
	dev.mu.Unlock()
	if plugs != 0 || held != 0 {
		t.Fatalf("%d plugs, %d requests held after every reply came", plugs, held)
	}
	cl.c.Close()
}

// TestTrimWriteZeroes: TRIM becomes a discard, WRITE_ZEROES a zeroing that keeps the range
// allocated exactly when NO_HOLE is set; TRIM and WRITE_ZEROES are advertised only where the
// device takes them.
func TestTrimWriteZeroes(t *testing.T) {
	leakcheck.Check(t)
	dev := &memDev{b: bytes.Repeat([]byte{7}, 1<<20)}
	sock := startServer(t, Export{Name: "d", Dev: dev},
		Export{Name: "none", Dev: rangeDev{memDev: dev}},
		Export{Name: "trim", Dev: rangeDev{memDev: dev, discard: true}},
		Export{Name: "wz", Dev: rangeDev{memDev: dev, writeZeroes: true}})
	for name, want := range map[string]uint16{"d": tflagSendTrim | tflagWriteZeroes, "none": 0,
		"trim": tflagSendTrim, "wz": tflagWriteZeroes} {
		if got := dial(t, sock, name).flags & (tflagSendTrim | tflagWriteZeroes); got != want {
			t.Errorf("export %s: trim/write-zeroes flags %#x, want %#x", name, got, want)
		}
	}
	cl := dial(t, sock, "d")
	cl.send(Request{Type: CmdTrim, Cookie: 1, Offset: 4096, Length: 4096}, nil)
	cl.send(Request{Type: CmdWriteZeroes, Cookie: 2, Offset: 16384, Length: 8192}, nil)
	cl.send(Request{Type: CmdWriteZeroes, Flags: CmdFlagNoHole, Cookie: 3, Offset: 65536, Length: 512}, nil)
	for i := 0; i < 3; i++ {
		if ck, e, _ := cl.recv(0); e != 0 {
			t.Fatalf("request %d: errno %d", ck, e)
		}
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if dev.discards != 1 || dev.zeroes != 2 || dev.noHole != 1 {
		t.Errorf("discards %d zeroings %d of them no-hole %d, want 1 2 1", dev.discards, dev.zeroes, dev.noHole)
	}
	for _, r := range [][2]int{{4096, 4096}, {16384, 8192}, {65536, 512}} {
		if !bytes.Equal(dev.b[r[0]:r[0]+r[1]], make([]byte, r[1])) || dev.b[r[0]-1] != 7 || dev.b[r[0]+r[1]] != 7 {
			t.Errorf("range %d+%d not zeroed exactly", r[0], r[1])
		}
	}
}

// TestUnofferedCommands: a TRIM or WRITE_ZEROES the transmission flags did not offer is
// EINVAL, as the spec has it (a device's EOPNOTSUPP went out as ENOTSUP); a WRITE_ZEROES the
// device cannot do after all is ENOTSUP, on which clients write the zeroes themselves.
func TestUnofferedCommands(t *testing.T) {
	leakcheck.Check(t)
	dev := &memDev{b: make([]byte, 1<<20)}
	sock := startServer(t, Export{Name: "none", Dev: rangeDev{memDev: dev}}, Export{Name: "wz", Dev: notSupDev{rangeDev{memDev: dev, writeZeroes: true}}})
	cl := dial(t, sock, "none")
	cl.send(Request{Type: CmdTrim, Cookie: 1, Length: 4096}, nil)
	cl.send(Request{Type: CmdWriteZeroes, Cookie: 2, Length: 4096}, nil)
	for range 2 {
		if ck, e, _ := cl.recv(0); e != errInval {
			t.Errorf("request %d not offered: errno %d, want EINVAL", ck, e)
		}
	}
	cl = dial(t, sock, "wz")
	cl.send(Request{Type: CmdWriteZeroes, Cookie: 3, Length: 4096}, nil)
	if _, e, _ := cl.recv(0); e != errNotSup {
		t.Errorf("write-zeroes the device refuses: errno %d, want ENOTSUP", e)
	}
}

// notSupDev offers write-zeroes and refuses each (a server that changed its mind).
type notSupDev struct{ rangeDev }

func (notSupDev) WriteZeroes(context.Context, int64, int64, bool) error {
	return fmt.Errorf("refused: %w", syscall.EOPNOTSUPP)
}
