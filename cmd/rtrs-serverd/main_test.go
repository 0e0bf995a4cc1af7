package main

import (
	"context"
	"testing"
)

// TestDeployConfig: the example config's settings are flags of this daemon.
func TestDeployConfig(t *testing.T) {
	if err := run(context.Background(), []string{"-config", "../../deploy/config/rtrs-serverd.conf", "-cleanup", "-mount", t.TempDir() + "/m"}); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"-config", "/dev/null", "-listen", "nonsense", "-mount", t.TempDir() + "/m"}); err == nil {
		t.Fatal("bad -listen accepted")
	}
}
