package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

// Main runs a daemon: run with the process's arguments, then exit 0 after -h (the usage went
// to stderr) or -version, 1 with the error said on stderr as "name: error", 0 otherwise.
func Main(name string, run func(ctx context.Context, args []string) error) {
	if err := run(context.Background(), os.Args[1:]); errors.Is(err, flag.ErrHelp) || errors.Is(err, ErrVersion) {
		os.Exit(0)
	} else if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}

// Settings is a daemon's typed configuration: a struct whose defaults its constructor sets,
// with a flag per field.
type Settings interface {
	// Flags binds every field to a flag of fs, the field's value as the flag's default.
	Flags(fs *flag.FlagSet)
	// Base is the settings every daemon has.
	Base() *Common
}

// Common are the settings both daemons have; their flags are defined once, here.
type Common struct {
	// ConfigFile is the config file (-config): settings, and the client's declarations.
	ConfigFile string
	// Provider is -provider: auto, soft or verbs.
	Provider string
	// TLS is the soft provider's mutual TLS (-tls-cert, -tls-key, -tls-ca).
	TLS TLSFiles
	// Metrics is where the Prometheus endpoint listens (empty: nowhere).
	Metrics  string
	LogLevel string
	LogJSON  bool
	// Cleanup asks to detach stale mounts and exit.
	Cleanup bool
}

// NewCommon is Common with its defaults; configFile is the daemon's default config file.
func NewCommon(configFile string) Common {
	return Common{ConfigFile: configFile, Provider: "auto", LogLevel: "info"}
}

// Flags binds the common settings to flags of fs.
func (c *Common) Flags(fs *flag.FlagSet, metricsUsage, cleanupUsage string) {
	fs.StringVar(&c.ConfigFile, "config", c.ConfigFile, "config file: key = value lines named as the flags (flags override them)")
	fs.StringVar(&c.Provider, "provider", c.Provider, pick.Usage)
	c.TLS.Flags(fs, "tls", "soft provider, mutual TLS")
	fs.StringVar(&c.Metrics, "metrics", c.Metrics, metricsUsage)
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level")
	fs.BoolVar(&c.LogJSON, "log-json", c.LogJSON, "log JSON lines")
	fs.BoolVar(&c.Cleanup, "cleanup", c.Cleanup, cleanupUsage)
}

// Load fills a daemon's settings: newSettings' defaults, then the config file's settings
// (a key no flag has is an error), then the command line's flags, which win. Run again on
// SIGHUP with the same args, it gives the settings the daemon would start with now.
// -version prints "name version" on stdout and returns ErrVersion, whatever the config says.
func Load[S Settings](name, usage string, args []string, newSettings func() S) (S, *Config, error) {
	var zero S
	s := newSettings()
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), usage+"\n\nFlags:")
		fs.PrintDefaults()
	}
	s.Flags(fs)
	showVersion := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return zero, nil, err
	}
	if *showVersion {
		fmt.Fprintln(os.Stdout, name, Version())
		return zero, nil, ErrVersion
	}
	cfg, err := Flags(fs, args, "config", true)
	if err != nil {
		return zero, nil, err
	}
	return s, cfg, nil
}

// Start sets up logging from the common settings and returns the daemon's logger.
func (c *Common) Start(ctx context.Context, component string) (*log.Entry, error) {
	if err := SetupLog(c.LogLevel, c.LogJSON); err != nil {
		return nil, err
	}
	return log.G(ctx).WithField("component", component), nil
}

// CheckFiles reads the files the settings name (the TLS certificate, key and CA) as a start
// would: a reload checks them before it takes a file a restart would refuse.
func (c *Common) CheckFiles() error {
	_, err := c.TLS.Config()
	return err
}

// OpenProvider opens the RDMA provider -provider names (pick.OpenWith, so with the soft
// provider's TLS from -tls-*) and logs why it was chosen. TLS is the soft provider's: with
// another one it would authenticate nothing, so that is refused. addrs are the local
// addresses the daemon will use.
func (c *Common) OpenProvider(lg *log.Entry, so soft.Options, addrs ...netip.Addr) (rdma.Provider, *tls.Config, error) {
	tlsCfg, err := c.TLS.Config()
	if err != nil {
		return nil, nil, err
	}
	so.TLS = tlsCfg
	prov, why, err := pick.OpenWith(c.Provider, so, addrs...)
	if err != nil {
		return nil, nil, fmt.Errorf("-provider: %w", err)
	}
	lg.Infof("provider %s", why)
	if tlsCfg != nil && prov.Name() != "soft" {
		return nil, nil, fmt.Errorf("-tls-cert: TLS is the soft provider's; %s authenticates nothing (use -provider soft, or -allow)", prov.Name())
	}
	return prov, tlsCfg, nil
}

// CleanupMounts detaches what a crash left mounted at each of dirs (empty ones skipped)
// and reports each.
func CleanupMounts(dirs ...string) error {
	var errs []error
	for _, d := range dirs {
		if d != "" {
			errs = append(errs, fsview.CleanupReport(d))
		}
	}
	return errors.Join(errs...)
}

// Mount mounts a tree (name: its fsname) at dir and returns the unmount to defer: it
// unmounts, and where that fails (a reader holds a file open) logs it and detaches the mount
// lazily, so that a restart finds dir free.
func Mount(lg *log.Entry, dir, name string, tree fsview.Dir) (unmount func(), err error) {
	srv, err := fsview.Mount(dir, tree, fsview.MountOptions{Name: name})
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", dir, err)
	}
	return func() {
		if err := srv.Unmount(); err != nil {
			lg.WithError(err).Warnf("unmount %s (a file open in it, or a shell's working directory?): detached lazily", dir)
			_, _ = fsview.Cleanup(dir)
		}
	}, nil
}

// ready says Serve has told systemd READY=1: a SIGHUP before that reloads nothing.
var ready atomic.Bool

// Serve tells systemd the daemon is ready, then its status every 5 s, until ctx ends; then
// that it stops.
func Serve(ctx context.Context, status func() string) {
	ready.Store(true)
	defer ready.Store(false)
	Notify("READY=1\nSTATUS=" + status())
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			Notify("STOPPING=1")
			return
		case <-t.C:
			Notify("STATUS=" + status())
		}
	}
}

// CheckInterval refuses a setting's duration below min, but for 0 when zero says the
// default applies: a negative or tiny one would otherwise fall back to the default, or spin,
// without a word.
func CheckInterval(name string, d, min time.Duration, zero bool) error {
	if d == 0 && zero {
		return nil
	}
	if d < min {
		if zero {
			return fmt.Errorf("-%s %v: 0 for the default, or at least %v", name, d, min)
		}
		return fmt.Errorf("-%s %v: at least %v", name, d, min)
	}
	return nil
}

// Unapplied lists, as "-name old → new", the settings that differ between the ones a daemon
// runs with and the ones a reload read, but for those the reload applies (flag names): the
// rest take effect at a restart only, and an operator who changed them is told so rather
// than left to believe them in force.
func Unapplied(running, read Settings, applied ...string) []string {
	values := func(s Settings) map[string]string {
		fs := flag.NewFlagSet("", flag.ContinueOnError)
		s.Flags(fs)
		m := map[string]string{}
		fs.VisitAll(func(f *flag.Flag) { m[f.Name] = f.Value.String() })
		return m
	}
	was, now := values(running), values(read)
	var out []string
	for name, v := range now {
		if was[name] != v && !slices.Contains(applied, name) {
			out = append(out, fmt.Sprintf("-%s %q → %q", name, was[name], v))
		}
	}
	slices.Sort(out)
	return out
}
