package fsview

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Usage texts of the client's action files, as the kernel prints them.
const (
	addPathUsage = "Usage: echo [<source addr>@]<destination addr> > add_path\n\n*addr ::= [ ip:<ipv4|ipv6> | gid:<gid> ]\n"
	resetAllShow = "echo 1 to reset all statistics\n"
	openUsage    = "Usage: echo \"sessname=<name> path=<[src@]dst> [path=<[src@]dst>...] [dest_port=<port>] [mpath_policy=<policy>] [max_reconnect_attempts=<-1..9999>]\" > open_session\n"
	closeUsage   = "Usage: echo <sessname> > close_session\n"
)

// ClientTree is the rtrs-client tree (/sys/class/rtrs-client) over the sessions of a block
// client, plus ctl/ to open and close sessions without a device.
type ClientTree struct {
	C *rnbd.Client
	// Timeout bounds the blocking control writes (add_path, reconnect, open_session).
	Timeout time.Duration
	// OnChange is called after a control write changed the declared sessions (to write the
	// config back); it may be nil.
	OnChange func()
}

func usage(s string) func() string { return func() string { return s } }

func (t *ClientTree) ctx() (context.Context, context.CancelFunc) {
	d := t.Timeout
	if d <= 0 {
		d = 2 * time.Minute
	}
	return context.WithTimeout(context.Background(), d)
}

func (t *ClientTree) changed() {
	if t.OnChange != nil {
		t.OnChange()
	}
}

// Entries lists ctl/ and a directory per session.
func (t *ClientTree) Entries() []Entry {
	out := []Entry{{Name: "ctl", Dir: DirFunc(t.ctlEntries)}}
	for _, name := range t.C.SessionNames() {
		if s := t.C.Session(name); s != nil && ValidName(name) && name != "ctl" {
			out = append(out, Entry{Name: name, Dir: DirFunc(func() []Entry { return t.sessEntries(s) })})
		}
	}
	return out
}

func (t *ClientTree) ctlEntries() []Entry {
	return []Entry{
		{Name: "close_session", Attr: &Attr{Mode: 0o644, Show: usage(closeUsage), Store: func(v string) error {
			if err := t.C.CloseSession(v); err != nil {
				return err
			}
			t.changed()
			return nil
		}}},
		{Name: "open_session", Attr: &Attr{Mode: 0o644, Show: usage(openUsage), Store: func(v string) error {
			o, pol, mra, err := ParseOpenSession(v)
			if err != nil {
				return err
			}
			ctx, cancel := t.ctx()
			defer cancel()
			if err := t.C.OpenSession(ctx, o, func(co *transport.ClientOptions) {
				if pol != nil {
					co.Policy = *pol
				}
				if mra != nil {
					co.MaxReconnectAttempts = *mra
				}
			}); err != nil {
				return err
			}
			t.changed()
			return nil
		}}},
	}
}

func (t *ClientTree) sessEntries(s *transport.Session) []Entry {
	policy := &Attr{Mode: 0o644, Show: func() string { return policyShow(s.Policy()) }, Store: func(v string) error {
		p, err := ParsePolicy(v)
		if err != nil {
			return err
		}
		if err := s.SetPolicy(p); err != nil {
			return err
		}
		t.changed() // the config's open_session line carries it
		return nil
	}}
	return []Entry{
		{Name: "add_path", Attr: &Attr{Mode: 0o644, Show: usage(addPathUsage), Store: func(v string) error {
			if i := strings.IndexByte(v, '\n'); i >= 0 {
				v = v[:i]
			}
			src, dst, err := transport.ParsePathAddrs(v)
			if err != nil {
				return fmt.Errorf("%v: %w", err, syscall.EINVAL) // every parse error is EINVAL
			}
			name := transport.PathName(src, dst)
			for _, p := range s.Paths() {
				if p.Listed() && p.Name() == name {
					return fmt.Errorf("path %s exists: %w", name, syscall.EEXIST)
				}
			}
			ctx, cancel := t.ctx()
			defer cancel()
			if _, err := s.AddPath(ctx, transport.PathAddrs{Src: src, Dst: dst}); err != nil {
				return err
			}
			t.changed()
			return nil
		}}},
		{Name: "max_reconnect_attempts", Attr: &Attr{Mode: 0o644,
			Show: func() string { return fmt.Sprintf("%d\n", s.MaxReconnectAttempts()) },
			Store: func(v string) error {
				n, err := parseKInt(v)
				if err != nil {
					return err
				}
				if n < -1 || n > 9999 {
					return fmt.Errorf("max_reconnect_attempts %d not in -1..9999: %w", n, syscall.EINVAL)
				}
				if err := s.SetMaxReconnectAttempts(n); err != nil {
					return err
				}
				t.changed()
				return nil
			}}},
		{Name: "mp_policy", Attr: policy},
		{Name: "mpath_policy", Attr: policy},
		{Name: "paths", Dir: DirFunc(func() []Entry { return t.pathsEntries(s) })},
	}
}

