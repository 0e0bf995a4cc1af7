// Command rtrs-clientd is the RTRS client daemon: it opens RTRS sessions to rtrs-serverd,
// maps remote devices over them (RNBD), and shows them in three places: the rtrs-client tree
// (/sys/class/rtrs-client's files) and the device view over FUSE, and an NBD socket; a
// mapping may also be attached to the kernel's /dev/nbdX (map_device's nbd= token) and to
// a ublk device, /dev/ublkbX (ublk=).
//
//	rtrs-clientd [-config /etc/rtrs/rtrs-clientd.conf] [-mount /run/rtrs/rtrs-client]
//	             [-dev-mount /run/rtrs/dev] [-nbd-socket /run/rtrs/nbd.sock] [-nbd-tcp ADDR]
//	             [-nbd-attach none|auto] [-nbd-conns N] [-nbd-timeout D]
//	             [-nbd-registered-memory 256M|off]
//	             [-ublk-attach none|auto] [-ublk-queues cpus|paths|N] [-ublk-depth N]
//	             [-ublk-registered-memory 1G|off]
//	             [-io-timeout 30s] [-reconnect-delay 30s] [-log-level info] [-log-json]
//	rtrs-clientd -cleanup      (detach stale mounts and NBD devices left by a crash, then exit)
//
// The config file holds settings ("key = value", the flags' names) and declarations in the
// control files' syntax ("open_session sessname=… path=…", "map_device sessname=… device_path=…");
// sessions and devices opened or mapped at runtime are written back into it.
package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/fsview"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/nbd"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// A mapped device counts its openers through both, and gives NBD connections memory its
// transport takes without the stage copy: a signature that drifts apart must not build (a
// type assertion would turn either off without a word).
var (
	_ fsview.Holder    = (*rnbd.Device)(nil)
	_ nbd.Holder       = (*rnbd.Device)(nil)
	_ nbd.BufferDevice = (*rnbd.Device)(nil)
)

func main() { daemon.Main("rtrs-clientd", run) }

type clientd struct {
	cfgPath string
	args    []string // the command line, for reloads
	running config   // the settings it was started with, for a reload to compare with
	c       *rnbd.Client
	ctl     *control.Client
	nbd     *nbdAttacher
	ublk    *ublkAttacher
	lg      *log.Entry

	wbMu         sync.Mutex      // one write-back at a time, from its snapshot to its rename
	mu           sync.Mutex      // the fields below
	applied      bool            // declarations tried once: write-back may start
	skipped      bool            // a change came before that: written back once it is so
	stopping     bool            // shutting down: the teardown is not written back
	pendingDecls map[string]bool // declarations still waiting for their server
	gen          int             // the config file's generation whose declarations apply runs
	stopRetry    chan struct{}   // closed when a later generation takes over: retries end
	applyDone    chan struct{}   // closed when that generation's apply has returned

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
	c, cfg, err := daemon.Load("rtrs-clientd", usage, args, newConfig)
	if err != nil {
		return err
	}
	lg, err := c.Start(ctx, "rtrs-clientd")
	if err != nil {
		return err
	}
	if c.Cleanup {
		// Before the settings are checked: a stale mount is cleared even when the file
		// that caused the crash has a bad value too.
		disconnectStale(lg)
		return daemon.CleanupMounts(c.Mount, c.DevMount)
	}
	st, err := c.check(cfg)
	if err != nil {
		return err
	}
	r, nbdGID, nbdTLS := st.r, st.nbdGID, st.nbdTLS
	prov, _, err := c.OpenProvider(lg, soft.Options{})
	if err != nil {
		return err
	}
	rc := rnbd.NewClient(rnbd.ClientOptions{
		Session: transport.ClientOptions{Provider: prov, ConPerPath: c.ConPerPath,
			MaxReconnectAttempts: -1, Policy: transport.MinInflight, MaxChunkMemory: r.chunkMemory,
			Timings: transport.Timings{ReconnectDelay: c.ReconnectDelay, HeartbeatInterval: c.HeartbeatInterval}},
		ReconnectTimeout: c.IOTimeout,
	})
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rc.Close(cctx)
	}()
	if c.Metrics != "" {
		ml, err := metrics.Serve(c.Metrics, lg, metrics.NewClient(rc))
		if err != nil {
			return fmt.Errorf("-metrics: %w", err)
		}
		defer ml.Close()
	}
	d := &clientd{cfgPath: c.ConfigFile, args: args, running: *c, c: rc, lg: lg, ctx: ctx, pendingDecls: map[string]bool{}}
	defer d.wg.Wait()
	ns := nbd.NewServer(nbd.Options{Exports: d.exports, MaxArenaMemory: r.nbdRegMemory})
	defer ns.Close()
	// Stale devices first: a restart must find the indexes its declarations name free.
	disconnectStale(lg)
	d.nbd = &nbdAttacher{srv: ns, def: r.attachDefault, conns: c.NBDConns, timeout: r.nbdTimeout, export: exportOf, lg: lg,
		devs: map[*rnbd.Device]*nbd.Attachment{}, tokens: map[*rnbd.Device]control.Attach{}}
	// Before the NBD server closes (defers run last first): the kernel is told first.
	defer d.nbd.detachAll()
	// The devices' IO outlives the signal until what file systems on them hold dirty is
	// written back (syncInUse), then ends before their teardown.
	ioCtx, ioStop := context.WithCancel(context.WithoutCancel(ctx))
	defer ioStop()
	d.ublk = newUblkAttacher(ioCtx, c, r, rc, lg)
	defer d.ublk.detachAll()
	d.ctl = &control.Client{RNBD: rc, Attacher: d.nbd, Ublk: d.ublk, OnChange: d.writeBack}
	for _, m := range []struct {
		dir, name string
		tree      fsview.Dir
	}{{c.Mount, "rtrs-client", &fsview.ClientTree{Ctl: d.ctl}}, {c.DevMount, "rtrs-dev", &fsview.DevTree{Ctl: d.ctl}}} {
		unmount, err := daemon.Mount(lg, m.dir, m.name, m.tree)
		if err != nil {
			return err
		}
		defer unmount()
	}
	stopNBD, err := serveNBD(ns, c.NBDSocket, nbdGID, c.NBDTCP, nbdTLS)
	if err != nil {
		return err
	}
	if c.NBDTCP != "" && nbdTLS == nil {
		lg.Warnf("NBD on %s in clear: every local user, not only root, can read and write every mapped device through it (the socket %s is root's)", c.NBDTCP, c.NBDSocket)
	}
	defer stopNBD()
	cur.Store(d)
	lg.Infof("trees at %s and %s, NBD at %s", c.Mount, c.DevMount, c.NBDSocket)
	// Deferred last, so it runs first: what the teardown unmaps stays declared in the file.
	defer d.stopWriteBack()
	// Declarations are applied after READY: a server that is down must not hold up boot.
	d.startApply(cfg.Decls)
	daemon.Serve(ctx, d.status)
	d.syncInUse(stopSyncWait)
	ioStop()
	return nil
}

