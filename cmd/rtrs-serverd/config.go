package main

import (
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/daemon/metrics"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

const usage = `rtrs-serverd: the RTRS server daemon. It accepts RTRS client sessions (the kernel's
rtrs-client or rtrs-clientd), serves RNBD block IO from the files and block devices under
-dev-search-path, and mounts the rtrs-server tree (/sys/class/rtrs-server's files) at -mount
and the rnbd-server tree (/sys/class/rnbd-server's: who has which export open, force_close)
at -rnbd-mount.
Settings come from -config (key = value, the flags' names); flags on the command line win.
Security knobs: docs/security.md.`

// config is rtrs-serverd's settings, each with its flag; newConfig holds the defaults.
type config struct {
	daemon.Common
	Listen            string
	SearchPath        string
	QueueDepth        int
	ChunkSize         string
	AlwaysInvalidate  bool
	ZeroCopyReadMin   string
	ZeroCopyLocal     bool
	ExportIO          string
	HeartbeatInterval time.Duration
	Mount, RNBDMount  string

	AllowSubject, Allow, ACL, NamesFile string

	MaxSessions, MaxConnsPerPath, MaxConnecting, MaxConnectingPerAddr int
	MaxNewSessionsPerAddr, MaxConns, MaxPending, MaxPendingPerAddr    int
	MaxSessionsPerClient                                              int
	MaxChunkMemory, MaxChunkMemoryPerClient                           string
	EstablishTimeout, HandshakeTimeout                                time.Duration
}

func newConfig() *config {
	return &config{
		Common:     daemon.NewCommon("/etc/rtrs/rtrs-serverd.conf"),
		Listen:     "[::]:1234",
		SearchPath: "/srv/rtrs", QueueDepth: transport.DefaultQueueDepth, ChunkSize: "128K",
		AlwaysInvalidate: true, ZeroCopyReadMin: "64K", ExportIO: "direct",
		Mount: "/run/rtrs/rtrs-server", RNBDMount: "/run/rtrs/rnbd-server",
		NamesFile:   "/var/lib/rtrs/sessions.json",
		MaxSessions: 256, MaxConnsPerPath: 257, MaxConnecting: 2048, MaxConnectingPerAddr: 514,
		MaxNewSessionsPerAddr: 16, MaxConns: 8192, MaxSessionsPerClient: 64,
		MaxPending: soft.DefaultMaxPending, MaxPendingPerAddr: soft.DefaultMaxPendingPerAddr,
		EstablishTimeout: 30 * time.Second, HandshakeTimeout: soft.DefaultHandshakeTimeout,
	}
}

// Base implements daemon.Settings.
func (c *config) Base() *daemon.Common { return &c.Common }

// Flags implements daemon.Settings.
func (c *config) Flags(fs *flag.FlagSet) {
	c.Common.Flags(fs, metrics.FlagUsage, "detach a stale mount at -mount and -rnbd-mount and exit")
	fs.StringVar(&c.Listen, "listen", c.Listen, "address and port clients connect to (1234 is the kernel's RNBD port, its port_nr parameter)")
	fs.StringVar(&c.SearchPath, "dev-search-path", c.SearchPath, "directory a client's device path is opened under, never above it; %SESSNAME% in it becomes the session's name (the kernel's dev_search_path)")
	fs.IntVar(&c.QueueDepth, "queue-depth", c.QueueDepth, "chunks (receive buffers) each session gets, so the most IOs a session has in flight (the kernel's sess_queue_depth)")
	fs.StringVar(&c.ChunkSize, "chunk-size", c.ChunkSize, "size of one chunk, so the largest IO a client may send in one request (the kernel's max_chunk_size)")
	fs.BoolVar(&c.AlwaysInvalidate, "always-invalidate", c.AlwaysInvalidate, "invalidate a chunk's key before its IO is handed to the export and give it a new one after, so a client cannot write into a chunk the server is working on (the kernel's always_invalidate; off saves two work requests per IO)")
	fs.StringVar(&c.ZeroCopyReadMin, "zero-copy-read-min", c.ZeroCopyReadMin, "READs this large or larger leave a tmpfs or ramfs export straight from the page cache (off: never)")
	fs.BoolVar(&c.ZeroCopyLocal, "zero-copy-local", c.ZeroCopyLocal, "the same for clients on this host (from a loopback address or the address they reach), whose receive copies the page cache's pages anyway, at more cost than the copy it saves the server")
	fs.StringVar(&c.ExportIO, "export-io", c.ExportIO, "how READs and WRITEs reach a block device export: direct (O_DIRECT through Linux AIO, as the kernel's server sends bios) or buffered (through the page cache); files always use the page cache")
	fs.DurationVar(&c.HeartbeatInterval, "heartbeat-interval", c.HeartbeatInterval, "how often each path sends a heartbeat; a path that misses more than 5 in a row is closed (0: 5 s, as the kernel)")
	fs.StringVar(&c.Mount, "mount", c.Mount, "where the rtrs-server tree is mounted")
	fs.StringVar(&c.RNBDMount, "rnbd-mount", c.RNBDMount, "where the rnbd-server tree (ctl/devices/<device>/sessions/<session>/) is mounted (empty: not mounted)")
	fs.StringVar(&c.AllowSubject, "allow-subject", c.AllowSubject, "with TLS: certificate subjects that may connect, ';'-separated (CN=host-a,O=x;CN=host-b)")
	fs.StringVar(&c.Allow, "allow", c.Allow, "clients that may connect: entries separated by ',', each networks or addresses joined by '+' (one host's rails: 10.0.1.5+10.0.2.5); a session is bound to its creator's entry (empty: any)")
	fs.StringVar(&c.ACL, "acl", c.ACL, "export ACL file: lines of <export pattern> <client> <modes> (empty: everyone ro or rw, nobody migration)")
	fs.StringVar(&c.NamesFile, "names-file", c.NamesFile, "where the owner of each session name is kept across restarts (empty: memory only)")
	fs.IntVar(&c.MaxSessions, "max-sessions", c.MaxSessions, "sessions the server holds at most, established or not")
	fs.IntVar(&c.MaxSessionsPerClient, "max-sessions-per-client", c.MaxSessionsPerClient, "sessions one client holds at most: its certificate subject, or its allowlist entry of single addresses, else its address (an IPv6 client: its /64)")
	fs.StringVar(&c.MaxChunkMemory, "max-chunk-memory", c.MaxChunkMemory, "chunk memory of all sessions at most (e.g. 8G; empty: half the machine's memory)")
	fs.StringVar(&c.MaxChunkMemoryPerClient, "max-chunk-memory-per-client", c.MaxChunkMemoryPerClient, "chunk memory of one client's sessions at most, a client as -max-sessions-per-client counts it (empty: a quarter of -max-chunk-memory, and at least one session's)")
	fs.IntVar(&c.MaxConnsPerPath, "max-conns-per-path", c.MaxConnsPerPath, "connections a path may have (its cid_num)")
	fs.IntVar(&c.MaxConnecting, "max-connecting", c.MaxConnecting, "connections of paths not yet established, in all")
	fs.IntVar(&c.MaxConnectingPerAddr, "max-connecting-per-addr", c.MaxConnectingPerAddr, "connections of paths not yet established, per client address (an IPv6 client: per /64)")
	fs.IntVar(&c.MaxNewSessionsPerAddr, "max-new-sessions-per-addr", c.MaxNewSessionsPerAddr, "sessions one client address has opened that have not sent INFO_REQ yet")
	fs.IntVar(&c.MaxConns, "max-conns", c.MaxConns, "connections of all paths, established or not")
	fs.DurationVar(&c.EstablishTimeout, "establish-timeout", c.EstablishTimeout, "how long a path may take from its latest connection to INFO_REQ (and four times that from its first)")
	fs.IntVar(&c.MaxPending, "max-pending", c.MaxPending, "soft provider: connections not yet past the connection request, in all")
	fs.IntVar(&c.MaxPendingPerAddr, "max-pending-per-addr", c.MaxPendingPerAddr, "soft provider: the same, per client address")
	fs.DurationVar(&c.HandshakeTimeout, "handshake-timeout", c.HandshakeTimeout, "soft provider: how long a new connection may take to send its connection request")
}

// resolved is what the settings say once parsed and checked: every refusal happens before
// anything starts.
type resolved struct {
	addr      netip.AddrPort
	chunkSize int
	zcMin     int
	exportIO  rnbd.ExportIO
	limits    transport.ServerLimits
	allow     []transport.AllowEntry
	acl       *rnbd.ACL
	subjects  []string
}

func (c *config) resolve() (*resolved, error) {
	r := &resolved{}
	var err error
	if r.addr, err = netip.ParseAddrPort(c.Listen); err != nil {
		return nil, fmt.Errorf("-listen %q: %w", c.Listen, err)
	}
	if r.chunkSize, err = size.Parse(c.ChunkSize); err != nil {
		return nil, fmt.Errorf("-chunk-size: %w", err)
	}
	if r.zcMin, err = size.ParseThreshold(c.ZeroCopyReadMin); err != nil {
		return nil, fmt.Errorf("-zero-copy-read-min: %w", err)
	}
	if r.exportIO, err = rnbd.ParseExportIO(c.ExportIO); err != nil {
		return nil, fmt.Errorf("-export-io: %w", err)
	}
	r.limits = transport.ServerLimits{MaxSessions: c.MaxSessions, MaxConnsPerPath: c.MaxConnsPerPath,
		MaxConnecting: c.MaxConnecting, MaxConnectingPerAddr: c.MaxConnectingPerAddr,
		MaxNewSessionsPerAddr: c.MaxNewSessionsPerAddr, MaxConns: c.MaxConns, MaxChunkMemory: daemon.DefaultChunkMemory(),
		MaxSessionsPerClient: c.MaxSessionsPerClient}
	// One session is charged queue depth × chunk size; less would refuse every client.
	one := int64(c.QueueDepth) * int64(r.chunkSize)
	for _, b := range []struct {
		flag, v string
		to      *int64
	}{{"max-chunk-memory", c.MaxChunkMemory, &r.limits.MaxChunkMemory}, {"max-chunk-memory-per-client", c.MaxChunkMemoryPerClient, &r.limits.MaxChunkMemoryPerClient}} {
		if b.v == "" {
			continue
		}
		n, err := size.Parse(b.v)
		if err != nil {
			return nil, fmt.Errorf("-%s: %w", b.flag, err)
		}
		if int64(n) < one {
			return nil, fmt.Errorf("-%s %s: less than one session's chunks (%d MiB at queue depth %d and %s chunks): no client could connect", b.flag, b.v, one>>20, c.QueueDepth, c.ChunkSize)
		}
		*b.to = int64(n)
	}
	for name, v := range map[string]int{"max-sessions": c.MaxSessions, "max-conns-per-path": c.MaxConnsPerPath,
		"max-connecting": c.MaxConnecting, "max-connecting-per-addr": c.MaxConnectingPerAddr,
		"max-pending": c.MaxPending, "max-pending-per-addr": c.MaxPendingPerAddr,
		"max-new-sessions-per-addr": c.MaxNewSessionsPerAddr, "max-conns": c.MaxConns,
		"max-sessions-per-client": c.MaxSessionsPerClient} {
		if v < 1 {
			return nil, fmt.Errorf("-%s %d: must be at least 1", name, v)
		}
	}
	if c.EstablishTimeout <= 0 || c.HandshakeTimeout <= 0 {
		return nil, errors.New("-establish-timeout and -handshake-timeout must be positive")
	}
	if err := daemon.CheckInterval("heartbeat-interval", c.HeartbeatInterval, time.Millisecond, true); err != nil {
		return nil, err
	}
	if r.allow, err = transport.ParseAllow(c.Allow); err != nil {
		return nil, fmt.Errorf("-allow: %w", err)
	}
	if r.acl, err = loadACL(c.ACL); err != nil {
		return nil, fmt.Errorf("-acl: %w", err)
	}
	if c.NamesFile != "" {
		if err := os.MkdirAll(filepath.Dir(c.NamesFile), 0o700); err != nil {
			return nil, fmt.Errorf("-names-file: %w", err)
		}
	}
	for _, sub := range strings.Split(c.AllowSubject, ";") {
		if sub = strings.TrimSpace(sub); sub != "" {
			r.subjects = append(r.subjects, sub)
		}
	}
	if len(r.subjects) > 0 && c.TLS.Cert == "" {
		return nil, errors.New("-allow-subject needs -tls-cert, -tls-key and -tls-ca")
	}
	return r, nil
}

// softOptions are the soft provider's bounds.
func (c *config) softOptions() soft.Options {
	return soft.Options{MaxPending: c.MaxPending, MaxPendingPerAddr: c.MaxPendingPerAddr, HandshakeTimeout: c.HandshakeTimeout}
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
