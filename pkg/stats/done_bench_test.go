package stats

import (
	"testing"
	"time"
)

// BenchmarkClientPathDone is what the client's IO path pays per finished request for its
// statistics (counts, bytes, the latency histogram, CPU migration, sg_entries).
func BenchmarkClientPathDone(b *testing.B) {
	s := NewClientPath()
	lats := []time.Duration{40 * time.Microsecond, 90 * time.Microsecond, 700 * time.Microsecond, 3 * time.Millisecond}
	i := 0
	for b.Loop() {
		s.Done(i&1 == 0, 4096, lats[i&3], 0, 0, 1)
		i++
	}
}

// BenchmarkServerPathRequest is what the server's IO path pays per request.
func BenchmarkServerPathRequest(b *testing.B) {
	var s ServerPath
	i := 0
	for b.Loop() {
		s.Request(i&1 == 0, 4096, i)
		i++
	}
}