// checked is what check gives a start.
type checked struct {
	r      *resolved
	nbdGID int
	nbdTLS *tls.Config
}

// check is everything a start checks before it does anything, in one place for the start
// and the reload (which refuses a file a start would): the settings resolved, the
// declarations parsed, the NBD listeners' group and TLS, the TLS files.
func (c *config) check(cfg *daemon.Config) (checked, error) {
	r, err := c.resolve()
	if err != nil {
		return checked{}, err
	}
	if err := checkDecls(cfg.Decls); err != nil {
		return checked{}, err
	}
	gid, tlsCfg, err := c.nbdListen()
	if err != nil {
		return checked{}, err
	}
	if err := c.CheckFiles(); err != nil {
		return checked{}, err
	}
	return checked{r, gid, tlsCfg}, nil
}

// nbdListen resolves what the NBD listeners need: the socket's group, the TCP listener's
// TLS, and that a TCP listener has it.
func (c *config) nbdListen() (gid int, tlsCfg *tls.Config, err error) {
	if gid, err = lookupGroup(c.NBDSocketGroup); err != nil {
		return 0, nil, fmt.Errorf("-nbd-socket-group: %w", err)
	}
	if tlsCfg, err = c.NBDTLS.Config(); err != nil {
		return 0, nil, fmt.Errorf("NBD TLS: %w", err)
	}
	if c.NBDTCP != "" {
		if err := checkNBDTCP(c.NBDTCP, tlsCfg); err != nil {
			return 0, nil, err
		}
	}
	return gid, tlsCfg, nil
}

// stopSyncWait bounds the write-back of dirty data at a stop (syncInUse).
const stopSyncWait = 30 * time.Second

// syncInUse writes back, before the daemon stops its block devices, what file systems
// mounted on them (or on devices stacked over them: LVM, md) hold dirty, and what their
// openers left in their page cache: a stop under a mounted file system (a planned
// restart, SIGTERM) would otherwise lose it, the stop failing its final writes. Only those
// file systems (syncfs), not the host's every one; bounded by wait: a device whose server
// is gone cannot take the writes, and the stop must not hang on it.
func (d *clientd) syncInUse(wait time.Duration) {
	devs := append(d.nbd.inUse(), d.ublk.inUse()...)
	if len(devs) == 0 {
		return
	}
	d.lg.Infof("stopping: writing back what is dirty on %d devices in use (%v)", len(devs), devs)
	done := make(chan int, 1)
	go func() { done <- syncDevices(devs) }()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case n := <-done:
		d.lg.Infof("stopping: written back (%d file systems)", n)
	case <-t.C:
		d.lg.Warnf("stopping: the write-back did not end within %v; the devices stop all the same", wait)
	}
}

// serveNBD serves the NBD server on the unix socket at sock (group gid may use it too; ""
// for none) and on TCP at tcp (with STARTTLS when tlsCfg is set; "" for none). The returned
// function removes the socket file; the listeners close with the server.
func serveNBD(ns *nbd.Server, sock string, gid int, tcp string, tlsCfg *tls.Config) (func(), error) {
	stop := func() {}
	if sock != "" {
		ln, err := listenUnix(sock, gid)
		if err != nil {
			return nil, fmt.Errorf("NBD on %s: %w", sock, err)
		}
		stop = func() { os.Remove(sock) }
		go func() { _ = ns.Serve(ln) }()
	}
	if tcp != "" {
		ln, err := net.Listen("tcp", tcp)
		if err != nil {
			stop()
			return nil, fmt.Errorf("NBD on %s: %w", tcp, err)
		}
		if tlsCfg != nil {
			go func() { _ = ns.ServeTLS(ln, tlsCfg) }()
		} else {
			go func() { _ = ns.Serve(ln) }()
		}
	}
	return stop, nil
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
	if n := d.ublk.count(); n > 0 {
		st += fmt.Sprintf(", %d to /dev/ublkb*", n)
	}
	return st
}
