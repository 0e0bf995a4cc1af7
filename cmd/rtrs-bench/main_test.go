package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// The test binary doubles as the server process.
func TestMain(m *testing.M) {
	if args := os.Getenv("RTRS_BENCH_SERVER"); args != "" {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if err := run(ctx, []string{"server", "-listen", args, "-size", "64M", "-queue-depth", "64"}, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startServer runs a server process on addr and waits until it listens.
func startServer(t *testing.T, addr string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "RTRS_BENCH_SERVER="+addr)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitListen(t, addr)
	return cmd
}

// waitListen waits up to 10 s for a server process to listen on addr.
func waitListen(t *testing.T, addr string) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); ; {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			return
		}
		if time.Now().After(end) {
			t.Fatal("server process did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestTwoProcesses: verified random IO over two paths to a server in another process.
func TestTwoProcesses(t *testing.T) {
	port := freePort(t)
	startServer(t, fmt.Sprintf("127.0.0.1:%d", port))
	r, err := runClient(context.Background(), clientParams{
		paths: []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"}, port: uint16(port),
		bs: "8K", qd: 16, rw: "randrw", dur: 2 * time.Second, span: "16M", verify: true, cons: 2})
	if err != nil {
		t.Fatal(err)
	}
	if r.Ops < 1000 || r.Verified < 100 {
		t.Fatalf("%d requests, %d reads verified", r.Ops, r.Verified)
	}
	t.Logf("%d requests, %d reads verified against the written pattern", r.Ops, r.Verified)
}

// TestAsyncEngine: request chains resubmitted from completion callbacks, against a server
// process, QD1 and QD16.
func TestAsyncEngine(t *testing.T) {
	port := freePort(t)
	startServer(t, fmt.Sprintf("127.0.0.1:%d", port))
	for _, qd := range []int{1, 16} {
		r, err := runClient(context.Background(), clientParams{paths: []string{"ip:127.0.0.1@ip:127.0.0.1"}, port: uint16(port),
			bs: "4K", qd: qd, rw: "randrw", dur: time.Second, span: "16M", cons: 2, async: true})
		if err != nil {
			t.Fatal(err)
		}
		if r.Ops < 100 || r.P50us <= 0 {
			t.Fatalf("qd %d: %d requests, p50 %v", qd, r.Ops, r.P50us)
		}
	}
	if _, err := runClient(context.Background(), clientParams{paths: []string{"ip:127.0.0.1@ip:127.0.0.1"}, port: uint16(port),
		bs: "4K", qd: 1, rw: "randrw", dur: time.Second, span: "16M", verify: true, async: true}); err == nil {
		t.Fatal("-async with -verify accepted")
	}
}

// TestServerKilledAndRestarted: kill -9 of the server process mid-IO; the client's session
// goes down, reconnects to the restarted server by itself, and IO continues.
func TestServerKilledAndRestarted(t *testing.T) {
	port := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	srv := startServer(t, addr)
	src, dst, _ := transport.ParsePathAddrs("ip:127.0.0.1@ip:127.0.0.1")
	ev := make(chan transport.LinkEvent, 8)
	ctx := context.Background()
	sess, err := transport.Open(ctx, transport.ClientOptions{Provider: soft.New(soft.Options{}), SessName: "killtest",
		Paths: []transport.PathAddrs{{Src: src, Dst: dst}}, Port: uint16(port), ConPerPath: 2, MaxReconnectAttempts: -1,
		Timings:     transport.Timings{HeartbeatInterval: 100 * time.Millisecond, ReconnectDelay: 100 * time.Millisecond, ReconnectBackoff: 10 * time.Millisecond},
		OnLinkEvent: func(e transport.LinkEvent) { ev <- e }})
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	hdr := make([]byte, 8)
	binary.LittleEndian.PutUint64(hdr, 4096)
	buf := make([]byte, 4096)
	if err := sess.Do(ctx, transport.Write, hdr, buf); err != nil {
		t.Fatal(err)
	}
	// IO in flight while the server dies.
	done := make(chan error, 64)
	for i := 0; i < 32; i++ {
		go func() {
			b := make([]byte, 4096)
			for j := 0; j < 200; j++ {
				if err := sess.Do(ctx, transport.Read, hdr, b); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	time.Sleep(20 * time.Millisecond)
	_ = srv.Process.Kill()
	_ = srv.Wait()
	select {
	case e := <-ev:
		if e != transport.LinkDisconnected {
			t.Fatalf("event %v", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the client did not notice the server's death")
	}
	// Requests in flight at the kill fail with a clear error, none hangs.
	for i := 0; i < 32; i++ {
		if err := <-done; err != nil && !errors.Is(err, transport.ErrNoPath) {
			t.Fatalf("request during the kill: %v", err)
		}
	}
	startServer(t, addr)
	select {
	case e := <-ev:
		if e != transport.LinkReconnected {
			t.Fatalf("event %v", e)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no reconnect to the restarted server")
	}
	if err := sess.Do(ctx, transport.Write, hdr, buf); err != nil {
		t.Fatalf("IO after the restart: %v", err)
	}
}
