package daemon

import (
	"context"
	"os/signal"
	"syscall"
	"testing"
)

// A daemon whose log pipe is gone gets EPIPE from its writes to stderr instead of dying of
// SIGPIPE before it unmounts: Signals ignores SIGPIPE.
func TestSignalsIgnoreSIGPIPE(t *testing.T) {
	_, stop := Signals(context.Background(), nil)
	defer stop()
	if !signal.Ignored(syscall.SIGPIPE) {
		t.Fatal("SIGPIPE not ignored")
	}
}
