// Package daemon is what rtrs-clientd and rtrs-serverd share: the config file, logging
// under systemd, sd_notify, and the signals; and the default bound on a server's chunk
// memory, which rtrs-bench's servers take too.
package daemon

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/log"
)

// Config is a daemon's config file: "key = value" settings and, for the client, declaration
// lines in the control files' syntax ("open_session sessname=… path=…", "map_device …").
// '#' starts a comment.
type Config struct {
	Settings map[string]string
	// Decls are the declaration lines in file order.
	Decls []string
	// CommandLine names the flags given on the command line (set by Flags): a reload must
	// not let the file override them.
	CommandLine map[string]bool
}

// ReadConfig reads path; a missing file is an empty config when optional is true.
func ReadConfig(path string, optional bool) (*Config, error) {
	c := &Config{Settings: map[string]string{}}
	f, err := os.Open(path)
	if err != nil {
		if optional && os.IsNotExist(err) {
			return c, nil
		}
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	setAt := map[string]int{}
	for n := 1; sc.Scan(); n++ {
		line := StripComment(strings.TrimSpace(sc.Text()))
		if line == "" {
			continue
		}
		// "key = value" is a setting; "verb token=value …" a declaration.
		if k, v, ok := strings.Cut(line, "="); ok && !strings.ContainsAny(strings.TrimSpace(k), " \t") {
			k = strings.TrimSpace(k)
			if at, dup := setAt[k]; dup {
				// Which one was meant is not ours to guess.
				return nil, fmt.Errorf("%s:%d: %s is set on line %d already", path, n, k, at)
			}
			setAt[k] = n
			c.Settings[k] = strings.TrimSpace(v)
			continue
		}
		c.Decls = append(c.Decls, line)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// StripComment cuts a comment off a config line: from a '#' that starts the line or follows
// a blank. A '#' inside a value ("allow-subject = CN=rack#3") is the value's.
func StripComment(line string) string {
	for i := 0; i < len(line); i++ {
		if line[i] == '#' && (i == 0 || line[i-1] == ' ' || line[i-1] == '\t') {
			return strings.TrimSpace(line[:i])
		}
	}
	return line
}

// SetupLog configures logging: text, or JSON; no timestamps when journald is the output
// (it adds its own).
func SetupLog(level string, json bool) error {
	_, err := log.Setup(log.Options{Level: level, JSON: json, NoTime: os.Getenv("JOURNAL_STREAM") != ""})
	return err
}

// Notify sends an sd_notify message ("READY=1", "STATUS=…") when systemd asked for them.
func Notify(msg string) {
	sock := os.Getenv("NOTIFY_SOCKET")
	if sock == "" {
		return
	}
	if strings.HasPrefix(sock, "@") {
		sock = "\x00" + sock[1:] // an abstract socket
	}
	c, err := net.DialTimeout("unixgram", sock, time.Second)
	if err != nil {
		log.L.WithError(err).Debug("sd_notify")
		return
	}
	defer c.Close()
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = c.Write([]byte(msg))
}

// Signals turns SIGINT/SIGTERM into the end of ctx, SIGHUP into calls of reload (with
// RELOADING=1 … READY=1 around it) and SIGUSR1 into a dump of every goroutine's stack in
// the log. It returns the context and a stop function.
func Signals(parent context.Context, reload func()) (context.Context, func()) {
	ctx, cancel := context.WithCancel(parent)
	// A log pipe whose reader went (`| tee` stopped by Ctrl-C) must not kill the daemon
	// before it unmounts: writes fail with EPIPE instead.
	signal.Ignore(syscall.SIGPIPE)
	ch := make(chan os.Signal, 4)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case s := <-ch:
				switch s {
				case syscall.SIGHUP:
					if !ready.Load() {
						// Nothing to reload yet, and no READY=1 to send before Serve's.
						log.L.Info("SIGHUP before the daemon is up: nothing reloaded")
						continue
					}
					Notify(fmt.Sprintf("RELOADING=1\nMONOTONIC_USEC=%d", monotonicUsec()))
					if reload != nil {
						reload()
					}
					Notify("READY=1")
				case syscall.SIGUSR1:
					buf := make([]byte, 1<<20)
					n := runtime.Stack(buf, true)
					log.L.Infof("goroutine dump (SIGUSR1):\n%s", buf[:n])
				default:
					log.L.Infof("%v: stopping", s)
					Notify("STOPPING=1")
					cancel()
				}
			}
		}
	}()
	return ctx, func() {
		signal.Stop(ch)
		cancel()
		<-done
	}
}

func monotonicUsec() int64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return 0
	}
	return ts.Nano() / 1e3
}

// commandLineOnly: the flags a config file may not set. The file cannot name another file,
// and "cleanup" or "version" there would make every start exit at once.
func commandLineOnly(name, configFlag string) bool {
	return name == configFlag || name == "cleanup" || name == "version"
}

// Flags parses args into fs, then takes every setting of the config file named by the
// flag configFlag for the flags the command line did not set: config first, flags override.
// A setting no flag knows is an error.
func Flags(fs *flag.FlagSet, args []string, configFlag string, optional bool) (*Config, error) {
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	path := fs.Lookup(configFlag).Value.String()
	cfg, err := ReadConfig(path, optional && !set[configFlag])
	if err != nil {
		return nil, err
	}
	cfg.CommandLine = set
	for k, v := range cfg.Settings {
		if fs.Lookup(k) == nil || commandLineOnly(k, configFlag) {
			return nil, fmt.Errorf("%s: unknown setting %q", path, k)
		}
		if set[k] {
			continue
		}
		if err := fs.Set(k, v); err != nil {
			return nil, fmt.Errorf("%s: %s: %w", path, k, err)
		}
	}
	return cfg, nil
}
