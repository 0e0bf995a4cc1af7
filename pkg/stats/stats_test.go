package stats

import (
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

func TestClientPathFiles(t *testing.T) {
	s := &ClientPath{MigFrom: make([]Counter, 4), MigTo: make([]Counter, 4)}
	if got := s.RDMA(); got != "0 0 0 0 0 0\n" {
		t.Fatalf("fresh rdma %q", got)
	}
	if got := s.Reconnects(); got != "0 0\n" {
		t.Fatalf("fresh reconnects %q", got)
	}
	s.Done(true, 4096+32, 500*time.Microsecond, 0, 0, 1)
	s.Done(false, 8192+32, 3*time.Millisecond, 1, 2, 1)
	s.Done(false, 32, 70*time.Second, 3, 3, 0)
	s.Inflight.Add(2)
	s.Failovered.Inc()
	s.ReconnectOK.Inc()
	s.ReconnectFail.Add(2)
	s.HandlerCall(3)
	s.HandlerCall(1)
	s.HandlerCall(0)
	for name, c := range map[string]struct{ got, want string }{
		"rdma":               {s.RDMA(), "1 4128 2 8256 2 1\n"},
		"reconnects":         {s.Reconnects(), "1 2\n"},
		"cpu_migration_from": {s.CPUMigrationFrom(), "0 1 0 0 \n"},
		"cpu_migration_to":   {s.CPUMigrationTo(), "0 0 1 0 \n"},
		"wc_completion":      {s.WCCompletion(), "3 2\n"},
		"sg_entries":         {s.SGEntriesTable(), "0: 1\n1: 2\n"},
		"cpu_migration":      {s.CPUMigration(), "     CPU0 CPU1 CPU2 CPU3\nfrom:    0    1    0    0\nto  :    0    0    1    0\n"},
	} {
		if c.got != c.want {
			t.Errorf("%s: %q, want %q", name, c.got, c.want)
		}
	}
	lat := s.RDMALat()
	lines := strings.Split(strings.TrimSuffix(lat, "\n"), "\n")
	if len(lines) != LatBuckets+2 || lines[0] != "1 ms: 1 0" || lines[2] != "4 ms: 0 1" ||
		lines[LatBuckets] != ">= 65536 ms: 0 1" || lines[LatBuckets+1] != "maximum ms: 0 70000" || lines[16] != "65536 ms: 0 0" {
		t.Fatalf("rdma_lat:\n%s", lat)
	}
	// A reset starts the files again and leaves the totals alone.
	s.ResetRDMA()
	if got := s.RDMA(); got != "0 0 0 0 2 0\n" {
		t.Fatalf("after reset %q", got)
	}
	if s.WriteCnt.Total() != 2 {
		t.Fatal("reset touched the total")
	}
	s.ResetAll()
	if s.RDMA() != "0 0 0 0 0 0\n" || s.Reconnects() != "0 0\n" || s.WCCompletion() != "0 0\n" || !strings.HasPrefix(s.RDMALat(), "1 ms: 0 0\n") {
		t.Fatal("reset_all left something")
	}
	// inflight can go negative after reset_all and prints as unsigned, as in the kernel.
	s.Inflight.Add(-1)
	if got := s.RDMA(); got != "0 0 0 0 4294967295 0\n" {
		t.Fatalf("negative inflight %q", got)
	}
}

func TestServerPathFiles(t *testing.T) {
	var s ServerPath
	s.Request(true, 100, 0)
	s.Request(false, 200, 1)
	s.Request(false, 300, 7)
	s.Inflight.Add(1)
	s.HandlerCall(4)
	s.HandlerCall(2)
	if s.RDMA() != "1 100 2 500\n" || s.WCCompletion() != "4 6 2\n" {
		t.Fatalf("%q %q", s.RDMA(), s.WCCompletion())
	}
	// wc_completion's reset leaves the rdma counters alone.
	s.ResetWCCompletion()
	if s.RDMA() != "1 100 2 500\n" || s.WCCompletion() != "0 0 0\n" {
		t.Fatalf("after the wc_completion reset: %q %q", s.RDMA(), s.WCCompletion())
	}
	s.HandlerCall(3)
	s.ResetAll()
	if s.RDMA() != "0 0 0 0\n" || s.WCCompletion() != "0 0 0\n" {
		t.Fatal("reset")
	}
}

func TestConcurrentCounting(t *testing.T) {
	s := NewClientPath()
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 1000; i++ {
				s.Done(i%2 == 0, 10, time.Millisecond, CPU(), CPU(), 1)
				s.HandlerCall(i%5 + 1)
			}
		}()
	}
	wg.Wait()
	if s.ReadCnt.Value()+s.WriteCnt.Value() != 8000 || s.WCMax.Value() != 5 {
		t.Fatal(s.RDMA(), s.WCCompletion())
	}
}

