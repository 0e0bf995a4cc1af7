package fsview

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/rtrs-go/rtrs/pkg/control"
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
// client, plus ctl/ to open and close sessions without a device. Its stores parse with the
// control package's grammar and call its Client.
type ClientTree struct {
	Ctl *control.Client
	// Timeout bounds the blocking control writes (add_path, reconnect, open_session).
	Timeout time.Duration
}

func usage(s string) func() string { return func() string { return s } }

// writeCtx bounds a blocking control write: d, or 2 minutes when d is not set.
func writeCtx(d time.Duration) (context.Context, context.CancelFunc) {
	if d <= 0 {
		d = 2 * time.Minute
	}
	return context.WithTimeout(context.Background(), d)
}

// Entries lists ctl/ and a directory per session.
func (t *ClientTree) Entries() []Entry {
	out := []Entry{{Name: "ctl", Dir: DirFunc(t.ctlEntries)}}
	for _, name := range t.Ctl.RNBD.SessionNames() {
		if s := t.Ctl.RNBD.Session(name); s != nil && validEntry(name) && name != "ctl" {
			alive := func() bool { return t.Ctl.RNBD.Session(name) == s }
			out = append(out, Entry{Name: name, Obj: s, Dir: guarded("session "+name, alive, DirFunc(func() []Entry { return t.sessEntries(s) }))})
		}
	}
	return out
}

func (t *ClientTree) ctlEntries() []Entry {
	return []Entry{
		{Name: "close_session", Attr: &Attr{Mode: 0o644, Show: usage(closeUsage), Store: t.Ctl.CloseSession}},
		{Name: "open_session", Attr: &Attr{Mode: 0o644, Show: usage(openUsage), Store: func(v string) error {
			o, err := control.ParseOpenSession(v)
			if err != nil {
				return err
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return t.Ctl.OpenSession(ctx, o)
		}}},
	}
}

func (t *ClientTree) sessEntries(s *transport.Session) []Entry {
	policy := &Attr{Mode: 0o644, Show: func() string { return policyShow(s.Policy()) }, Store: func(v string) error {
		p, err := control.ParsePolicy(v)
		if err != nil {
			return err
		}
		return t.Ctl.SetPolicy(s, p)
	}}
	return []Entry{
		{Name: "add_path", Attr: &Attr{Mode: 0o644, Show: usage(addPathUsage), Store: func(v string) error {
			pa, err := control.ParseAddPath(v)
			if err != nil {
				return err
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return t.Ctl.AddPath(ctx, s, pa)
		}}},
		{Name: "max_reconnect_attempts", Attr: &Attr{Mode: 0o644,
			Show: func() string { return fmt.Sprintf("%d\n", s.MaxReconnectAttempts()) },
			Store: func(v string) error {
				n, err := control.ParseMaxReconnectAttempts(v)
				if err != nil {
					return err
				}
				return t.Ctl.SetMaxReconnectAttempts(s, n)
			}}},
		{Name: "mp_policy", Attr: policy},
		{Name: "mpath_policy", Attr: policy},
		{Name: "paths", Dir: DirFunc(func() []Entry { return t.pathsEntries(s) })},
	}
}

func (t *ClientTree) pathsEntries(s *transport.Session) []Entry {
	var out []Entry
	for _, p := range s.Paths() {
		if !p.Listed() || !validEntry(p.Name()) {
			continue
		}
		alive := func() bool { return slices.Contains(s.Paths(), p) }
		out = append(out, Entry{Name: p.Name(), Obj: p, Dir: guarded("path "+p.Name(), alive, DirFunc(func() []Entry { return t.pathEntries(p) }))})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func (t *ClientTree) pathEntries(p *transport.Path) []Entry {
	ro := func(f func() string) *Attr { return &Attr{Mode: 0o444, Show: f} }
	return []Entry{
		{Name: "cur_latency", Attr: ro(func() string { return fmt.Sprintf("%d ns\n", p.CurLatency().Nanoseconds()) })},
		{Name: "disconnect", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > disconnect\n"), Store: func(v string) error {
			if err := control.ParseOne(v); err != nil {
				return err
			}
			p.Disconnect()
			return nil
		}}},
		{Name: "dst_addr", Attr: ro(func() string { return p.DstAddr().String() + "\n" })},
		{Name: "hca_name", Attr: ro(func() string { n, _ := p.HCA(); return n + "\n" })},
		{Name: "hca_port", Attr: ro(func() string { _, port := p.HCA(); return fmt.Sprintf("%d\n", port) })},
		{Name: "reconnect", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > reconnect\n"), Store: func(v string) error {
			if err := control.ParseOne(v); err != nil {
				return err
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return p.Reconnect(ctx)
		}}},
		{Name: "remove_path", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > remove_path\n"), Store: func(v string) error {
			if err := control.ParseOne(v); err != nil {
				return err
			}
			t.Ctl.RemovePath(p)
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
		if err := control.ParseOne(v); err != nil {
			return err
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