func (t *ClientTree) pathsEntries(s *transport.Session) []Entry {
	var out []Entry
	for _, p := range s.Paths() {
		if !p.Listed() || !ValidName(p.Name()) {
			continue
		}
		out = append(out, Entry{Name: p.Name(), Dir: DirFunc(func() []Entry { return t.pathEntries(p) })})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// only1 accepts exactly "1" (sysfs_streq(x, "1")).
func only1(v string) error {
	if v != "1" {
		return fmt.Errorf("%q: %w", v, syscall.EINVAL)
	}
	return nil
}

func (t *ClientTree) pathEntries(p *transport.Path) []Entry {
	ro := func(f func() string) *Attr { return &Attr{Mode: 0o444, Show: f} }
	return []Entry{
		{Name: "cur_latency", Attr: ro(func() string { return fmt.Sprintf("%d ns\n", p.CurLatency().Nanoseconds()) })},
		{Name: "disconnect", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > disconnect\n"), Store: func(v string) error {
			if err := only1(v); err != nil {
				return err
			}
			p.Disconnect()
			return nil
		}}},
		{Name: "dst_addr", Attr: ro(func() string { return p.DstAddr().String() + "\n" })},
		{Name: "hca_name", Attr: ro(func() string { n, _ := p.HCA(); return n + "\n" })},
		{Name: "hca_port", Attr: ro(func() string { _, port := p.HCA(); return fmt.Sprintf("%d\n", port) })},
		{Name: "reconnect", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > reconnect\n"), Store: func(v string) error {
			if err := only1(v); err != nil {
				return err
			}
			ctx, cancel := t.ctx()
			defer cancel()
			return p.Reconnect(ctx)
		}}},
		{Name: "remove_path", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > remove_path\n"), Store: func(v string) error {
			if err := only1(v); err != nil {
				return err
			}
			p.Remove()
			t.changed()
			return nil
		}}},
		{Name: "src_addr", Attr: ro(func() string { return p.SrcAddr().String() + "\n" })},
		{Name: "state", Attr: ro(func() string {
			if p.State() == transport.StateConnected {
				return "connected\n"
			}
			return "disconnected\n"
		})},
		{Name: "stats", Dir: DirFunc(func() []Entry { return clientStats(p.Stats) })},
	}
}

// resetStore is a stats file's store: 1 resets; anything else, 0 included, is EINVAL, as the
// kernel's STAT_STORE_FUNC answers (it hands 0 to the reset helpers, which refuse it).
func resetStore(reset func()) func(string) error {
	return func(v string) error {
		if v != "1" {
			return fmt.Errorf("%q: write 1 to reset: %w", v, syscall.EINVAL)
		}
		reset()
		return nil
	}
}

func clientStats(st *stats.ClientPath) []Entry {
	a := func(show func() string, reset func()) *Attr {
		return &Attr{Mode: 0o644, Show: show, Store: resetStore(reset)}
	}
	return []Entry{
		{Name: "cpu_migration", Attr: a(st.CPUMigration, st.ResetCPUMigration)},
		{Name: "cpu_migration_from", Attr: a(st.CPUMigrationFrom, st.ResetCPUMigration)},
		{Name: "cpu_migration_to", Attr: a(st.CPUMigrationTo, st.ResetCPUMigration)},
		{Name: "rdma", Attr: a(st.RDMA, st.ResetRDMA)},
		{Name: "rdma_lat", Attr: a(st.RDMALat, st.ResetRDMALat)},
		{Name: "reconnects", Attr: a(st.Reconnects, st.ResetReconnects)},
		{Name: "reset_all", Attr: a(usage(resetAllShow), st.ResetAll)},
		{Name: "sg_entries", Attr: a(st.SGEntriesTable, st.ResetSGEntries)},
		{Name: "wc_completion", Attr: a(st.WCCompletion, st.ResetWCCompletion)},
	}
}

func policyShow(p transport.Policy) string {
	switch p {
	case transport.RoundRobin:
		return "round-robin (RR: 0)\n"
	case transport.MinInflight:
		return "min-inflight (MI: 1)\n"
	case transport.MinLatency:
		return "min-latency (ML: 2)\n"
	}
	return fmt.Sprintf("Unknown (%d)\n", int(p))
}

