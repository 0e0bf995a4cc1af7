package main

import (
	"testing"
)

// TestUblkFlags: bad ublk settings stop the daemon before it does anything; good ones pass.
func TestUblkFlags(t *testing.T) {
	for _, args := range [][]string{{"-ublk-attach", "yes"}, {"-ublk-queues", "0"}, {"-ublk-queues", "many"}, {"-ublk-depth", "0"}, {"-ublk-depth", "4097"},
		{"-ublk-registered-memory", "0"}, {"-ublk-registered-memory", "lots"}, {"-ublk-registered-memory", "-1G"}} {
		if err := checkArgs(append([]string{"-config", "/dev/null"}, args...)); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	for _, v := range []string{"off", "64M"} {
		if err := checkArgs([]string{"-config", "/dev/null", "-ublk-registered-memory", v,
			"-mount", t.TempDir() + "/a", "-dev-mount", t.TempDir() + "/b"}); err != nil {
			t.Errorf("-ublk-registered-memory %s: %v", v, err)
		}
	}
}
