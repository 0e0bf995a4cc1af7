package nbd

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// startTLSServer serves exps on a loopback TCP listener that requires TLS with client
// certificates from pki.
func startTLSServer(t *testing.T, pki *testutil.PKI, exps ...Export) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{pki.Issue(t, "nbd-server", true)},
		ClientCAs: pki.Pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
	s := NewServer(Options{Exports: func() []Export { return exps }, HandshakeTimeout: 5 * time.Second})
	done := make(chan error, 1)
	go func() { done <- s.ServeTLS(ln, cfg) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return ln.Addr().String()
}

// startTLS sends NBD_OPT_STARTTLS and runs a TLS handshake with the client certificate
// cert (none if nil) trusting roots.
func startTLS(t *testing.T, c net.Conn, cert *tls.Certificate, roots *testutil.PKI) (*tls.Conn, error) {
	t.Helper()
	sendOpt(t, c, optStartTLS, nil)
	if _, typ, data := readOptReply(t, c); typ != repAck {
		t.Fatalf("STARTTLS: reply %#x %q", typ, data)
	}
	cfg := &tls.Config{RootCAs: roots.Pool, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		return nil, err
	}
	// With TLS 1.3 a refused client certificate shows at the first read.
	sendOpt(t, tc, optList, nil)
	var h [20]byte
	if _, err := io.ReadFull(tc, h[:]); err != nil {
		return nil, err
	}
	rest := make([]byte, binary.BigEndian.Uint32(h[16:]))
	if _, err := io.ReadFull(tc, rest); err != nil {
		return nil, err
	}
	for binary.BigEndian.Uint32(h[12:]) != repAck {
		if _, err := io.ReadFull(tc, h[:]); err != nil {
			return nil, err
		}
		rest = make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(tc, rest); err != nil {
			return nil, err
		}
	}
	return tc, nil
}

// A listener that requires TLS refuses every option before STARTTLS, admits a client with a
// certificate of its CA and serves it inside TLS, and refuses clients with a certificate of
// another CA or none.
func TestNBDStartTLS(t *testing.T) {
	leakcheck.Check(t)
	pki, other := testutil.NewPKI(t, "rtrs-test-ca"), testutil.NewPKI(t, "another-ca")
	dev := &memDev{b: make([]byte, 1<<20)}
	for i := range dev.b {
		dev.b[i] = byte(i * 7)
	}
	addr := startTLSServer(t, pki, Export{Name: "d", Dev: dev})

	// Options in clear get NBD_REP_ERR_TLS_REQD; EXPORT_NAME, which has no reply, ends it.
	c := helloOn(t, "tcp", addr)
	sendOpt(t, c, optGo, goData("d"))
	if _, typ, _ := readOptReply(t, c); typ != repErrTLSReqd {
		t.Fatalf("GO before STARTTLS: reply %#x, want TLS_REQD", typ)
	}
	sendOpt(t, c, optList, nil)
	if _, typ, _ := readOptReply(t, c); typ != repErrTLSReqd {
		t.Fatalf("LIST before STARTTLS: reply %#x, want TLS_REQD", typ)
	}
	sendOpt(t, c, optExportName, []byte("d"))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("EXPORT_NAME in clear was answered (%d bytes)", n)
	}

	// A good certificate: GO and IO inside TLS.
	good := pki.Issue(t, "client-a", false)
	tc, err := startTLS(t, helloOn(t, "tcp", addr), &good, pki)
	if err != nil {
		t.Fatalf("client with a certificate of the CA: %v", err)
	}
	sendOpt(t, tc, optGo, goData("d"))
	for {
		var h [20]byte
		if _, err := io.ReadFull(tc, h[:]); err != nil {
			t.Fatal(err)
		}
		rest := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(tc, rest); err != nil {
			t.Fatal(err)
		}
		if typ := binary.BigEndian.Uint32(h[12:]); typ == repAck {
			break
		} else if typ != repInfo {
			t.Fatalf("GO: reply %#x", typ)
		}
	}
	cl := &client{t: t, c: tc}
	cl.send(Request{Type: CmdRead, Cookie: 9, Offset: 4096, Length: 8192}, nil)
	if cookie, errno, data := cl.recv(8192); cookie != 9 || errno != 0 || !bytes.Equal(data, dev.b[4096:4096+8192]) {
		t.Fatalf("read inside TLS: cookie %d errno %d", cookie, errno)
	}
	// DISC: TLS is shut down before the socket closes: a close_notify record arrives, then
	// the EOF (Go's TLS takes a bare close at a record boundary as EOF too, so the record is
	// looked for on the socket itself).
	cl.send(Request{Type: CmdDisc}, nil)
	if b, err := io.ReadAll(tc.NetConn()); err != nil || len(b) == 0 {
		t.Fatalf("after DISC: %d bytes on the socket before its close (%v), want a close_notify record", len(b), err)
	}

	// A client without fixed newstyle cannot be told TLS is required: it is closed at once.
	old, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	_ = old.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(old, make([]byte, 18)); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Write([]byte{0, 0, 0, flagNoZeroes}); err != nil {
		t.Fatal(err)
	}
	if n, err := old.Read(make([]byte, 1)); err == nil {
		t.Fatalf("a client without fixed newstyle got %d bytes on a TLS listener", n)
	}

	// A certificate of another CA, and none at all, are refused.
	bad := other.Issue(t, "intruder", false)
	if _, err := startTLS(t, helloOn(t, "tcp", addr), &bad, pki); err == nil {
		t.Fatal("a client certificate of another CA was taken")
	}
	if _, err := startTLS(t, helloOn(t, "tcp", addr), nil, pki); err == nil {
		t.Fatal("a client without a certificate was taken")
	}
}