// ParsePolicy reads mpath_policy as the kernel does: 0, 1 or 2; or, in any case, a value
// that begins with round-robin, min-inflight or min-latency, or is rr, mi or ml.
func ParsePolicy(v string) (transport.Policy, error) {
	if n, err := parseKInt(v); err == nil {
		if n >= 0 && n <= 2 {
			return transport.Policy(n), nil
		}
		return 0, fmt.Errorf("policy %d: %w", n, syscall.EINVAL)
	}
	l := strings.ToLower(v)
	switch {
	case strings.HasPrefix(l, "round-robin"), l == "rr":
		return transport.RoundRobin, nil
	case strings.HasPrefix(l, "min-inflight"), l == "mi":
		return transport.MinInflight, nil
	case strings.HasPrefix(l, "min-latency"), l == "ml":
		return transport.MinLatency, nil
	}
	return 0, fmt.Errorf("policy %q: %w", v, syscall.EINVAL)
}

// parseKInt is kstrtoint base 10: an optional sign, digits, nothing else; ERANGE when it
// does not fit.
func parseKInt(v string) (int, error) {
	n, err := strconv.ParseInt(v, 10, 32)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return 0, fmt.Errorf("%q: %w", v, syscall.ERANGE)
		}
		return 0, fmt.Errorf("%q: %w", v, syscall.EINVAL)
	}
	return int(n), nil
}

// ParseOpenSession reads open_session's tokens: sessname= (required), path= (1..), dest_port=
// (applies to the path= tokens after it, as in map_device; all paths of a session share one
// port), mpath_policy= (or mp_policy=), max_reconnect_attempts= (-1..9999).
func ParseOpenSession(v string) (rnbd.MapOptions, *transport.Policy, *int, error) {
	var o rnbd.MapOptions
	var pol *transport.Policy
	var mra *int
	port, portSet := uint16(transport.DefaultPort), false
	for _, tok := range strings.Fields(v) {
		k, val, ok := strings.Cut(tok, "=")
		if !ok {
			return o, nil, nil, fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
		switch k {
		case "sessname":
			o.SessName = val
		case "path":
			pa, err := parsePathToken(val, port, &o, &portSet)
			if err != nil {
				return o, nil, nil, err
			}
			o.Paths = append(o.Paths, pa)
		case "dest_port":
			n, err := strconv.ParseUint(val, 10, 16)
			if err != nil {
				return o, nil, nil, fmt.Errorf("dest_port %q: %w", val, syscall.EINVAL)
			}
			port = uint16(n)
		case "mpath_policy", "mp_policy":
			p, err := ParsePolicy(val)
			if err != nil {
				return o, nil, nil, err
			}
			pol = &p
		case "max_reconnect_attempts":
			n, err := parseKInt(val)
			if err != nil || n < -1 || n > 9999 {
				return o, nil, nil, fmt.Errorf("max_reconnect_attempts %q: %w", val, syscall.EINVAL)
			}
			mra = &n
		default:
			return o, nil, nil, fmt.Errorf("unknown token %q: %w", tok, syscall.EINVAL)
		}
	}
	if o.SessName == "" || !ValidName(o.SessName) || strings.ContainsAny(o.SessName, ".") || o.SessName == "ctl" {
		return o, nil, nil, fmt.Errorf("sessname %q: %w", o.SessName, syscall.EINVAL)
	}
	if len(o.Paths) == 0 {
		return o, nil, nil, fmt.Errorf("no path=: %w", syscall.EINVAL)
	}
	if !portSet {
		o.Port = port
	}
	return o, pol, mra, nil
}

// parsePathToken parses a path= value with the port in force; paths of one session must
// share their port.
func parsePathToken(val string, port uint16, o *rnbd.MapOptions, portSet *bool) (transport.PathAddrs, error) {
	if len(o.Paths) >= transport.MaxPathsNum {
		return transport.PathAddrs{}, fmt.Errorf("too many paths: %w", syscall.ENOMEM)
	}
	src, dst, err := transport.ParsePathAddrs(val)
	if err != nil {
		return transport.PathAddrs{}, fmt.Errorf("path %q: %w", val, syscall.EINVAL)
	}
	if *portSet && o.Port != port {
		return transport.PathAddrs{}, fmt.Errorf("paths on ports %d and %d: one session has one port: %w", o.Port, port, syscall.EINVAL)
	}
	o.Port, *portSet = port, true
	return transport.PathAddrs{Src: src, Dst: dst}, nil
}
