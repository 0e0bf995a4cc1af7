package main

import (
	"context"
	"errors"
	"flag"
	"os"
	"strings"
	"testing"
	"time"
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

// -export-io takes direct or buffered, and nothing else.
func TestExportIOSetting(t *testing.T) {
	for v, ok := range map[string]bool{"direct": true, "buffered": true, "": false, "Direct": false, "async": false} {
		c := newConfig()
		c.ExportIO = v
		r, err := c.resolve()
		switch {
		case ok && err != nil:
			t.Errorf("-export-io %q: %v", v, err)
		case ok && r.exportIO.String() != v:
			t.Errorf("-export-io %q resolved to %v", v, r.exportIO)
		case !ok && (err == nil || !strings.Contains(err.Error(), "-export-io")):
			t.Errorf("-export-io %q: %v, want a refusal naming the flag", v, err)
		}
	}
}

// A config line that is no "key = value" setting (a mistyped one) is refused: the server has
// no declarations, and the default would stay in force without a word.
func TestMistypedSettingRefused(t *testing.T) {
	p := t.TempDir() + "/s.conf"
	if err := os.WriteFile(p, []byte("listen [::]:1235\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := run(context.Background(), []string{"-config", p, "-cleanup", "-mount", t.TempDir() + "/m", "-rnbd-mount", t.TempDir() + "/r"})
	if err == nil || !strings.Contains(err.Error(), "listen [::]:1235") {
		t.Fatalf("a mistyped setting: %v", err)
	}
}

// TestHeartbeatIntervalChecked: a negative or sub-millisecond -heartbeat-interval is refused
// naming the flag (it used to fall back to 5 s without a word); 0 is the default.
func TestHeartbeatIntervalChecked(t *testing.T) {
	for d, ok := range map[time.Duration]bool{-time.Second: false, time.Microsecond: false, 0: true, 200 * time.Millisecond: true} {
		c := newConfig()
		c.HeartbeatInterval = d
		_, err := c.resolve()
		if ok && err != nil {
			t.Errorf("-heartbeat-interval %v: %v", d, err)
		}
		if !ok && (err == nil || !strings.Contains(err.Error(), "-heartbeat-interval")) {
			t.Errorf("-heartbeat-interval %v: %v, want a refusal naming the flag", d, err)
		}
	}
}

// TestChunkMemoryHoldsASession: a -max-chunk-memory or -max-chunk-memory-per-client below one
// session's chunks (queue depth × chunk size, what a session is charged), which would refuse
// every client, is refused at start naming the flag; one that holds it is taken as given.
func TestChunkMemoryHoldsASession(t *testing.T) {
	for _, flag := range []string{"max-chunk-memory", "max-chunk-memory-per-client"} {
		for v, ok := range map[string]bool{"1M": false, "63M": false, "64M": true, "8G": true, "": true, "x": false} {
			c := newConfig()
			f := &c.MaxChunkMemory
			if flag != "max-chunk-memory" {
				f = &c.MaxChunkMemoryPerClient
			}
			*f = v
			r, err := c.resolve()
			if ok && err != nil {
				t.Errorf("-%s %q: %v", flag, v, err)
			}
			if !ok && (err == nil || !strings.Contains(err.Error(), "-"+flag+" ")) && (err == nil || !strings.Contains(err.Error(), "-"+flag+":")) {
				t.Errorf("-%s %q: %v, want a refusal naming the flag", flag, v, err)
			}
			if ok && v == "8G" && flag != "max-chunk-memory" && r.limits.MaxChunkMemoryPerClient != 8<<30 {
				t.Errorf("-%s 8G: limit %d", flag, r.limits.MaxChunkMemoryPerClient)
			}
		}
	}
}
