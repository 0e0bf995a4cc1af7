package main

import (
	"context"
	"errors"
	"flag"
	"testing"
)

// TestDeployConfig: the example config's settings are flags of this daemon.
func TestDeployConfig(t *testing.T) {
	if err := run(context.Background(), []string{"-config", "../../deploy/config/rtrs-serverd.conf", "-cleanup", "-mount", t.TempDir() + "/m",
		"-rnbd-mount", t.TempDir() + "/r"}); err != nil { // never the host's /run/rtrs
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"-config", "/dev/null", "-listen", "nonsense", "-mount", t.TempDir() + "/m"}); err == nil {
		t.Fatal("bad -listen accepted")
	}
}

// -h says what the daemon is and is not an error.
func TestHelp(t *testing.T) {
	err := run(context.Background(), []string{"-h"})
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v, want flag.ErrHelp (exit 0)", err)
	}
}
