package main

import (
	"bytes"
	"flag"
	"reflect"
	"strings"
	"testing"
	"time"
)

// The help is read in the layout flag.PrintDefaults writes, so it is made by a FlagSet here:
// a bool, a one-letter flag, a typed flag with a default and a usage of two lines.
func TestParseHelp(t *testing.T) {
	fs := flag.NewFlagSet("d", flag.ContinueOnError)
	var out bytes.Buffer
	fs.SetOutput(&out)
	fs.Bool("cleanup", false, "detach stale mounts and exit")
	fs.Bool("x", false, "one letter")
	fs.String("mount", "/run/d", "where the tree is mounted")
	fs.Duration("io-timeout", 30*time.Second, "how long IO waits\nbefore EIO")
	fs.Usage = func() {
		out.WriteString("d: the daemon. It serves.\nSecond line.\n\nMore.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.Usage()
	desc, flags, err := parseHelp(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"d: the daemon. It serves. Second line.", "More."}; !reflect.DeepEqual(desc, want) {
		t.Errorf("description %q, want %q", desc, want)
	}
	want := []helpFlag{
		{name: "cleanup", usage: "detach stale mounts and exit"},
		{name: "io-timeout", arg: "duration", usage: "how long IO waits\nbefore EIO (default 30s)"},
		{name: "mount", arg: "string", usage: `where the tree is mounted (default "/run/d")`},
		{name: "x", usage: "one letter"},
	}
	if !reflect.DeepEqual(flags, want) {
		t.Errorf("flags\n%q\nwant\n%q", flags, want)
	}
	for _, bad := range []string{"no flags here", "d\n\nFlags:\n", "d\n\nFlags:\n  -a\nstray\n"} {
		if _, _, err := parseHelp(bad); err == nil {
			t.Errorf("%q taken", bad)
		}
	}
}

func TestParseABI(t *testing.T) {
	abi := "What:\t\t/run/x/ctl/a\nDate:\t\tNovember 2026\nContact:\tus\nDescription:\n\t\tFirst line\n\t\tgoes on.\n\n\t\tSecond.\n\n" +
		"What:\t\t/run/x/b\nDescription:\tOne line.\n"
	got, err := parseABI(abi)
	if err != nil {
		t.Fatal(err)
	}
	want := []abiEntry{{what: "/run/x/ctl/a", desc: []string{"First line goes on.", "Second."}}, {what: "/run/x/b", desc: []string{"One line."}}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%q, want %q", got, want)
	}
	if _, err := parseABI("What:\t/run/x\nDate: now\n"); err == nil {
		t.Error("an entry without a description taken")
	}
}

// Text that roff would take as requests or escapes comes out literal.
func TestRoffEscapes(t *testing.T) {
	p := page{name: "d", version: "1.0~git1", date: "2026-11-24", desc: []string{"d: the daemon. More."},
		flags: []helpFlag{{name: "a-b", arg: "string", usage: `C:\path` + "\n.so /etc/passwd\n'x"}},
		abi:   []abiEntry{{what: "/run/d/f", desc: []string{"one", "two"}}}, seeAlso: []string{"e(8)"}}
	r := p.roff()
	for _, want := range []string{`.TH D 8 "2026-11-24" "rtrs 1.0~git1"`, `d \- the daemon`, ".SH DESCRIPTION\nThe daemon. More.", `.BI \-a\-b " string"`,
		`C:\epath`, `\&.so /etc/passwd`, `\&'x`, ".B /run/d/f\none\n.IP\ntwo", ".BR e (8)"} {
		if !strings.Contains(r, want) {
			t.Errorf("page lacks %q:\n%s", want, r)
		}
	}
	for _, l := range strings.Split(r, "\n") {
		if strings.HasPrefix(l, ".so") || strings.HasPrefix(l, "'") {
			t.Errorf("request from the text: %q", l)
		}
	}
}
