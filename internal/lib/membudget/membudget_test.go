package membudget

import (
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

func TestReserveWithinLimit(t *testing.T) {
	b := New(100)
	if !b.Reserve(60) || b.Reserve(41) || !b.Reserve(40) || b.Reserve(1) {
		t.Fatalf("reservations of 60, 41, 40, 1 against 100: used %d", b.Used())
	}
	b.Cancel(40)
	if b.Used() != 60 {
		t.Fatalf("used %d after a cancel, want 60", b.Used())
	}
	off := New(-1)
	if off.Reserve(1) || off.Used() != 0 {
		t.Fatal("an off budget reserved")
	}
}

func TestReleaseWhen(t *testing.T) {
	b := New(100)
	b.Reserve(30)
	b.Reserve(20)
	now := make(chan struct{})
	close(now)
	b.ReleaseWhen(30, now)
	if b.Used() != 20 {
		t.Fatalf("used %d after a release already due, want 20", b.Used())
	}
	later := make(chan struct{})
	b.ReleaseWhen(20, later)
	if b.Used() != 20 {
		t.Fatalf("used %d before the memory came back, want 20", b.Used())
	}
	close(later)
	testutil.WaitFor(t, 5*time.Second, "the kept memory uncounted", func() bool { return b.Used() == 0 })
}
