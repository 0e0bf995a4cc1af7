package transport

import (
	"runtime/metrics"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// forcedGCs counts the collections the program asked for (debug.FreeOSMemory is one).
func forcedGCs() uint64 {
	s := []metrics.Sample{{Name: "/gc/cycles/forced:gc-cycles"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// A session that goes has the server hand the heap back to the system soon after, without
// waiting for the next collection; a server closed meanwhile leaves nothing running.
func TestHeapReturnedAfterSessions(t *testing.T) {
	leakcheck.Check(t)
	e := newLimitedEnv(t, func(*ServerOptions) {})
	s := e.open(t, "heap", paths(t, path1()), nil)
	before := forcedGCs()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "memory returned after the session went", func() bool { return forcedGCs() > before })

	s = e.open(t, "heap", paths(t, path1()), nil)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the session gone", func() bool { return e.srv.ChunkMemory() == 0 })
	if err := e.srv.Close(); err != nil {
		t.Fatal(err)
	}
}
