// Command rtrs-clientd is the RTRS client daemon: it opens RTRS sessions to rtrs-serverd,
// maps remote devices over them (RNBD), and shows them in three places: the rtrs-client tree
// (/sys/class/rtrs-client's files) and the device view over FUSE, and an NBD socket; a
// mapping may also be attached to the kernel's /dev/nbdX (map_device's nbd= token).
//
//	rtrs-clientd [-config /etc/rtrs/rtrs-clientd.conf] [-mount /run/rtrs/rtrs-client]
//	             [-dev-mount /run/rtrs/dev] [-nbd-socket /run/rtrs/nbd.sock] [-nbd-tcp ADDR]
//	             [-nbd-attach none|auto] [-nbd-conns N] [-nbd-timeout D]
//	             [-io-timeout 30s] [-reconnect-delay 30s] [-log-level info] [-log-json]
//	rtrs-clientd -cleanup      (detach stale mounts and NBD devices left by a crash, then exit)
//
// The config file holds settings ("key = value", the flags' names) and declarations in the
// control files' syntax ("open_session sessname=… path=…", "map_device sessname=… device_path=…");
// sessions and devices opened or mapped at runtime are written back into it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/nbd"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func main() {
	if err := run(context.Background(), os.Args[1:]); errors.Is(err, flag.ErrHelp) {
		os.Exit(0) // -h: the usage went to stderr
	} else if err != nil {
		fmt.Fprintln(os.Stderr, "rtrs-clientd:", err)
		os.Exit(1)
	}
}

type clientd struct {
	cfgPath string
	c       *rnbd.Client
	ctl     *control.Client
	nbd     *nbdAttacher
	lg      *log.Entry

	mu           sync.Mutex      // the config file and the fields below
	applied      bool            // declarations tried once: write-back may start
	pendingDecls map[string]bool // declarations still waiting for their server

	ctx context.Context // the daemon's: retries of declarations end with it
	wg  sync.WaitGroup  // those retries
}

