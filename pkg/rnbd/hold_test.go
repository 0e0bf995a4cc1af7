package rnbd

import (
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// TestHoldAndBeginUnmap: openers are counted and named; a normal unmap is EBUSY while there
// is one and changes nothing; once an unmap has begun a second one is EBUSY and no new
// opener gets in (ENODEV), and the device says so (Unmapping, which a front end still
// attaching looks at); abort undoes the mark; force goes through with openers, and the unmap
// calls their revoke.
func TestHoldAndBeginUnmap(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "a", 1<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "s", "a", AccessRW)

	rel1, err := d.Hold("device view file", nil)
	if err != nil {
		t.Fatal(err)
	}
	revoked := 0
	rel2, err := d.Hold("NBD client pid 7", func() { revoked++ })
	if err != nil {
		t.Fatal(err)
	}
	rel3, _ := d.Hold("device view file", nil)
	if got := d.Holders(); !slices.Equal(got, []string{"NBD client pid 7 ×1", "device view file ×2"}) {
		t.Errorf("holders %q", got)
	}
	_, err = d.BeginUnmap(false)
	if !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "device view file ×2") {
		t.Fatalf("normal unmap with openers: %v", err)
	}
	// Refused: a new opener still gets in, and a release twice counts once.
	rel4, err := d.Hold("device view file", nil)
	if err != nil {
		t.Fatalf("an opener after a refused unmap: %v", err)
	}
	rel4()
	rel4()
	rel1()
	rel3()
	rel2()
	if got := d.Holders(); len(got) != 0 {
		t.Fatalf("holders after every release: %q", got)
	}

	if d.Unmapping() {
		t.Fatal("unmapping before any unmap began")
	}
	abort, err := d.BeginUnmap(false)
	if err != nil {
		t.Fatal(err)
	}
	if !d.Unmapping() {
		t.Error("not unmapping once the unmap has begun (its CLOSE not sent yet)")
	}
	if _, err := d.BeginUnmap(true); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("a second unmap under way: %v", err)
	}
	if _, err := d.Hold("device view file", nil); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("an opener during an unmap: %v", err)
	}
	abort()
	if d.Unmapping() {
		t.Error("unmapping after the unmap was aborted")
	}
	rel, err := d.Hold("NBD client pid 8", func() { revoked++ })
	if err != nil {
		t.Fatalf("an opener after an aborted unmap: %v", err)
	}
	defer rel()

	abort, err = d.BeginUnmap(true)
	if err != nil {
		t.Fatalf("force with an opener: %v", err)
	}
	if revoked != 0 {
		t.Fatal("revoked before the unmap")
	}
	if err := d.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	abort() // after the unmap: does not bring the device back to openers
	if !d.Unmapping() {
		t.Error("not unmapping once unmapped")
	}
	if revoked != 1 {
		t.Errorf("revoke called %d times by the unmap, want 1", revoked)
	}
	if _, err := d.Hold("device view file", nil); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("an opener of an unmapped device: %v", err)
	}
	if err := d.ReadAtContext(context.Background(), make([]byte, 4096), 0); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("IO after the unmap: %v", err)
	}
}
