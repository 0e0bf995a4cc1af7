package transport

import "testing"

func TestPermitsLowestFirst(t *testing.T) {
	p := newPermits(130)
	for i := 0; i < 130; i++ {
		if got, ok := p.tryGet(); !ok || got != i {
			t.Fatalf("permit %d: %d %v", i, got, ok)
		}
	}
	if _, ok := p.tryGet(); ok {
		t.Fatal("131st permit")
	}
	p.put(70)
	p.put(3)
	if got, _ := p.tryGet(); got != 3 {
		t.Fatalf("lowest free is 3, got %d", got)
	}
	if got, _ := p.tryGet(); got != 70 {
		t.Fatalf("then 70, got %d", got)
	}
}