func run(parent context.Context, args []string) error {
	var cur atomic.Pointer[clientd] // set once the daemon is up; SIGHUP before that is a no-op
	ctx, stop := daemon.Signals(parent, func() {
		if d := cur.Load(); d != nil {
			d.reload()
		}
	})
	defer stop()
	fs := flag.NewFlagSet("rtrs-clientd", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), `rtrs-clientd: the RTRS client daemon. It opens RTRS sessions to RNBD servers (the kernel's
rnbd-server or rtrs-serverd), maps their devices, and mounts the rtrs-client tree
(/sys/class/rtrs-client's files) at -mount and the device view at -dev-mount, also served over
NBD. Settings and declarations come from -config; flags on the command line win.

Flags:`)
		fs.PrintDefaults()
	}
	cfgPath := fs.String("config", "/etc/rtrs/rtrs-clientd.conf", "config file: settings and declarations (flags override settings)")
	mount := fs.String("mount", "/run/rtrs/rtrs-client", "where the rtrs-client tree is mounted")
	devMount := fs.String("dev-mount", "/run/rtrs/dev", "where the device view is mounted")
	nbdSock := fs.String("nbd-socket", "/run/rtrs/nbd.sock", "unix socket serving the mapped devices over NBD (empty: none)")
	nbdGroup := fs.String("nbd-socket-group", "", "group that may use the NBD socket too (mode 0660; empty: root only, mode 0600)")
	nbdTCP := fs.String("nbd-tcp", "", "TCP address serving them too (empty: none); beyond loopback only with TLS")
	nbdTLSFlags := daemon.TLSFlags(fs, "nbd-tls", "NBD TCP listener, STARTTLS")
	nbdAttach := fs.String("nbd-attach", "none", "attach mappings without an nbd= token to the kernel's /dev/nbdX: none or auto")
	nbdConns := fs.Int("nbd-conns", 0, "sockets per attached /dev/nbdX (0: the CPUs, at most 4)")
	nbdTimeout := fs.Duration("nbd-timeout", 0, "the kernel's request timeout on an attached /dev/nbdX (0: -io-timeout plus one minute)")
	ioTimeout := fs.Duration("io-timeout", rnbd.DefaultReconnectTimeout, "how long IO waits for a session that lost every path before it fails with EIO")
	recDelay := fs.Duration("reconnect-delay", 0, "how long a disconnected path waits before each reconnect attempt, plus 0–7 ms so paths do not reconnect in step (0: 30 s, what RNBD asks of the kernel's RTRS)")
	hbInterval := fs.Duration("heartbeat-interval", 0, "how often each path sends a heartbeat; a path that misses more than 5 in a row is reconnected (0: 5 s, as the kernel)")
	conPerPath := fs.Int("con-per-path", 0, "connections (QPs) per path: one for the service messages plus one per CPU to spread IO over (0: CPUs + 1, as the kernel)")
	provName := fs.String("provider", "auto", pick.Usage)
	softTLS := daemon.TLSFlags(fs, "tls", "soft provider, mutual TLS")
	maxMem := fs.String("max-chunk-memory", "256M", "the most chunk memory (queue depth × chunk size) a server may make a session allocate")
	metricsAddr := fs.String("metrics", "", metrics.FlagUsage)
	level := fs.String("log-level", "info", "log level")
	json := fs.Bool("log-json", false, "log JSON lines")
	cleanup := fs.Bool("cleanup", false, "detach stale mounts and exit")
	cfg, err := daemon.Flags(fs, args, "config", true)
	if err != nil {
		return err
	}
	if err := daemon.SetupLog(*level, *json); err != nil {
		return err
	}
	nbdDef, err := parseNBDDefault(*nbdAttach)
	if err != nil {
		return err
	}
	if *nbdConns < 0 || *nbdConns > 64 {
		return fmt.Errorf("-nbd-conns %d: 0 to 64", *nbdConns)
	}
	if *nbdTimeout < 0 {
		return fmt.Errorf("-nbd-timeout %v", *nbdTimeout)
	}
	if *nbdTimeout == 0 {
		*nbdTimeout = *ioTimeout + time.Minute
	}
	lg := log.G(ctx).WithField("component", "rtrs-clientd")
	if *cleanup {
		disconnectStale(lg)
		return errors.Join(fsview.CleanupReport(*mount), fsview.CleanupReport(*devMount))
	}
	nbdGID, err := lookupGroup(*nbdGroup)
	if err != nil {
		return fmt.Errorf("-nbd-socket-group: %w", err)
	}
	nbdTLS, err := nbdTLSFlags()
	if err != nil {
		return fmt.Errorf("NBD TLS: %w", err)
	}
	if *nbdTCP != "" {
		if err := checkNBDTCP(*nbdTCP, nbdTLS); err != nil {
			return err
		}
	}
	chunkMem, err := size.Parse(*maxMem)
	if err != nil || chunkMem < 1 {
		return fmt.Errorf("-max-chunk-memory %q: want a size such as 256M", *maxMem)
	}
	tlsCfg, err := softTLS()
	if err != nil {
		return err
	}
	prov, why, err := pick.OpenWith(*provName, soft.Options{TLS: tlsCfg})
	if err != nil {
		return fmt.Errorf("-provider: %w", err)
	}
	lg.Infof("provider %s", why)
	if tlsCfg != nil && prov.Name() != "soft" {
		return fmt.Errorf("-tls-cert: TLS is the soft provider's; %s authenticates nothing (use -provider soft, or -allow)", prov.Name())
	}
	c := rnbd.NewClient(rnbd.ClientOptions{
		Session: transport.ClientOptions{Provider: prov, ConPerPath: *conPerPath,
			MaxReconnectAttempts: -1, Policy: transport.MinInflight, MaxChunkMemory: int64(chunkMem),
			Timings: transport.Timings{ReconnectDelay: *recDelay, HeartbeatInterval: *hbInterval}},
		ReconnectTimeout: *ioTimeout,
	})
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c.Close(cctx)
	}()
	if *metricsAddr != "" {
		ml, err := metrics.Serve(*metricsAddr, lg, metrics.NewClient(c))
		if err != nil {
			return fmt.Errorf("-metrics: %w", err)
		}
		defer ml.Close()
	}
	d := &clientd{cfgPath: *cfgPath, c: c, lg: lg, ctx: ctx, pendingDecls: map[string]bool{}}
	defer d.wg.Wait()
	ns := nbd.NewServer(nbd.Options{Exports: d.exports})
	defer ns.Close()
	// Stale devices first: a restart must find the indexes its declarations name free.
	disconnectStale(lg)
	d.nbd = &nbdAttacher{srv: ns, def: nbdDef, conns: *nbdConns, timeout: *nbdTimeout, export: exportOf, lg: lg,
		devs: map[*rnbd.Device]*nbd.Attachment{}, tokens: map[*rnbd.Device]control.Attach{}}
	// Before the NBD server closes (defers run last first): the kernel is told first.
	defer d.nbd.detachAll()
	d.ctl = &control.Client{RNBD: c, Attacher: d.nbd, OnChange: d.writeBack}
	cs, err := fsview.Mount(*mount, &fsview.ClientTree{Ctl: d.ctl}, fsview.MountOptions{Name: "rtrs-client"})
	if err != nil {
		return fmt.Errorf("mount %s: %w", *mount, err)
	}
	defer unmount(lg, cs, *mount)
	ds, err := fsview.Mount(*devMount, &fsview.DevTree{Ctl: d.ctl}, fsview.MountOptions{Name: "rtrs-dev"})
	if err != nil {
		return fmt.Errorf("mount %s: %w", *devMount, err)
	}
	defer unmount(lg, ds, *devMount)
	if *nbdSock != "" {
		ln, err := listenUnix(*nbdSock, nbdGID)
		if err != nil {
			return fmt.Errorf("NBD on %s: %w", *nbdSock, err)
		}
		defer os.Remove(*nbdSock)
		go func() { _ = ns.Serve(ln) }()
	}
	if *nbdTCP != "" {
		ln, err := net.Listen("tcp", *nbdTCP)
		if err != nil {
			return fmt.Errorf("NBD on %s: %w", *nbdTCP, err)
		}
		if nbdTLS != nil {
			go func() { _ = ns.ServeTLS(ln, nbdTLS) }()
		} else {
			go func() { _ = ns.Serve(ln) }()
		}
	}
	cur.Store(d)
	lg.Infof("trees at %s and %s, NBD at %s", *mount, *devMount, *nbdSock)
	daemon.Notify("READY=1\nSTATUS=" + d.status())
	// Declarations are applied after READY: a server that is down must not hold up boot.
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.apply(ctx, cfg.Decls)
	}()
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			daemon.Notify("STATUS=" + d.status())
		}
	}
}

