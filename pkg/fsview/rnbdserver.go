package fsview

import (
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

// forceCloseUsage is what force_close shows, as the kernel prints it.
const forceCloseUsage = "Usage: echo 1 > force_close\n"

// RNBDServerTree is the rnbd-server tree (/sys/class/rnbd-server): ctl/devices/<device>/ per
// device open in at least one session, with block_dev (a link to what backs it) and
// sessions/<session>/{access_mode, force_close, mapping_path, read_only} per session that
// has it open. A device leaves with its last session, a session's directory with its close
// (unmap, force_close, or the session gone).
type RNBDServerTree struct {
	Server *rnbd.Server
}

// Entries lists ctl/.
func (t *RNBDServerTree) Entries() []Entry {
	return []Entry{{Name: "ctl", Dir: DirFunc(func() []Entry {
		return []Entry{{Name: "devices", Dir: DirFunc(t.devices)}}
	})}}
}

func (t *RNBDServerTree) devices() []Entry {
	var out []Entry
	for _, ex := range t.Server.Exports() {
		if !validEntry(ex.Name) {
			continue
		}
		out = append(out, Entry{Name: ex.Name, Dir: DirFunc(func() []Entry { return t.device(ex.Name) })})
	}
	return out
}

// device lists a device's directory as it is now (its sessions change while it is open).
func (t *RNBDServerTree) device(name string) []Entry {
	for _, ex := range t.Server.Exports() {
		if ex.Name != name {
			continue
		}
		var out []Entry
		if ex.BlockDev != "" {
			out = append(out, Entry{Name: "block_dev", Link: ex.BlockDev})
		}
		return append(out, Entry{Name: "sessions", Dir: DirFunc(func() []Entry { return t.sessions(name) })})
	}
	return nil
}

func (t *RNBDServerTree) sessions(name string) []Entry {
	var out []Entry
	seen := map[string]bool{}
	for _, ex := range t.Server.Exports() {
		if ex.Name != name {
			continue
		}
		for _, es := range ex.Sessions {
			if !validEntry(es.Session) || seen[es.Session] {
				continue
			}
			seen[es.Session] = true
			// Its own inode and a guard: a shell left in the directory of an open that has
			// ended sees nothing, not the next open under the session's name.
			alive := func() bool { return t.Server.IsOpen(es) }
			out = append(out, Entry{Name: es.Session, Obj: es, Dir: guarded("session "+es.Session+"'s open of "+name, alive, DirFunc(func() []Entry { return t.session(es) }))})
		}
	}
	return out
}

func (t *RNBDServerTree) session(es rnbd.ExportSession) []Entry {
	ro := func(s string) *Attr { return &Attr{Mode: 0o444, Show: usage(s)} }
	readOnly := "0\n"
	if es.ReadOnly() {
		readOnly = "1\n"
	}
	return []Entry{
		{Name: "access_mode", Attr: ro(es.AccessMode.String() + "\n")},
		{Name: "force_close", Attr: &Attr{Mode: 0o644, Show: usage(forceCloseUsage), Store: func(v string) error {
			if err := control.ParseOne(v); err != nil {
				return err
			}
			return t.Server.ForceClose(es)
		}}},
		{Name: "mapping_path", Attr: ro(es.MappingPath + "\n")},
		{Name: "read_only", Attr: ro(readOnly)},
	}
}
