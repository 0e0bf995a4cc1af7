// Command rtrs-serverd is the RTRS server daemon: it listens for RTRS client sessions, serves
// RNBD block IO from the files and block devices under its export search path, and mounts the
// rtrs-server tree (/sys/class/rtrs-server's files) over FUSE.
//
//	rtrs-serverd [-config /etc/rtrs/rtrs-serverd.conf] [-listen [::]:1234] [-dev-search-path /srv/rtrs]
//	             [-queue-depth 512] [-chunk-size 128K] [-always-invalidate=true]
//	             [-mount /run/rtrs/rtrs-server] [-rnbd-mount /run/rtrs/rnbd-server]
//	             [-log-level info] [-log-json]
//	rtrs-serverd -cleanup      (detach a stale mount left by a crash, then exit)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func main() {
	if err := run(context.Background(), os.Args[1:]); errors.Is(err, flag.ErrHelp) {
		os.Exit(0) // -h: the usage went to stderr
	} else if err != nil {
		fmt.Fprintln(os.Stderr, "rtrs-serverd:", err)
		os.Exit(1)
	}
}

func run(parent context.Context, args []string) error {
	var reload atomic.Pointer[func()] // set once the server runs; SIGHUP before that is a no-op
	ctx, stop := daemon.Signals(parent, func() {
		if f := reload.Load(); f != nil {
			(*f)()
		}
	})
	defer stop()
	fs := flag.NewFlagSet("rtrs-serverd", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), `rtrs-serverd: the RTRS server daemon. It accepts RTRS client sessions (the kernel's
rtrs-client or rtrs-clientd), serves RNBD block IO from the files and block devices under
-dev-search-path, and mounts the rtrs-server tree (/sys/class/rtrs-server's files) at -mount
and the rnbd-server tree (/sys/class/rnbd-server's: who has which export open, force_close)
at -rnbd-mount.
Settings come from -config (key = value, the flags' names); flags on the command line win.
Security knobs: docs/security.md.

Flags:`)
		fs.PrintDefaults()
	}
	fs.String("config", "/etc/rtrs/rtrs-serverd.conf", "config file (key = value lines; flags override)")
	listen := fs.String("listen", "[::]:1234", "address and port clients connect to (1234 is the kernel's RNBD port, its port_nr parameter)")
	search := fs.String("dev-search-path", "/srv/rtrs", "directory a client's device path is opened under, never above it; %SESSNAME% in it becomes the session's name (the kernel's dev_search_path)")
	qd := fs.Int("queue-depth", transport.DefaultQueueDepth, "chunks (receive buffers) each session gets, so the most IOs a session has in flight (the kernel's sess_queue_depth)")
	chunk := fs.String("chunk-size", "128K", "size of one chunk, so the largest IO a client may send in one request (the kernel's max_chunk_size)")
	inv := fs.Bool("always-invalidate", true, "invalidate a chunk's key before its IO is handed to the export and give it a new one after, so a client cannot write into a chunk the server is working on (the kernel's always_invalidate; off saves two work requests per IO)")
	zc := fs.String("zero-copy-read-min", "64K", "READs this large or larger leave a tmpfs or ramfs export straight from the page cache (off: never)")
	hb := fs.Duration("heartbeat-interval", 0, "how often each path sends a heartbeat; a path that misses more than 5 in a row is closed (0: 5 s, as the kernel)")
	mount := fs.String("mount", "/run/rtrs/rtrs-server", "where the rtrs-server tree is mounted")
	rnbdMount := fs.String("rnbd-mount", "/run/rtrs/rnbd-server", "where the rnbd-server tree (ctl/devices/<device>/sessions/<session>/) is mounted (empty: not mounted)")
	provName := fs.String("provider", "auto", pick.Usage)
	softTLS := daemon.TLSFlags(fs, "tls", "soft provider, mutual TLS")
	allowSubj := fs.String("allow-subject", "", "with TLS: certificate subjects that may connect, ';'-separated (CN=host-a,O=x;CN=host-b)")
	allow := fs.String("allow", "", "clients that may connect: entries separated by ',', each networks or addresses joined by '+' (one host's rails: 10.0.1.5+10.0.2.5); a session is bound to its creator's entry (empty: any)")
	aclPath := fs.String("acl", "", "export ACL file: lines of <export pattern> <client> <modes> (empty: everyone ro or rw, nobody migration)")
	namesFile := fs.String("names-file", "/var/lib/rtrs/sessions.json", "where the owner of each session name is kept across restarts (empty: memory only)")
	maxSess := fs.Int("max-sessions", 256, "sessions the server holds at most, established or not")
	maxMem := fs.String("max-chunk-memory", "", "chunk memory of all sessions at most (e.g. 8G; empty: half the machine's memory)")
	maxCons := fs.Int("max-conns-per-path", 257, "connections a path may have (its cid_num)")
	maxConnecting := fs.Int("max-connecting", 2048, "connections of paths not yet established, in all")
	maxConnectingAddr := fs.Int("max-connecting-per-addr", 514, "connections of paths not yet established, per client address (an IPv6 client: per /64)")
	maxNewSess := fs.Int("max-new-sessions-per-addr", 16, "sessions one client address has opened that have not sent INFO_REQ yet")
	maxConns := fs.Int("max-conns", 8192, "connections of all paths, established or not")
	establish := fs.Duration("establish-timeout", 30*time.Second, "how long a path may take from its first connection to INFO_REQ")
	maxPending := fs.Int("max-pending", soft.DefaultMaxPending, "soft provider: connections not yet past the connection request, in all")
	maxPendingAddr := fs.Int("max-pending-per-addr", soft.DefaultMaxPendingPerAddr, "soft provider: the same, per client address")
	handshake := fs.Duration("handshake-timeout", soft.DefaultHandshakeTimeout, "soft provider: how long a new connection may take to send its connection request")
	metricsAddr := fs.String("metrics", "", metrics.FlagUsage)
	level := fs.String("log-level", "info", "log level")
	json := fs.Bool("log-json", false, "log JSON lines")
	cleanup := fs.Bool("cleanup", false, "detach a stale mount at -mount and exit")
	cfg, err := daemon.Flags(fs, args, "config", true)
	if err != nil {
		return err
	}
	onCmdLine := cfg.CommandLine
	if err := daemon.SetupLog(*level, *json); err != nil {
		return err
	}
	if *cleanup {
		err := fsview.CleanupReport(*mount)
		if *rnbdMount != "" {
			err = errors.Join(err, fsview.CleanupReport(*rnbdMount))
		}
		return err
	}
	lg := log.G(ctx).WithField("component", "rtrs-serverd")
	addr, err := netip.ParseAddrPort(*listen)
	if err != nil {
		return fmt.Errorf("-listen %q: %w", *listen, err)
	}
	cs, err := size.Parse(*chunk)
	if err != nil {
		return fmt.Errorf("-chunk-size: %w", err)
	}
	zcMin, err := size.ParseThreshold(*zc)
	if err != nil {
		return fmt.Errorf("-zero-copy-read-min: %w", err)
	}
	lim := transport.ServerLimits{MaxSessions: *maxSess, MaxConnsPerPath: *maxCons,
		MaxConnecting: *maxConnecting, MaxConnectingPerAddr: *maxConnectingAddr,
		MaxNewSessionsPerAddr: *maxNewSess, MaxConns: *maxConns, MaxChunkMemory: daemon.DefaultChunkMemory()}
	if *maxMem != "" {
		n, err := size.Parse(*maxMem)
		if err != nil {
			return fmt.Errorf("-max-chunk-memory: %w", err)
		}
		lim.MaxChunkMemory = int64(n)
	}
	for name, v := range map[string]int{"max-sessions": *maxSess, "max-conns-per-path": *maxCons, "max-connecting": *maxConnecting,
		"max-connecting-per-addr": *maxConnectingAddr, "max-pending": *maxPending, "max-pending-per-addr": *maxPendingAddr,
		"max-new-sessions-per-addr": *maxNewSess, "max-conns": *maxConns} {
		if v < 1 {
			return fmt.Errorf("-%s %d: must be at least 1", name, v)
		}
	}
	if *establish <= 0 || *handshake <= 0 {
		return fmt.Errorf("-establish-timeout and -handshake-timeout must be positive")
	}
	allowList, err := transport.ParseAllow(*allow)
	if err != nil {
		return fmt.Errorf("-allow: %w", err)
	}
	acl, err := loadACL(*aclPath)
	if err != nil {
		return fmt.Errorf("-acl: %w", err)
	}
	if *namesFile != "" {
		if err := os.MkdirAll(filepath.Dir(*namesFile), 0o700); err != nil {
			return fmt.Errorf("-names-file: %w", err)
		}
	}
	tlsCfg, err := softTLS()
	if err != nil {
		return err
	}
	var subjects []string
	for _, sub := range strings.Split(*allowSubj, ";") {
		if sub = strings.TrimSpace(sub); sub != "" {
			subjects = append(subjects, sub)
		}
	}
	if len(subjects) > 0 && tlsCfg == nil {
		return fmt.Errorf("-allow-subject needs -tls-cert, -tls-key and -tls-ca")
	}
	prov, why, err := pick.OpenWith(*provName, soft.Options{MaxPending: *maxPending, MaxPendingPerAddr: *maxPendingAddr, HandshakeTimeout: *handshake, TLS: tlsCfg}, addr.Addr())
	if err != nil {
		return fmt.Errorf("-provider: %w", err)
	}
	lg.Infof("provider %s", why)
	if tlsCfg != nil && prov.Name() != "soft" {
		return fmt.Errorf("-tls-cert: TLS is the soft provider's; %s authenticates nothing (use -provider soft, or -allow)", prov.Name())
	}
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: *search, MaxIOSize: cs - transport.MaxHdrSize, ZeroCopyReadMin: zcMin, ACL: acl})
	if err != nil {
		return err
	}
	defer rs.Close()
	o := transport.DefaultServerOptions()
	o.Provider, o.Handler, o.Addr = prov, rs, addr
	o.QueueDepth, o.ChunkSize, o.AlwaysInvalidate = *qd, cs, *inv
	o.Timings.HeartbeatInterval = *hb
	o.Timings.ZombieTimeout = *establish
	o.Limits = lim
	o.Allow, o.AllowSubjects, o.NamesFile = allowList, subjects, *namesFile
	srv, err := transport.NewServer(o)
	if err != nil {
		return err
	}
	defer srv.Close()
	if *metricsAddr != "" {
		ml, err := metrics.Serve(*metricsAddr, lg, metrics.NewServer(srv, rs))
		if err != nil {
			return fmt.Errorf("-metrics: %w", err)
		}
		defer ml.Close()
	}
	fsrv, err := fsview.Mount(*mount, &fsview.ServerTree{Server: srv}, fsview.MountOptions{Name: "rtrs-server"})
	if err != nil {
		return fmt.Errorf("mount %s: %w", *mount, err)
	}
	defer func() {
		if err := fsrv.Unmount(); err != nil {
			lg.WithError(err).Warn("unmount")
			_, _ = fsview.Cleanup(*mount)
		}
	}()
	if *rnbdMount != "" {
		rsrv, err := fsview.Mount(*rnbdMount, &fsview.RNBDServerTree{Server: rs}, fsview.MountOptions{Name: "rnbd-server"})
		if err != nil {
			return fmt.Errorf("mount %s: %w", *rnbdMount, err)
		}
		defer func() {
			if err := rsrv.Unmount(); err != nil {
				lg.WithError(err).Warn("unmount")
				_, _ = fsview.Cleanup(*rnbdMount)
			}
		}()
	}
	// SIGHUP: the export search path and the log level follow the config file (unless the
	// command line set them); the rest needs a restart.
	hup := func() {
		cfg, err := daemon.ReadConfig(fs.Lookup("config").Value.String(), true)
		if err != nil {
			lg.WithError(err).Warn("reload")
			return
		}
		if v, ok := cfg.Settings["dev-search-path"]; ok && !onCmdLine["dev-search-path"] {
			if err := rs.SetSearchPath(v); err != nil {
				lg.WithError(err).Warn("reload")
			} else {
				lg.Infof("reload: exports under %s", v)
			}
		}
		aclFile := *aclPath
		if v, ok := cfg.Settings["acl"]; ok && !onCmdLine["acl"] {
			aclFile = v
		}
		if acl, err := loadACL(aclFile); err != nil {
			lg.WithError(err).Warn("reload: ACL kept as it was")
		} else {
			rs.SetACL(acl)
			lg.Infof("reload: ACL from %q", aclFile)
		}
		if v, ok := cfg.Settings["log-level"]; ok && !onCmdLine["log-level"] {
			if err := daemon.SetupLog(v, *json); err != nil {
				lg.WithError(err).Warn("reload")
			}
		}
	}
	reload.Store(&hup)
	lg.Infof("listening on %v, exports under %s, trees at %s and %s", srv.Addr(), *search, *mount, *rnbdMount)
	daemon.Notify("READY=1\nSTATUS=" + status(srv))
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			daemon.Notify("STOPPING=1")
			return nil
		case <-t.C:
			daemon.Notify("STATUS=" + status(srv))
		}
	}
}

// status is the one-line STATUS= of the unit.
func status(srv *transport.Server) string {
	sess, paths := 0, 0
	for _, s := range srv.Sessions() {
		sess++
		paths += len(s.Paths())
	}
	return fmt.Sprintf("%d sessions, %d paths connected", sess, paths)
}

// loadACL reads the export ACL file ("": none, the default rules).
func loadACL(path string) (*rnbd.ACL, error) {
	if path == "" {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return rnbd.ParseACL(f, path)
}
