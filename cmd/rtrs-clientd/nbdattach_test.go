package main

import (
	"fmt"
	"os"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/control"
)

func TestStaleBackend(t *testing.T) {
	for b, want := range map[string]bool{
		fmt.Sprintf("rtrs-clientd[%d] s/d #1", os.Getpid()):  false, // ourselves
		fmt.Sprintf("rtrs-clientd[%d] s/d #1", os.Getppid()): false, // alive
		"rtrs-clientd[2147483647] s/d #1":                    true,  // no such process
		"rtrs-clientd[0] s/d #1":                             false,
		"rtrs-clientd[x] s/d #1":                             false,
		"rtrs-clientd[12":                                    false,
		"qemu-nbd 4711":                                      false,
		"":                                                   false,
	} {
		if got := staleBackend(b); got != want {
			t.Errorf("%q: %v", b, got)
		}
	}
}

func TestParseNBDDefault(t *testing.T) {
	for v, want := range map[string]control.Attach{"none": control.AttachNone, "auto": control.AttachAuto} {
		if got, err := parseNBDDefault(v); err != nil || got != want {
			t.Errorf("%q: %v %v", v, got, err)
		}
	}
	for _, v := range []string{"3", "yes", "AUTO"} {
		if _, err := parseNBDDefault(v); err == nil {
			t.Errorf("%q accepted", v)
		}
	}
}

// TestNBDFlags: bad NBD settings stop the daemon before it does anything.
func TestNBDFlags(t *testing.T) {
	for _, args := range [][]string{{"-nbd-attach", "3"}, {"-nbd-attach", "yes"}, {"-nbd-conns", "65"}, {"-nbd-conns", "-1"}, {"-nbd-timeout", "-1s"},
		{"-nbd-registered-memory", "0"}, {"-nbd-registered-memory", "lots"}, {"-nbd-registered-memory", "-1M"}} {
		if err := checkArgs(append([]string{"-config", "/dev/null"}, args...)); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if err := checkArgs([]string{"-config", "/dev/null", "-nbd-attach", "auto", "-nbd-conns", "2", "-nbd-timeout", "2m", "-nbd-registered-memory", "off",
		"-mount", t.TempDir() + "/a", "-dev-mount", t.TempDir() + "/b"}); err != nil {
		t.Errorf("good NBD flags: %v", err)
	}
}