func TestSharded(t *testing.T) {
	var c Sharded
	for i := -3; i < 13; i++ {
		c.Inc(i)
	}
	c.Add(5, 10)
	if c.Value() != 26 || c.Total() != 26 {
		t.Fatalf("value %d total %d, want 26", c.Value(), c.Total())
	}
	c.Reset()
	c.Inc(7)
	if c.Value() != 1 || c.Total() != 27 {
		t.Fatalf("after reset: value %d total %d, want 1 and 27", c.Value(), c.Total())
	}
	if unsafe.Sizeof(c.s[0]) != 128 {
		t.Fatalf("shard of %d bytes", unsafe.Sizeof(c.s[0]))
	}
}

// TestCPU: the CPU number agrees with getcpu(2) on a locked thread.
func TestCPU(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	agree := 0
	for range 100 {
		if CPU() == getcpu() {
			agree++
		}
	}
	// The thread may move between the two calls, rarely.
	if agree < 90 {
		t.Fatalf("CPU() agreed with getcpu %d times in 100", agree)
	}
	if n := runtime.NumCPU(); CPU() < 0 || CPU() >= 4096 || (n < 4096 && CPU() >= n*2) {
		t.Fatalf("CPU() = %d on %d CPUs", CPU(), n)
	}
}

func BenchmarkCPU(b *testing.B) {
	for b.Loop() {
		_ = CPU()
	}
}

// BenchmarkSharedCounter and BenchmarkSharded: increments from every CPU at once, on one
// counter and on a sharded one (hints that vary per update, as chunk ids do).
func BenchmarkSharedCounter(b *testing.B) {
	var c Counter
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c.Inc()
		}
	})
}

func BenchmarkSharded(b *testing.B) {
	var c Sharded
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			c.Inc(i)
			i += 3
		}
	})
}

// TestLatencyBuckets: the fine buckets, their bounds, and rdma_lat's rows made of them.
func TestLatencyBuckets(t *testing.T) {
	for _, c := range []struct {
		d time.Duration
		b int
	}{{0, 0}, {-time.Second, 0}, {3906 * time.Nanosecond, 0}, {3907 * time.Nanosecond, 1}, {50 * time.Microsecond, 4},
		{999 * time.Microsecond, 8}, {time.Millisecond, 9}, {65535 * time.Millisecond, LatFine - 1}, {65536 * time.Millisecond, LatFine}, {time.Hour, LatFine}} {
		b := latFine(c.d)
		if b != c.b {
			t.Errorf("latFine(%v) = %d, want %d", c.d, b, c.b)
		}
		if b < LatFine && c.d.Seconds() >= LatBoundSeconds(b) {
			t.Errorf("%v in bucket %d bounded by %g s", c.d, b, LatBoundSeconds(b))
		}
		if b > 0 && c.d.Seconds() < LatBoundSeconds(b-1) {
			t.Errorf("%v in bucket %d belongs lower", c.d, b)
		}
	}
	if LatBoundSeconds(0) != 3.90625e-06 || LatBoundSeconds(8) != 0.001 || LatBoundSeconds(LatFine-1) != 65.536 {
		t.Fatalf("bounds %g %g %g", LatBoundSeconds(0), LatBoundSeconds(8), LatBoundSeconds(LatFine-1))
	}
	s := NewClientPath()
	for _, d := range []time.Duration{10 * time.Microsecond, 300 * time.Microsecond, 1500 * time.Microsecond, 100 * time.Second} {
		s.Done(true, 1, d, 0, 0, 1)
	}
	if lat := s.RDMALat(); !strings.HasPrefix(lat, "1 ms: 2 0\n2 ms: 1 0\n4 ms: 0 0\n") || !strings.Contains(lat, ">= 65536 ms: 1 0\nmaximum ms: 100000 0\n") {
		t.Fatalf("rdma_lat:\n%s", lat)
	}
	s.ResetAll()
	s.Done(true, 1, 20*time.Microsecond, 0, 0, 1)
	b, n, sum := s.LatRead.Snapshot()
	if n != 5 || sum != uint64(10*time.Microsecond+300*time.Microsecond+1500*time.Microsecond+100*time.Second+20*time.Microsecond) ||
		b[latFine(10*time.Microsecond)] != 1 || b[latFine(20*time.Microsecond)] != 1 || b[LatFine] != 1 {
		t.Fatalf("snapshot after reset_all: %v %d %d", b, n, sum)
	}
	if !strings.HasPrefix(s.RDMALat(), "1 ms: 1 0\n2 ms: 0 0\n") {
		t.Fatalf("rdma_lat after reset_all:\n%s", s.RDMALat())
	}
}

// A request without data that is between its write count and its sg0 count when
// sg_entries is reset must not make the file show 2^64-1 afterwards.
func TestSGEntriesResetMidRequest(t *testing.T) {
	s := &ClientPath{MigFrom: make([]Counter, 1), MigTo: make([]Counter, 1)}
	s.WriteCnt.Inc() // Done's first count of a flush
	s.ResetSGEntries()
	s.sg0.Inc() // and its last
	if got := s.SGEntriesTable(); got != "0: 1\n1: 0\n" {
		t.Fatalf("sg_entries %q", got)
	}
	s.Done(true, 4096, time.Millisecond, 0, 0, 1)
	if got := s.SGEntriesTable(); got != "0: 1\n1: 0\n" && got != "0: 1\n1: 1\n" {
		t.Fatalf("sg_entries after a read %q", got)
	}
}
