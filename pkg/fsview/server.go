package fsview

import (
	"fmt"
	"slices"

	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// ServerTree is the rtrs-server tree (/sys/class/rtrs-server): a directory per named session,
// and in it a directory per path from its INFO_REQ until its close has finished, as the
// kernel's sysfs does (a closing path is listed without its disconnect file).
type ServerTree struct {
	Server *transport.Server
}

// Entries lists the sessions that have a name (a path finished INFO_REQ).
func (t *ServerTree) Entries() []Entry {
	var out []Entry
	seen := map[string]bool{}
	for _, ss := range t.Server.Sessions() {
		name := ss.Name()
		if !validEntry(name) || seen[name] {
			continue
		}
		seen[name] = true
		alive := func() bool { return slices.Contains(t.Server.Sessions(), ss) }
		out = append(out, Entry{Name: name, Obj: ss, Dir: guarded("session "+name, alive, DirFunc(func() []Entry {
			return []Entry{{Name: "paths", Dir: DirFunc(func() []Entry { return t.paths(ss) })}}
		}))})
	}
	return out
}

func (t *ServerTree) paths(ss *transport.SrvSess) []Entry {
	var out []Entry
	for _, p := range ss.ListedPaths() {
		if validEntry(p.Name()) {
			alive := func() bool { return slices.Contains(ss.ListedPaths(), p) }
			out = append(out, Entry{Name: p.Name(), Obj: p, Dir: guarded("path "+p.Name(), alive, DirFunc(func() []Entry { return serverPath(p) }))})
		}
	}
	return out
}

func serverPath(p *transport.SrvPath) []Entry {
	ro := func(f func() string) *Attr { return &Attr{Mode: 0o444, Show: f} }
	out := []Entry{
		{Name: "dst_addr", Attr: ro(func() string { return p.DstAddr().String() + "\n" })},
		{Name: "hca_name", Attr: ro(func() string { n, _ := p.HCA(); return n + "\n" })},
		{Name: "hca_port", Attr: ro(func() string { _, port := p.HCA(); return fmt.Sprintf("%d\n", port) })},
		{Name: "src_addr", Attr: ro(func() string { return p.SrcAddr().String() + "\n" })},
		{Name: "stats", Dir: DirFunc(func() []Entry {
			st := &p.Stats
			return []Entry{
				{Name: "rdma", Attr: &Attr{Mode: 0o644, Show: st.RDMA, Store: resetStore(st.ResetRDMA)}},
				{Name: "reset_all", Attr: &Attr{Mode: 0o644, Show: usage(resetAllShow), Store: resetStore(st.ResetAll)}},
				{Name: "wc_completion", Attr: &Attr{Mode: 0o644, Show: st.WCCompletion, Store: resetStore(st.ResetWCCompletion)}},
			}
		})},
	}
	// The kernel removes disconnect with the write that starts the (asynchronous) close.
	if p.State() == "connected" {
		out = append([]Entry{{Name: "disconnect", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo 1 > disconnect\n"),
			Store: func(v string) error {
				if err := control.ParseOne(v); err != nil {
					return err
				}
				p.Disconnect()
				return nil
			}}}}, out...)
	}
	return out
}
