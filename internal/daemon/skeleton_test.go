package daemon

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// toy is a daemon's settings as the daemons declare theirs.
type toy struct {
	Common
	Listen string
	Depth  int
	Wait   time.Duration
}

func newToy() *toy {
	return &toy{Common: NewCommon("/nonexistent/toy.conf"), Listen: "[::]:1234", Depth: 512, Wait: time.Second}
}

func (t *toy) Base() *Common { return &t.Common }

func (t *toy) Flags(fs *flag.FlagSet) {
	t.Common.Flags(fs, "metrics", "cleanup")
	fs.StringVar(&t.Listen, "listen", t.Listen, "")
	fs.IntVar(&t.Depth, "queue-depth", t.Depth, "")
	fs.DurationVar(&t.Wait, "wait", t.Wait, "")
}

// Defaults, then the file, then the command line; and a reload with the same command line
// takes the file's new values where the command line did not set them.
func TestLoadSteps(t *testing.T) {
	// Step 1: no file (the default one is optional), no flags: the defaults.
	s, cfg, err := Load("toy", "toy", nil, newToy)
	if err != nil {
		t.Fatal(err)
	}
	if s.Listen != "[::]:1234" || s.Depth != 512 || s.Wait != time.Second || s.Provider != "auto" || s.LogLevel != "info" || len(cfg.Decls) != 0 {
		t.Fatalf("defaults: %+v", s)
	}
	// Step 2: the file's settings over the defaults; declarations kept in order.
	conf := filepath.Join(t.TempDir(), "toy.conf")
	write := func(text string) {
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("# leading\nlisten = 10.0.0.1:99 # a comment\nqueue-depth = 64\t# another\nprovider = soft\ntls-cert = c#1.pem\nopen_session sessname=a path=ip:1.2.3.4\n")
	args := []string{"-config", conf}
	s, cfg, err = Load("toy", "toy", args, newToy)
	if err != nil {
		t.Fatal(err)
	}
	// A '#' inside a value is the value's; one after a blank starts a comment.
	if s.Listen != "10.0.0.1:99" || s.Depth != 64 || s.Provider != "soft" || s.TLS.Cert != "c#1.pem" || s.Wait != time.Second {
		t.Fatalf("file: %+v", s)
	}
	if len(cfg.Decls) != 1 || cfg.Decls[0] != "open_session sessname=a path=ip:1.2.3.4" {
		t.Fatalf("declarations %q", cfg.Decls)
	}
	// Step 3: the command line over the file.
	args = append(args, "-queue-depth", "8", "-log-level", "debug")
	s, _, err = Load("toy", "toy", args, newToy)
	if err != nil {
		t.Fatal(err)
	}
	if s.Depth != 8 || s.Listen != "10.0.0.1:99" || s.LogLevel != "debug" {
		t.Fatalf("flags: %+v", s)
	}
	// Step 4: SIGHUP loads again with the same command line: the file's new listen and
	// wait, its queue-depth still beaten by the flag.
	write("listen = 10.0.0.2:99\nqueue-depth = 32\nwait = 5s\n")
	s, _, err = Load("toy", "toy", args, newToy)
	if err != nil {
		t.Fatal(err)
	}
	if s.Listen != "10.0.0.2:99" || s.Depth != 8 || s.Wait != 5*time.Second || s.Provider != "auto" {
		t.Fatalf("reload: %+v", s)
	}
}

// A setting no flag has, a value a flag refuses, a missing named file and stray arguments
// are errors: nothing starts on a config it cannot read whole.
func TestLoadRefusals(t *testing.T) {
	dir := t.TempDir()
	for name, text := range map[string]string{
		"unknown.conf": "listne = x\n",
		"bad.conf":     "queue-depth = many\n",
		"config.conf":  "config = /etc/other.conf\n",
		"version.conf": "version = true\n",
		"cleanup.conf": "cleanup = true\n",
		"twice.conf":   "queue-depth = 8\nlisten = x\nqueue-depth = 16\n",
	} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, _, err := Load("toy", "toy", []string{"-config", p}, newToy); err == nil {
			t.Errorf("%s: %q taken", name, text)
		}
	}
	if _, _, err := Load("toy", "toy", []string{"-config", filepath.Join(dir, "none.conf")}, newToy); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a named config file that is missing: %v", err)
	}
	if _, _, err := Load("toy", "toy", []string{"stray"}, newToy); err == nil {
		t.Error("a stray argument taken")
	}
	if _, _, err := Load("toy", "toy", []string{"-h"}, newToy); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
}

// -version answers before any config is read, even a broken or missing one.
func TestVersionFlag(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.conf")
	if err := os.WriteFile(bad, []byte("listne = x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, conf := range []string{bad, filepath.Join(dir, "none.conf")} {
		if _, _, err := Load("toy", "toy", []string{"-config", conf, "-version"}, newToy); !errors.Is(err, ErrVersion) {
			t.Errorf("-version with %s: %v", conf, err)
		}
	}
	if v := Version(); v == "" || strings.ContainsAny(v, " \n") {
		t.Errorf("Version() = %q", v)
	}
}

// The TLS files go together, and their flags carry the prefix they were defined with.
func TestTLSFiles(t *testing.T) {
	s, _, err := Load("toy", "toy", []string{"-tls-cert", "c.pem"}, newToy)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.TLS.Config(); err == nil || err.Error() != "-tls-cert, -tls-key and -tls-ca go together" {
		t.Errorf("cert alone: %v", err)
	}
	if cfg, err := newToy().TLS.Config(); cfg != nil || err != nil {
		t.Errorf("no files: %v %v", cfg, err)
	}
}

// TestUnapplied: a reload that read other values reports, by flag name, those it does not
// apply, and not those it applies or those unchanged.
func TestUnapplied(t *testing.T) {
	running, read := newToy(), newToy()
	read.Listen, read.Depth, read.LogLevel = "[::]:1235", 512, "debug"
	got := Unapplied(running, read, "log-level")
	if len(got) != 1 || got[0] != `-listen "[::]:1234" → "[::]:1235"` {
		t.Fatalf("unapplied: %q", got)
	}
	if got := Unapplied(running, newToy()); len(got) != 0 {
		t.Fatalf("the same settings: %q", got)
	}
}
