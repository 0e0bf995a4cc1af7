package rnbd

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"github.com/rtrs-go/rtrs/internal/lib/names"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Export is one device open in at least one session: a directory of the rnbd-server tree
// (/sys/class/rnbd-server/ctl/devices/<Name>).
type Export struct {
	// Name is the directory's name: for a block device the kernel's name of it ("sdb",
	// "nullb0", "dm-3"), as the kernel names it; for a file, which the kernel cannot export,
	// its path on the server without the leading '/' and with every '/' shown as '!' (the
	// kernel's rule for a '/' in a sysfs name), e.g. "srv!rtrs!vol1". Unique among the open
	// devices: a second device that would get the same name gets "~2", "~3", … appended.
	Name string
	// BlockDev is where block_dev points. The rnbd tool names a device after the last
	// component of block_dev's resolved path and closes it through the directory of that
	// name, so that must be Name: for a block device its sysfs directory (the kernel's link
	// goes to the whole disk, which is the same but for a partition), for a file export ".",
	// the device's own directory (the kernel has no file exports).
	BlockDev string
	// Sessions are the sessions that have it open, by session name.
	Sessions []ExportSession
}

// ExportSession is one session's open of an export (rnbd_srv_sess_dev).
type ExportSession struct {
	Session     string
	ID          uint32
	MappingPath string // the device path as the client sent it in its OPEN
	AccessMode  AccessMode

	ts *transport.SrvSess
}

// ReadOnly is what read_only shows: only an ro mapping is read-only (migration writes).
func (e ExportSession) ReadOnly() bool { return e.AccessMode == AccessRO }

// Exports lists the open devices with the sessions that have them open, sorted by name and
// session name.
func (s *Server) Exports() []Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	byKey := map[devKey]*Export{}
	for ts, ss := range s.sessions {
		for _, d := range ss.devs {
			e := byKey[d.key]
			if e == nil {
				sd := s.devs[d.key]
				if sd == nil {
					continue
				}
				e = &Export{Name: sd.dir, BlockDev: sd.link}
				byKey[d.key] = e
			}
			e.Sessions = append(e.Sessions, ExportSession{Session: ss.name, ID: d.id, MappingPath: d.name, AccessMode: d.mode, ts: ts})
		}
	}
	out := make([]Export, 0, len(byKey))
	for _, e := range byKey {
		sort.Slice(e.Sessions, func(i, j int) bool {
			if e.Sessions[i].Session != e.Sessions[j].Session {
				return e.Sessions[i].Session < e.Sessions[j].Session
			}
			return e.Sessions[i].ID < e.Sessions[j].ID
		})
		out = append(out, *e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// IsOpen says whether e is still open: its session has not closed the device, has not lost
// it to force_close and is not gone. Another open of the same device by the same session
// gets another id, so it is not e.
func (s *Server) IsOpen(e ExportSession) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := s.sessions[e.ts]
	return ss != nil && ss.devs[e.ID] != nil
}

// ForceClose closes one session's use of an export, as the kernel's force_close does: the
// device is closed for that session (IO in progress finishes first; its access mode no
// longer counts against other openers) and leaves the tree, while the session and its other
// devices go on. The client still holds the id: IO to it is answered ENOTCONN, as the
// kernel answers it, until the client sends CLOSE for it, which is answered 0. ENODEV when
// the session no longer has that device open.
func (s *Server) ForceClose(e ExportSession) error {
	s.mu.Lock()
	ss := s.sessions[e.ts]
	var d *sessDev
	if ss != nil {
		d = ss.devs[e.ID]
	}
	if d == nil {
		s.mu.Unlock()
		return fmt.Errorf("rnbd: session %q has no device %d (%q) open: %w", e.Session, e.ID, e.MappingPath, syscall.ENODEV)
	}
	delete(ss.devs, e.ID)
	if ss.forced == nil {
		ss.forced = map[uint32]*sessDev{}
	}
	ss.forced[e.ID] = d
	s.publishLocked()
	s.mu.Unlock()
	d.mu.Lock() // waits for the IO running on it
	d.forced = true
	d.mu.Unlock()
	// Its access mode stops counting only once its IO has ended: another session's rw open
	// must not write beside this one's last writes.
	s.release(d, d.close())
	s.log.WithField("session", ss.name).Infof("force_close: closed %q (%v, device %d); IO to it is refused until the client unmaps it", d.name, d.mode, d.id)
	return nil
}

// forcedDev is the force-closed device id of the session, or nil.
func (ss *srvSess) forcedDev(id uint32) *sessDev {
	if ss == nil {
		return nil
	}
	return ss.forced[id]
}

// uniqueDirLocked returns name, or name~N when an open device has that name already.
func (s *Server) uniqueDirLocked(name string) string {
	taken := func(n string) bool {
		for _, sd := range s.devs {
			if sd.dir == n {
				return true
			}
		}
		return false
	}
	if !taken(name) {
		return name
	}
	for i := 2; ; i++ {
		if n := name + "~" + strconv.Itoa(i); !taken(n) {
			return n
		}
	}
}

// sysDevBlock is where the kernel lists block devices by number (a variable for tests).
var sysDevBlock = "/sys/dev/block"

// exportName is an opened export's directory name in the rnbd-server tree and the target of
// its block_dev link (see Export).
func exportName(b *backing) (dir, link string) {
	if b.bdev {
		sys := filepath.Join(sysDevBlock, fmt.Sprintf("%d:%d", unix.Major(b.rdev), unix.Minor(b.rdev)))
		if p, err := filepath.EvalSymlinks(sys); err == nil && names.Component(filepath.Base(p)) == nil {
			return filepath.Base(p), p
		}
	}
	// The file's real path: two names of one file (a symlink inside the export directory)
	// are one device and show under one name.
	p, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", b.fd))
	if err != nil || !strings.HasPrefix(p, "/") {
		p = b.f.Name()
	}
	dir = strings.ReplaceAll(strings.TrimLeft(p, "/"), "/", "!")
	if names.Component(dir) != nil {
		dir = fmt.Sprintf("dev%d-ino%d", b.dev, b.ino)
	}
	return dir, "."
}
