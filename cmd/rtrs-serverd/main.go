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
	"fmt"
	"sync/atomic"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func main() { daemon.Main("rtrs-serverd", run) }

func run(parent context.Context, args []string) error {
	var reload atomic.Pointer[func()] // set once the server runs; SIGHUP before that is a no-op
	ctx, stop := daemon.Signals(parent, func() {
		if f := reload.Load(); f != nil {
			(*f)()
		}
	})
	defer stop()
	c, cfg, err := daemon.Load("rtrs-serverd", usage, args, newConfig)
	if err == nil {
		err = noDecls(cfg)
	}
	if err != nil {
		return err
	}
	lg, err := c.Start(ctx, "rtrs-serverd")
	if err != nil {
		return err
	}
	if c.Cleanup {
		return daemon.CleanupMounts(c.Mount, c.RNBDMount)
	}
	r, err := c.resolve()
	if err != nil {
		return err
	}
	prov, _, err := c.OpenProvider(lg, c.softOptions(), r.addr.Addr())
	if err != nil {
		return err
	}
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: c.SearchPath, MaxIOSize: r.chunkSize - transport.MaxHdrSize,
		ZeroCopyReadMin: r.zcMin, ZeroCopyLocal: c.ZeroCopyLocal, ACL: r.acl, ExportIO: r.exportIO})
	if err != nil {
		return err
	}
	defer rs.Close()
	o := transport.DefaultServerOptions()
	o.Provider, o.Handler, o.Addr = prov, rs, r.addr
	o.QueueDepth, o.ChunkSize, o.AlwaysInvalidate = c.QueueDepth, r.chunkSize, c.AlwaysInvalidate
	o.Timings.HeartbeatInterval, o.Timings.ZombieTimeout = c.HeartbeatInterval, c.EstablishTimeout
	o.Limits, o.Allow, o.AllowSubjects, o.NamesFile = r.limits, r.allow, r.subjects, c.NamesFile
	srv, err := transport.NewServer(o)
	if err != nil {
		return err
	}
	defer srv.Close()
	if c.Metrics != "" {
		ml, err := metrics.Serve(c.Metrics, lg, metrics.NewServer(srv, rs))
		if err != nil {
			return fmt.Errorf("-metrics: %w", err)
		}
		defer ml.Close()
	}
	unmount, err := daemon.Mount(lg, c.Mount, "rtrs-server", &fsview.ServerTree{Server: srv})
	if err != nil {
		return err
	}
	defer unmount()
	if c.RNBDMount != "" {
		unmount, err := daemon.Mount(lg, c.RNBDMount, "rnbd-server", &fsview.RNBDServerTree{Server: rs})
		if err != nil {
			return err
		}
		defer unmount()
	}
	running := *c // what the server was started with, for a reload to compare with
	hup := func() { reloadSettings(lg, args, &running, rs) }
	reload.Store(&hup)
	lg.Infof("listening on %v, exports under %s, trees at %s and %s", srv.Addr(), c.SearchPath, c.Mount, c.RNBDMount)
	daemon.Serve(ctx, func() string { return status(srv) })
	return nil
}

// noDecls refuses a server config with lines that are no "key = value" setting: the server
// has no declarations, and such a line is a setting mistyped ("listen [::]:1235"), which
// would leave the default in force without a word.
func noDecls(cfg *daemon.Config) error {
	if len(cfg.Decls) > 0 {
		return fmt.Errorf("config: %q is not a \"key = value\" setting", cfg.Decls[0])
	}
	return nil
}

// reloadSettings is SIGHUP: the settings are loaded again as at start (the file's, the
// command line's winning), and the export search path, the ACL and the log level follow
// them; the rest needs a restart, which the log says for each that changed. A file that
// would not start the daemon (a bad value, a bad ACL) is refused whole: nothing changes,
// and the log says why, so that the next restart does not find it first.
func reloadSettings(lg *log.Entry, args []string, running *config, rs *rnbd.Server) {
	c, cfg, err := daemon.Load("rtrs-serverd", usage, args, newConfig)
	if err == nil {
		err = noDecls(cfg)
	}
	if err == nil {
		_, err = c.resolve()
	}
	if err == nil {
		err = c.CheckFiles()
	}
	var acl *rnbd.ACL
	if err == nil {
		acl, err = loadACL(c.ACL)
	}
	if err == nil && c.SearchPath == "" {
		err = fmt.Errorf("-dev-search-path: empty")
	}
	if err != nil {
		lg.WithError(err).Error("reload refused, nothing changed: the file would not start the daemon")
		return
	}
	for _, ch := range daemon.Unapplied(running, c, "dev-search-path", "acl", "log-level", "log-json") {
		lg.Warnf("reload: %s not applied: it takes effect at a restart", ch)
	}
	if err := rs.SetSearchPath(c.SearchPath); err != nil {
		lg.WithError(err).Warn("reload")
	} else {
		lg.Infof("reload: exports under %s", c.SearchPath)
	}
	rs.SetACL(acl)
	lg.Infof("reload: ACL from %q", c.ACL)
	if err := daemon.SetupLog(c.LogLevel, c.LogJSON); err != nil {
		lg.WithError(err).Warn("reload")
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
