package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// buildBench builds rtrs-bench without the race detector: a race-enabled process keeps the
// detector's shadow of every heap page it ever used resident, whatever the program frees.
func buildBench(t *testing.T, ctx context.Context) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "rtrs-bench")
	cmd := exec.CommandContext(ctx, "go", "build", "-buildvcs=false", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// benchProc starts `rtrs-bench args...`; it is killed at the latest when ctx ends.
func benchProc(t *testing.T, ctx context.Context, bin string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd
}

// procMem is a process's resident memory by kind (/proc/PID/status), in bytes.
type procMem struct{ rss, anon, file, shmem int64 }

func (m procMem) String() string {
	return fmt.Sprintf("VmRSS %d MiB (RssAnon %d, RssFile %d, RssShmem %d)", m.rss>>20, m.anon>>20, m.file>>20, m.shmem>>20)
}

func readMem(t *testing.T, pid int) procMem {
	t.Helper()
	var m procMem
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(st), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		kb, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			m.rss = kb << 10
		case "RssAnon:":
			m.anon = kb << 10
		case "RssFile:":
			m.file = kb << 10
		case "RssShmem:":
			m.shmem = kb << 10
		}
	}
	return m
}

// establishedTo counts the established TCP connections whose local port is port: the
// server's ends of its clients' connections.
func establishedTo(t *testing.T, port int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) < 4 || f[3] != "01" {
			continue
		}
		if _, p, ok := strings.Cut(f[1], ":"); ok {
			if v, err := strconv.ParseUint(p, 16, 16); err == nil && int(v) == port {
				n++
			}
		}
	}
	return n
}

// TestMemoryReturnedAfterClientProcesses: client processes, each with two source addresses
// of its own and two paths, run verified random IO against an `rtrs-bench server` process.
// Half are killed (SIGKILL: the server sees their connections reset), half finish and close
// their sessions. Within 30 s of the last one's exit the server's RssAnon must be back within
// 64 MiB of what it was before the first client came.
//
// The server's store is 256 MiB, as large as the server's own memory at load or larger, as in
// the run (1 GiB); the clients use its first 16 MiB, so at most that much of the store
// is resident and in RssAnon. The store is memory, so RssFile and RssShmem only hold the
// binary's pages.
func TestMemoryReturnedAfterClientProcesses(t *testing.T) {
	const (
		clients = 6
		cons    = 3 // per path
		bound   = 64 << 20
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	bin := buildBench(t, ctx)
	port := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	srv := benchProc(t, ctx, bin, "server", "-listen", addr, "-size", "256M")
	defer func() {
		_ = srv.Process.Signal(syscall.SIGTERM)
		_ = srv.Wait()
	}()
	pid := srv.Process.Pid
	waitListen(t, addr)
	idle := readMem(t, pid)
	t.Logf("idle: %v", idle)

	cl := make([]*exec.Cmd, clients)
	for i := range cl {
		cl[i] = benchProc(t, ctx, bin, "client", "-port", strconv.Itoa(port),
			"-path", fmt.Sprintf("ip:127.0.1.%d@ip:127.0.0.1", i+1), "-path", fmt.Sprintf("ip:127.0.2.%d@ip:127.0.0.1", i+1),
			"-cons", strconv.Itoa(cons), "-qd", "64", "-rw", "randrw", "-verify", "-duration", "5s", "-size", "16M")
	}
	for end := time.Now().Add(60 * time.Second); establishedTo(t, port) < clients*2*cons; {
		if time.Now().After(end) {
			t.Fatalf("%d of %d connections established", establishedTo(t, port), clients*2*cons)
		}
		time.Sleep(50 * time.Millisecond)
	}
	peak := idle
	sample := func() {
		if m := readMem(t, pid); m.anon > peak.anon {
			peak = m
		}
	}
	for range 20 {
		time.Sleep(100 * time.Millisecond)
		sample()
	}
	for _, c := range cl[:clients/2] {
		_ = c.Process.Kill()
		_ = c.Wait()
	}
	exited := make(chan error, clients)
	for _, c := range cl[clients/2:] {
		go func() { exited <- c.Wait() }()
	}
	for left := clients - clients/2; left > 0; {
		select {
		case err := <-exited:
			if err != nil {
				t.Fatalf("a client that should have finished: %v", err)
			}
			left--
		case <-time.After(100 * time.Millisecond):
			sample()
		}
	}
	t.Logf("peak: %v", peak)
	gone := time.Now()
	var after procMem
	for {
		after = readMem(t, pid)
		if after.anon <= idle.anon+bound {
			break
		}
		if time.Since(gone) > 30*time.Second {
			t.Fatalf("30 s after the last client: %v, bound RssAnon %d MiB (idle + %d MiB)", after, (idle.anon+bound)>>20, bound>>20)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("%v after the last client: %v", time.Since(gone).Round(100*time.Millisecond), after)
}