func unmount(lg *log.Entry, s interface{ Unmount() error }, dir string) {
	if err := s.Unmount(); err != nil {
		lg.WithError(err).Warnf("unmount %s", dir)
		_, _ = fsview.Cleanup(dir)
	}
}

// exports lists every mapped device as an NBD export "<session>/<device file name>".
func (d *clientd) exports() []nbd.Export {
	var out []nbd.Export
	for _, dev := range d.c.Devices() {
		if dev.State() == rnbd.StateUnmapped || !dev.Opened() {
			continue
		}
		out = append(out, exportOf(dev))
	}
	return out
}

// exportOf is a mapped device's NBD export.
func exportOf(dev *rnbd.Device) nbd.Export {
	return nbd.Export{Name: dev.Session() + "/" + control.DeviceFileName(dev.Path()),
		Description: fmt.Sprintf("rnbd %s:%s (%v)", dev.Session(), dev.Path(), dev.AccessMode()),
		Dev:         dev, ReadOnly: dev.AccessMode() == rnbd.AccessRO}
}

// status is the unit's STATUS= line.
func (d *clientd) status() string {
	sess, up, all := 0, 0, 0
	for _, n := range d.c.SessionNames() {
		s := d.c.Session(n)
		if s == nil {
			continue
		}
		sess++
		for _, p := range s.Paths() {
			all++
			if p.State() == transport.StateConnected {
				up++
			}
		}
	}
	st := fmt.Sprintf("%d sessions, %d/%d paths connected, %d devices mapped", sess, up, all, len(d.c.Devices()))
	if n := d.nbd.count(); n > 0 {
		st += fmt.Sprintf(", %d attached to /dev/nbd*", n)
	}
	return st
}
