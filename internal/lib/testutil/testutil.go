// Package testutil holds what the tests of several packages share.
package testutil

import (
	"encoding/hex"
	"net"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/log"
)

// WaitFor polls cond every 10 ms for up to d and fails the test, naming what, if it never
// holds.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Timings has transport.Timings's fields, which this package cannot name (transport's own
// tests import it): a test takes transport.Timings(testutil.FastTimings()), a conversion that
// stops compiling when the two types drift apart.
type Timings struct {
	HeartbeatInterval time.Duration
	HeartbeatMissed   int
	ConnectTimeout    time.Duration
	ReconnectDelay    time.Duration
	ReconnectBackoff  time.Duration
	ZombieTimeout     time.Duration
}

// FastTimings are the RTRS timers of tests: a dead path noticed in 150 ms and reconnected
// 100 ms later.
func FastTimings() Timings {
	t := Timings{HeartbeatInterval: 50 * time.Millisecond, HeartbeatMissed: 3, ConnectTimeout: 5 * time.Second,
		ReconnectDelay: 100 * time.Millisecond, ReconnectBackoff: 10 * time.Millisecond, ZombieTimeout: 5 * time.Second}
	if os.Getenv("RTRS_TEST_PROVIDER") != "" {
		// The VM's emulated CPUs answer a heartbeat late often enough that 150 ms of silence
		// is no sign of a dead path there. Over rxe, about one reconnect in ten made 50 ms
		// after the teardown got a DISCONNECTED right after it was established (not yet
		// understood; the kernel and our defaults wait 30 s), so the tests wait a second.
		t.HeartbeatInterval, t.ConnectTimeout, t.ReconnectDelay = 500*time.Millisecond, 20*time.Second, time.Second
	}
	return t
}

// Unhex decodes hex with any white space in it (golden bytes laid out by field).
func Unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Main runs a package's tests with warnings and errors logged, the rest (expected path
// up/down messages) not.
func Main(m *testing.M) {
	// RTRS_TEST_LOG raises the level where a failure needs the story (debug in the VM bed).
	level := os.Getenv("RTRS_TEST_LOG")
	if level == "" {
		level = "warning"
	}
	if _, err := log.Setup(log.Options{Level: level}); err != nil {
		panic(err)
	}
	os.Exit(m.Run())
}

// TCPPair returns the two ends of a loopback TCP connection, closed when the test ends.
func TCPPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

// Resident counts the pages of the mapping b that are in memory (mincore(2)).
func Resident(t testing.TB, b []byte) int {
	t.Helper()
	vec := make([]byte, (len(b)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatalf("mincore: %v", e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}
