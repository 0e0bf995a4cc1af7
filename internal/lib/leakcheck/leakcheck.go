// Package leakcheck fails a test that leaves goroutines of this module running.
package leakcheck

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

const module = "github.com/rtrs-go/rtrs/"

// Check records the goroutines running now and, when the test ends, waits up to 10 s for every
// newer goroutine that runs code of this module to exit; it fails the test with their stacks
// otherwise.
func Check(t testing.TB) {
	t.Helper()
	before := ids()
	t.Cleanup(func() {
		var left []string
		for deadline := time.Now().Add(10 * time.Second); ; {
			left = left[:0]
			for id, stack := range goroutines() {
				if _, old := before[id]; !old && strings.Contains(stack, module) && !strings.Contains(stack, "leakcheck.") {
					left = append(left, stack)
				}
			}
			if len(left) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if len(left) > 0 {
			t.Errorf("%d goroutine(s) leaked:\n%s", len(left), strings.Join(left, "\n\n"))
		}
	})
}

func ids() map[string]struct{} {
	m := map[string]struct{}{}
	for id := range goroutines() {
		m[id] = struct{}{}
	}
	return m
}

// goroutines returns the stacks of all goroutines keyed by their "goroutine N" header.
func goroutines() map[string]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	m := map[string]string{}
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(g, " [")
		m[head] = g
	}
	return m
}