// Connections past the bound per address are closed at once, and the listener goes on.
func TestNBDConnectionBound(t *testing.T) {
	leakcheck.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dev := &memDev{b: make([]byte, 64<<10)}
	s := NewServer(Options{Exports: func() []Export { return []Export{{Name: "d", Dev: dev}} }, MaxConnsPerAddr: 3, HandshakeTimeout: 5 * time.Second})
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	t.Cleanup(func() { s.Close(); <-done })
	var held []net.Conn
	for range 3 {
		held = append(held, helloOn(t, "tcp", ln.Addr().String()))
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 18)); err == nil {
		t.Fatalf("a 4th connection from one address got %d bytes of greeting", n)
	}
	// Loopback counts as one address: any local user can pick another 127.x.y.z.
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	c2, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_ = c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c2.Read(make([]byte, 18)); err == nil {
		t.Fatalf("a 4th loopback connection, from 127.0.0.2, got %d bytes of greeting", n)
	}
	held[0].Close()
	time.Sleep(50 * time.Millisecond)
	helloOn(t, "tcp", ln.Addr().String()) // a slot is free again
}

// TestNBDConnectionBoundPerListener: the clients of one listener (a TCP port, which any
// local user may reach) filling MaxConns do not keep those of another (the unix socket) out.
func TestNBDConnectionBoundPerListener(t *testing.T) {
	leakcheck.Check(t)
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sock := t.TempDir() + "/nbd.sock"
	unix, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	dev := &memDev{b: make([]byte, 64<<10)}
	s := NewServer(Options{Exports: func() []Export { return []Export{{Name: "d", Dev: dev}} }, MaxConns: 4, HandshakeTimeout: 5 * time.Second})
	done := make(chan error, 2)
	go func() { done <- s.Serve(tcp) }()
	go func() { done <- s.Serve(unix) }()
	t.Cleanup(func() { s.Close(); <-done; <-done })
	for range 4 {
		helloOn(t, "tcp", tcp.Addr().String())
	}
	c, err := net.Dial("tcp", tcp.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 18)); err == nil {
		t.Fatalf("a 5th TCP connection got %d bytes of greeting", n)
	}
	helloOn(t, "unix", sock) // the socket's clients are not held up by TCP's
}
