package daemon

import "testing"

// The default chunk memory bound is half of what the process may use: never more than half
// the machine, and within its cgroup's limit when it has one.
func TestDefaultChunkMemory(t *testing.T) {
	got := DefaultChunkMemory()
	m := physMemory()
	if got != m/2 || m <= 0 {
		t.Fatalf("default %d, memory %d", got, m)
	}
	if lim, ok := cgroupMemoryMax(); ok && m > lim {
		t.Fatalf("memory %d above the cgroup's limit %d", m, lim)
	}
	t.Logf("memory the process may use: %d MiB", m>>20)
}
