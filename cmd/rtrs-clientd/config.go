package main

import (
	"flag"
	"fmt"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

const usage = `rtrs-clientd: the RTRS client daemon. It opens RTRS sessions to RNBD servers (the kernel's
rnbd-server or rtrs-serverd), maps their devices, and mounts the rtrs-client tree
(/sys/class/rtrs-client's files) at -mount and the device view at -dev-mount, also served over
NBD. Settings and declarations come from -config; flags on the command line win.`

// config is rtrs-clientd's settings, each with its flag; newConfig holds the defaults.
type config struct {
	daemon.Common
	Mount, DevMount   string
	NBDSocket         string
	NBDSocketGroup    string
	NBDTCP            string
	NBDTLS            daemon.TLSFiles
	NBDAttach         string
	NBDConns          int
	NBDTimeout        time.Duration
	UblkAttach        string
	UblkQueues        string
	UblkDepth         int
	IOTimeout         time.Duration
	ReconnectDelay    time.Duration
	HeartbeatInterval time.Duration
	ConPerPath        int
	MaxChunkMemory    string
	NBDRegMemory      string
	UblkRegMemory     string
}

func newConfig() *config {
	return &config{
		Common: daemon.NewCommon("/etc/rtrs/rtrs-clientd.conf"),
		Mount:  "/run/rtrs/rtrs-client", DevMount: "/run/rtrs/dev", NBDSocket: "/run/rtrs/nbd.sock",
		NBDAttach: "none", UblkAttach: "none", UblkQueues: "cpus", UblkDepth: 128, IOTimeout: rnbd.DefaultReconnectTimeout, MaxChunkMemory: "256M",
		NBDRegMemory: "256M", UblkRegMemory: "1G",
	}
}

// Base implements daemon.Settings.
func (c *config) Base() *daemon.Common { return &c.Common }

// Flags implements daemon.Settings.
func (c *config) Flags(fs *flag.FlagSet) {
	c.Common.Flags(fs, metrics.FlagUsage, "detach stale mounts and exit")
	fs.StringVar(&c.Mount, "mount", c.Mount, "where the rtrs-client tree is mounted")
	fs.StringVar(&c.DevMount, "dev-mount", c.DevMount, "where the device view is mounted")
	fs.StringVar(&c.NBDSocket, "nbd-socket", c.NBDSocket, "unix socket serving the mapped devices over NBD (empty: none)")
	fs.StringVar(&c.NBDSocketGroup, "nbd-socket-group", c.NBDSocketGroup, "group that may use the NBD socket too (mode 0660; empty: root only, mode 0600)")
	fs.StringVar(&c.NBDTCP, "nbd-tcp", c.NBDTCP, "TCP address serving them too (empty: none); beyond loopback only with TLS")
	c.NBDTLS.Flags(fs, "nbd-tls", "NBD TCP listener, STARTTLS")
	fs.StringVar(&c.NBDAttach, "nbd-attach", c.NBDAttach, "attach mappings without an nbd= token to the kernel's /dev/nbdX: none or auto")
	fs.IntVar(&c.NBDConns, "nbd-conns", c.NBDConns, "sockets per attached /dev/nbdX (0: the CPUs, at most 4)")
	fs.DurationVar(&c.NBDTimeout, "nbd-timeout", c.NBDTimeout, "the kernel's request timeout on an attached /dev/nbdX (0: -io-timeout plus one minute)")
	fs.StringVar(&c.UblkAttach, "ublk-attach", c.UblkAttach, "attach mappings without a ublk= token to /dev/ublkbN: none or auto")
	fs.StringVar(&c.UblkQueues, "ublk-queues", c.UblkQueues, "queues of a /dev/ublkbN: cpus (one per CPU), paths (one per path of its session) or a number")
	fs.IntVar(&c.UblkDepth, "ublk-depth", c.UblkDepth, "requests in flight per ublk queue (1 to 4096)")
	fs.StringVar(&c.UblkRegMemory, "ublk-registered-memory", c.UblkRegMemory, "the most memory registered for RDMA that ublk queues keep their requests' buffers in (queue depth × max IO each, pinned while the device exists); past it a queue's data is copied through the transport's stage (off: none)")
	fs.DurationVar(&c.IOTimeout, "io-timeout", c.IOTimeout, "how long IO waits for a session that lost every path before it fails with EIO (0: 30 s)")
	fs.DurationVar(&c.ReconnectDelay, "reconnect-delay", c.ReconnectDelay, "how long a disconnected path waits before each reconnect attempt, plus 0–7 ms so paths do not reconnect in step (0: 30 s, what RNBD asks of the kernel's RTRS)")
	fs.DurationVar(&c.HeartbeatInterval, "heartbeat-interval", c.HeartbeatInterval, "how often each path sends a heartbeat; a path that misses more than 5 in a row is reconnected (0: 5 s, as the kernel)")
	fs.IntVar(&c.ConPerPath, "con-per-path", c.ConPerPath, "connections (QPs) per path: one for the service messages plus one per CPU to spread IO over (0: CPUs + 1, as the kernel)")
	fs.StringVar(&c.NBDRegMemory, "nbd-registered-memory", c.NBDRegMemory, "the most memory registered for RDMA that NBD connections (sockets and attached /dev/nbdX) serve request data from, about 15.5 MiB each; past it a connection's data is copied through the transport's stage (off: none)")
	fs.StringVar(&c.MaxChunkMemory, "max-chunk-memory", c.MaxChunkMemory, "the most chunk memory (queue depth × (chunk size + a 4 KiB header)) a server may make a session allocate")
}

// resolved is what the settings say once parsed and checked.
type resolved struct {
	attachDefault control.Attach
	ublkDefault   control.Attach
	nbdTimeout    time.Duration
	chunkMemory   int64
	nbdRegMemory  int64 // nbd.Options.MaxArenaMemory: -1 for off
	ublkRegMemory int64 // the ublk queues' registered buffers, all devices: -1 for off
}

func (c *config) resolve() (*resolved, error) {
	r := &resolved{nbdTimeout: c.NBDTimeout}
	var err error
	if r.attachDefault, err = parseNBDDefault(c.NBDAttach); err != nil {
		return nil, err
	}
	if r.ublkDefault, err = parseNBDDefault(c.UblkAttach); err != nil {
		return nil, fmt.Errorf("-ublk-attach %q: none or auto", c.UblkAttach)
	}
	if err := parseUblkQueues(c.UblkQueues); err != nil {
		return nil, err
	}
	if c.UblkDepth < 1 || c.UblkDepth > 4096 {
		return nil, fmt.Errorf("-ublk-depth %d: 1 to 4096", c.UblkDepth)
	}
	if c.NBDConns < 0 || c.NBDConns > 64 {
		return nil, fmt.Errorf("-nbd-conns %d: 0 to 64", c.NBDConns)
	}
	for _, iv := range []struct {
		name string
		d    time.Duration
		zero bool
	}{{"nbd-timeout", c.NBDTimeout, true}, {"io-timeout", c.IOTimeout, true},
		{"reconnect-delay", c.ReconnectDelay, true}, {"heartbeat-interval", c.HeartbeatInterval, true}} {
		if err := daemon.CheckInterval(iv.name, iv.d, time.Millisecond, iv.zero); err != nil {
			return nil, err
		}
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = rnbd.DefaultReconnectTimeout
	}
	if r.nbdTimeout == 0 {
		r.nbdTimeout = c.IOTimeout + time.Minute
	}
	n, err := size.Parse(c.MaxChunkMemory)
	if err != nil || n < 1 {
		return nil, fmt.Errorf("-max-chunk-memory %q: want a size such as 256M", c.MaxChunkMemory)
	}
	r.chunkMemory = int64(n)
	m, err := size.ParseThreshold(c.NBDRegMemory)
	if err != nil {
		return nil, fmt.Errorf("-nbd-registered-memory %q: want a size such as 256M, or off", c.NBDRegMemory)
	}
	r.nbdRegMemory = int64(m)
	if m, err = size.ParseThreshold(c.UblkRegMemory); err != nil {
		return nil, fmt.Errorf("-ublk-registered-memory %q: want a size such as 1G, or off", c.UblkRegMemory)
	}
	r.ublkRegMemory = int64(m)
	return r, nil
}
