package main

import (
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestUblkFlags: bad ublk settings stop the daemon before it does anything; good ones run.
func TestUblkFlags(t *testing.T) {
	for _, args := range [][]string{{"-ublk-attach", "yes"}, {"-ublk-queues", "0"}, {"-ublk-queues", "many"}, {"-ublk-depth", "0"}, {"-ublk-depth", "4097"},
		{"-ublk-registered-memory", "0"}, {"-ublk-registered-memory", "lots"}, {"-ublk-registered-memory", "-1G"}} {
		if err := run(t.Context(), append([]string{"-config", "/dev/null", "-cleanup"}, args...)); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	for _, v := range []string{"off", "64M"} {
		if err := run(t.Context(), []string{"-config", "/dev/null", "-cleanup", "-ublk-registered-memory", v,
			"-mount", t.TempDir() + "/a", "-dev-mount", t.TempDir() + "/b"}); err != nil {
			t.Errorf("-ublk-registered-memory %s: %v", v, err)
		}
	}
}

// TestUblkRegisteredBound: the ublk queues' registered buffers stay within the bound, over
// all devices; buffers given back are uncounted, those the session keeps past the free only
// once it gives them back; off takes none.
func TestUblkRegisteredBound(t *testing.T) {
	u := &ublkAttacher{regLimit: 3 << 20}
	if !u.reserve(2<<20) || u.reserve(2<<20) || !u.reserve(1<<20) || u.reserve(1) {
		t.Fatalf("reserving 2, 2, 1 MiB and a byte within 3 MiB: %d counted", u.regMem.Load())
	}
	done := make(chan struct{})
	close(done)
	u.unreserve(1<<20, done)
	kept := make(chan struct{})
	u.unreserve(2<<20, kept) // kept by the session
	if got := u.regMem.Load(); got != 2<<20 || u.reserve(2<<20) {
		t.Fatalf("with 2 MiB kept: %d counted, want %d, and no room for 2 MiB", got, 2<<20)
	}
	close(kept)
	testutil.WaitFor(t, 10*time.Second, "the kept buffers uncounted", func() bool { return u.regMem.Load() == 0 })
	if off := (&ublkAttacher{regLimit: -1}); off.reserve(1) {
		t.Fatal("-ublk-registered-memory off reserved memory")
	}
}
