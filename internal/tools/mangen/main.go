// Command mangen writes a daemon's man page (roff, section 8) from the two places that
// already say what it does: the daemon's own -h (its description and every flag, with
// defaults) and the docs/ABI files of the trees it mounts. The packages build their man pages
// with it, so a flag or a file added to the code is in the next package's page.
//
//	mangen -bin bin/rtrs-serverd -abi docs/ABI/sysfs-class-rtrs-server,docs/ABI/sysfs-class-rnbd-server \
//	       -version 1.2.3 -see-also 'rtrs-clientd(8)' > rtrs-serverd.8
//
// The page's date is SOURCE_DATE_EPOCH's (as dpkg sets it) when set, so a rebuild is the same.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mangen:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("mangen", flag.ContinueOnError)
	bin := fs.String("bin", "", "the daemon's binary, run with -h")
	abi := fs.String("abi", "", "docs/ABI files of its trees, comma-separated")
	version := fs.String("version", "", "the version the page is for")
	seeAlso := fs.String("see-also", "", "other pages, comma-separated, e.g. rtrs-clientd(8)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *bin == "" || *version == "" {
		return errors.New("-bin and -version are needed")
	}
	// -h writes the usage on stderr and exits 0.
	var help bytes.Buffer
	cmd := exec.Command(*bin, "-h")
	cmd.Stderr = &help
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s -h: %w", *bin, err)
	}
	desc, flags, err := parseHelp(help.String())
	if err != nil {
		return fmt.Errorf("%s -h: %w", *bin, err)
	}
	var entries []abiEntry
	if *abi != "" {
		for _, p := range strings.Split(*abi, ",") {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e, err := parseABI(string(b))
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			entries = append(entries, e...)
		}
	}
	date, err := pageDate()
	if err != nil {
		return err
	}
	p := page{name: filepath.Base(*bin), version: *version, date: date, desc: desc, flags: flags, abi: entries}
	if *seeAlso != "" {
		p.seeAlso = strings.Split(*seeAlso, ",")
	}
	_, err = io.WriteString(out, p.roff())
	return err
}

// pageDate is SOURCE_DATE_EPOCH's day when set, today's otherwise, as YYYY-MM-DD.
func pageDate() (string, error) {
	t := time.Now()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		sec, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return "", fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
		}
		t = time.Unix(sec, 0)
	}
	return t.UTC().Format("2006-01-02"), nil
}

// helpFlag is one flag as flag.PrintDefaults shows it.
type helpFlag struct {
	name, arg, usage string
}

// parseHelp splits a daemon's -h into the description (paragraphs, before "Flags:") and its
// flags, in flag.PrintDefaults' layout: "  -name type" then usage lines indented "    \t".
func parseHelp(s string) (desc []string, flags []helpFlag, err error) {
	head, list, ok := strings.Cut(s, "\nFlags:\n")
	if !ok {
		return nil, nil, errors.New(`no "Flags:" line`)
	}
	desc = paragraphs(strings.Split(head, "\n"), "")
	for _, line := range strings.Split(list, "\n") {
		switch {
		case strings.HasPrefix(line, "  -"):
			// A one-letter flag's usage follows on the same line, after a tab.
			head, usage, _ := strings.Cut(strings.TrimPrefix(line, "  -"), "\t")
			name, arg, _ := strings.Cut(head, " ")
			flags = append(flags, helpFlag{name: name, arg: arg, usage: usage})
		case strings.HasPrefix(line, "    \t") && len(flags) > 0:
			f := &flags[len(flags)-1]
			f.usage = strings.TrimSpace(f.usage + "\n" + strings.TrimPrefix(line, "    \t"))
		case strings.TrimSpace(line) != "":
			return nil, nil, fmt.Errorf("unexpected line %q", line)
		}
	}
	if len(flags) == 0 {
		return nil, nil, errors.New("no flags")
	}
	return desc, flags, nil
}

// abiEntry is one "What:" of a docs/ABI file: a path and its description's paragraphs.
type abiEntry struct {
	what string
	desc []string
}

