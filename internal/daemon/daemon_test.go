package daemon

import (
	"context"
	"os/signal"
	"syscall"
	"testing"
	"time"
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

// A SIGHUP before Serve has said READY=1 reloads nothing (and tells systemd nothing); once
// the daemon serves, it reloads.
func TestSIGHUPOnlyOnceReady(t *testing.T) {
	reloads := make(chan struct{}, 4)
	ctx, stop := Signals(context.Background(), func() { reloads <- struct{}{} })
	defer stop()
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	select {
	case <-reloads:
		t.Fatal("reloaded before the daemon was up")
	case <-time.After(300 * time.Millisecond):
	}
	sctx, cancel := context.WithCancel(ctx)
	served := make(chan struct{})
	go func() { defer close(served); Serve(sctx, func() string { return "test" }) }()
	defer func() { cancel(); <-served }()
	for !ready.Load() {
		time.Sleep(time.Millisecond)
	}
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	select {
	case <-reloads:
	case <-time.After(5 * time.Second):
		t.Fatal("no reload once the daemon serves")
	}
}
