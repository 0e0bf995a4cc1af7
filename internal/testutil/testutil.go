// Package testutil holds what the tests of several packages share.
package testutil

import (
	"testing"
	"time"
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