// parseABI reads the kernel's Documentation/ABI layout: "What:", "Date:", "Contact:" and
// "Description:" fields, the description's lines indented by tabs.
func parseABI(s string) ([]abiEntry, error) {
	var out []abiEntry
	var lines []string
	inDesc := false
	flush := func() {
		if len(out) > 0 {
			out[len(out)-1].desc = paragraphs(lines, "\t")
		}
		lines, inDesc = nil, false
	}
	for _, line := range strings.Split(s, "\n") {
		switch {
		case strings.HasPrefix(line, "What:"):
			flush()
			out = append(out, abiEntry{what: strings.TrimSpace(strings.TrimPrefix(line, "What:"))})
		case strings.HasPrefix(line, "Description:"):
			inDesc = true
			if rest := strings.TrimSpace(strings.TrimPrefix(line, "Description:")); rest != "" {
				lines = append(lines, rest)
			}
		case inDesc:
			lines = append(lines, line)
		}
	}
	flush()
	for _, e := range out {
		if e.what == "" || len(e.desc) == 0 {
			return nil, fmt.Errorf("entry %q has no path or no description", e.what)
		}
	}
	return out, nil
}

// paragraphs joins lines (each with indent trimmed) into paragraphs at blank lines.
func paragraphs(lines []string, indent string) []string {
	var out []string
	var cur []string
	for _, l := range append(lines, "") {
		l = strings.TrimSpace(strings.TrimLeft(l, indent))
		if l == "" {
			if len(cur) > 0 {
				out = append(out, strings.Join(cur, " "))
			}
			cur = nil
			continue
		}
		cur = append(cur, l)
	}
	return out
}

// page is what a man page says.
type page struct {
	name, version, date string
	desc                []string
	flags               []helpFlag
	abi                 []abiEntry
	seeAlso             []string
}

func (p page) roff() string {
	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format+"\n", a...) }
	w(`.TH %s 8 "%s" "rtrs %s" "System Administration"`, strings.ToUpper(p.name), p.date, esc(p.version))
	w(".SH NAME")
	summary := p.name
	if len(p.desc) > 0 {
		// "rtrs-serverd: the RTRS server daemon. It accepts …": the first sentence names it.
		first, _, _ := strings.Cut(p.desc[0], ". ")
		summary = strings.TrimSuffix(strings.TrimPrefix(first, p.name+": "), ".")
	}
	w(`%s \- %s`, p.name, esc(summary))
	w(".SH SYNOPSIS")
	w(".B %s", p.name)
	w(`[\fIoptions\fR]`)
	w(".br")
	w(`.B %s \-cleanup`, p.name)
	w(".br")
	w(`.B %s \-version`, p.name)
	w(".SH DESCRIPTION")
	for i, d := range p.desc {
		if i > 0 {
			w(".PP")
		}
		if i == 0 {
			d = capitalize(strings.TrimPrefix(d, p.name+": "))
		}
		w("%s", text(d))
	}
	w(".SH OPTIONS")
	w("Every option but \\-config, \\-cleanup and \\-version may also be a line of the config file, without its dash:")
	w("\\fIname\\fR = \\fIvalue\\fR.")
	w("The command line wins over the file.")
	for _, f := range p.flags {
		w(".TP")
		if f.arg != "" {
			w(`.BI \-%s " %s"`, esc(f.name), esc(f.arg))
		} else {
			w(`.B \-%s`, esc(f.name))
		}
		w("%s", text(f.usage))
	}
	if len(p.abi) > 0 {
		w(".SH FILES")
		w("The files of the trees the daemon mounts, at their default places.")
		for _, e := range p.abi {
			w(".TP")
			w(".B %s", esc(e.what))
			for i, d := range e.desc {
				if i > 0 {
					w(".IP")
				}
				w("%s", text(d))
			}
		}
	}
	w(".SH SIGNALS")
	w("SIGHUP loads the config file again; SIGTERM and SIGINT stop the daemon, which unmounts its trees.")
	if len(p.seeAlso) > 0 {
		w(".SH SEE ALSO")
		var refs []string
		for _, s := range p.seeAlso {
			n, sec, ok := strings.Cut(strings.TrimSuffix(strings.TrimSpace(s), ")"), "(")
			if ok {
				refs = append(refs, fmt.Sprintf(`.BR %s (%s)`, esc(n), esc(sec)))
			} else {
				refs = append(refs, esc(s))
			}
		}
		w("%s", strings.Join(refs, "\n,\n"))
	}
	return b.String()
}

// capitalize upper-cases s's first letter.
func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// esc escapes roff's backslash and dashes (a dash in a name or a flag is a minus sign).
func esc(s string) string {
	return strings.NewReplacer(`\`, `\e`, "-", `\-`).Replace(s)
}

// text is esc for running text, with a line that would start with a control character
// (. or ') made literal; newlines in it end a line.
func text(s string) string {
	lines := strings.Split(esc(s), "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
			lines[i] = `\&` + l
		}
	}
	return strings.Join(lines, "\n.br\n")
}
