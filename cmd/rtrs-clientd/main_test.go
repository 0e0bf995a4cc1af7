package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/pkg/control"
)

// checkArgs is what a start with args checks before it does anything (config.check, which
// run and the reload call).
func checkArgs(args []string) error {
	c, cfg, err := daemon.Load("rtrs-clientd", usage, args, newConfig)
	if err == nil {
		_, err = c.check(cfg)
	}
	return err
}

// TestDeployConfig: the example config's settings are flags of this daemon and its
// declarations, commented out so that a fresh install connects nowhere, parse.
func TestDeployConfig(t *testing.T) {
	conf := "../../deploy/config/rtrs-clientd.conf"
	dir := t.TempDir()
	if err := checkArgs([]string{"-config", conf, "-mount", dir + "/a", "-dev-mount", dir + "/b"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := daemon.ReadConfig(conf, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Decls) != 0 {
		t.Fatalf("active declarations %q", cfg.Decls)
	}
	b, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	var decls []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "#"+control.VerbOpenSession+" ") || strings.HasPrefix(l, "#"+control.VerbMapDevice+" ") {
			decls = append(decls, l[1:])
		}
	}
	if len(decls) != 2 {
		t.Fatalf("example declarations %q", decls)
	}
	for _, d := range decls {
		verb, rest, _ := strings.Cut(d, " ")
		var err error
		switch verb {
		case control.VerbOpenSession:
			_, err = control.ParseOpenSession(rest)
		case control.VerbMapDevice:
			_, err = control.ParseMapDevice(rest)
		default:
			t.Fatalf("declaration %q", d)
		}
		if err != nil {
			t.Errorf("%q: %v", d, err)
		}
	}
}

func TestBadConfig(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.conf")
	if err := os.WriteFile(p, []byte("no-such-setting = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"-config", p, "-cleanup"}); err == nil || !strings.Contains(err.Error(), "unknown setting") {
		t.Fatalf("unknown setting: %v", err)
	}
	if err := os.WriteFile(p, []byte("io-timeout = soon\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"-config", p, "-cleanup"}); err == nil {
		t.Fatal("bad duration accepted")
	}
	if err := run(context.Background(), []string{"-config", filepath.Join(t.TempDir(), "missing"), "-cleanup"}); err == nil {
		t.Fatal("a config file named on the command line must exist")
	}
	// A declaration that does not parse stops the start, before anything is mounted or
	// carried out (a later write-back would have dropped it).
	for _, decl := range []string{"map_device sessname=a device_path=d acess_mode=ro", "open_session sessname=a path=ip:127.0.0.1 dest_port=99999"} {
		if err := os.WriteFile(p, []byte("open_session sessname=ok path=ip:127.0.0.1\n"+decl+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		// Bounded: a daemon that took the file would run until its context ends.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := run(ctx, []string{"-config", p, "-mount", dir + "/cli", "-dev-mount", dir + "/dev", "-nbd-socket="})
		cancel()
		if err == nil || !strings.Contains(err.Error(), decl) {
			t.Fatalf("%q: %v, want an error naming it", decl, err)
		}
		if _, err := os.Stat(dir + "/cli"); !os.IsNotExist(err) {
			t.Fatalf("%q: the tree was mounted (%v)", decl, err)
		}
	}
	// -cleanup needs only the mount points: a bad value elsewhere does not stop it.
	if err := os.WriteFile(p, []byte("ublk-depth = 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := run(context.Background(), []string{"-config", p, "-cleanup", "-mount", dir + "/cli", "-dev-mount", dir + "/dev"}); err != nil {
		t.Fatalf("-cleanup with a bad -ublk-depth: %v", err)
	}
}

// TestUnits: no unit setting may give the daemons a private mount namespace.
func TestUnits(t *testing.T) {
	for _, u := range []string{"rtrs-clientd.service", "rtrs-serverd.service"} {
		b, err := os.ReadFile("../../deploy/systemd/" + u)
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		for _, need := range []string{"Type=notify", "LimitMEMLOCK=infinity", "-cleanup", "Restart=on-failure"} {
			if !strings.Contains(s, need) {
				t.Errorf("%s lacks %s", u, need)
			}
		}
		for _, line := range strings.Split(s, "\n") {
			for _, bad := range []string{"PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "ReadOnlyPaths",
				"ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem", "PrivateMounts", "MountFlags", "BindPaths"} {
				if strings.HasPrefix(strings.TrimSpace(line), bad+"=") {
					t.Errorf("%s: %s makes a private mount namespace", u, line)
				}
			}
		}
	}
}

// TestDurationsChecked: a negative or sub-millisecond duration is refused naming its flag
// (it used to fall back to the default without a word); 0 keeps meaning the default.
func TestDurationsChecked(t *testing.T) {
	set := map[string]func(c *config, d time.Duration){
		"nbd-timeout":        func(c *config, d time.Duration) { c.NBDTimeout = d },
		"io-timeout":         func(c *config, d time.Duration) { c.IOTimeout = d },
		"reconnect-delay":    func(c *config, d time.Duration) { c.ReconnectDelay = d },
		"heartbeat-interval": func(c *config, d time.Duration) { c.HeartbeatInterval = d },
	}
	for name, f := range set {
		for _, tc := range []struct {
			d  time.Duration
			ok bool
		}{{-time.Second, false}, {time.Microsecond, false}, {0, true}, {2 * time.Second, true}} {
			c := newConfig()
			f(c, tc.d)
			_, err := c.resolve()
			if tc.ok && err != nil {
				t.Errorf("-%s %v: %v", name, tc.d, err)
			}
			if !tc.ok && (err == nil || !strings.Contains(err.Error(), "-"+name)) {
				t.Errorf("-%s %v: %v, want a refusal naming the flag", name, tc.d, err)
			}
		}
	}
}
