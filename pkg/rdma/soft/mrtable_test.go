package soft

import (
	"runtime/metrics"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

func heapAllocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// Registering and deregistering a region costs about the region, whatever the number of
// regions: a server registers one per chunk and path, and a table copied on each change
// allocated n²/2 pointers for n regions (3 GB for the 20 000 here).
func TestManyRegionsCheap(t *testing.T) {
	const n = 20000
	dev, err := New(Options{}).OpenDevice("soft_lo")
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	d := dev.(*device)
	before := heapAllocated()
	mrs := make([]rdma.MR, n)
	for i := range mrs {
		if mrs[i], err = pd.AllocFastRegMR(4096, 0); err != nil {
			t.Fatal(err)
		}
	}
	for i, m := range mrs {
		if got := d.lookup(m.RKey()); got != m.(*mr) {
			t.Fatalf("region %d: key %#x finds %p", i, m.RKey(), got)
		}
	}
	old, last := mrs[n/2].RKey(), mrs[n-1].RKey()
	for _, m := range mrs {
		if err := m.Dereg(); err != nil {
			t.Fatal(err)
		}
	}
	if got := d.lookup(old); got != nil {
		t.Fatalf("key %#x still finds a region after Dereg", old)
	}
	again, err := pd.AllocFastRegMR(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if k := again.RKey(); k>>8 != last>>8 || k == last || d.lookup(k) != again.(*mr) {
		t.Fatalf("the last freed index reused: key %#x, the freed one was %#x", k, last)
	}
	_ = again.Dereg()
	got := heapAllocated() - before
	if got > 32<<20 {
		t.Fatalf("%d regions registered and deregistered allocated %d MiB", n, got>>20)
	}
	t.Logf("%d regions registered and deregistered: %d MiB allocated", n, got>>20)
}
