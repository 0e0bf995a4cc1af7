package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// exportsString renders Exports as "<name>[<session>:<mapping path>:<mode>:<ro> ...]" lines.
func exportsString(ex []Export) string {
	var b strings.Builder
	for _, e := range ex {
		b.WriteString(e.Name + "[")
		for i, s := range e.Sessions {
			if i > 0 {
				b.WriteByte(' ')
			}
			ro := "0"
			if s.ReadOnly() {
				ro = "1"
			}
			b.WriteString(s.Session + ":" + s.MappingPath + ":" + s.AccessMode.String() + ":" + ro)
		}
		b.WriteString("]\n")
	}
	return b.String()
}

func findExport(t *testing.T, s *Server, name, sess string) ExportSession {
	t.Helper()
	for _, e := range s.Exports() {
		for _, es := range e.Sessions {
			if e.Name == name && es.Session == sess {
				return es
			}
		}
	}
	t.Fatalf("no export %s open in %s: %s", name, sess, exportsString(s.Exports()))
	return ExportSession{}
}

// TestExportsAndForceClose: the rnbd-server tree's model lists each open device once with
// the sessions that have it open; ForceClose ends one session's use of one device (its IO
// fails with EIO at once, the client says closed-by-server and does not remap it), leaves
// the rest alone, releases the access mode, and the client's unmap of it is clean.
func TestExportsAndForceClose(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	model := e.file(t, "disk", 4<<20)
	e.file(t, "other", 1<<20)
	if err := os.Mkdir(filepath.Join(e.dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.file(t, "sub/vol", 1<<20)
	if err := os.Symlink("disk", filepath.Join(e.dir, "alias")); err != nil {
		t.Fatal(err)
	}
	c := e.client(t, 5*time.Second)
	da := mustMap(t, e, c, "a", "disk", AccessRW)
	oa := mustMap(t, e, c, "a", "other", AccessRO)
	db := mustMap(t, e, c, "b", "alias", AccessRO) // the same device under another name
	vb := mustMap(t, e, c, "b", "/sub/vol", AccessRW)

	real, err := filepath.EvalSymlinks(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	pfx := strings.ReplaceAll(strings.TrimLeft(real, "/"), "/", "!") + "!"
	want := pfx + "disk[a:disk:rw:0 b:alias:ro:1]\n" + pfx + "other[a:other:ro:1]\n" + pfx + "sub!vol[b:/sub/vol:rw:0]\n"
	rs := e.server()
	if got := exportsString(rs.Exports()); got != want {
		t.Fatalf("exports\n%s\nwant\n%s", got, want)
	}
	for _, ex := range rs.Exports() {
		if ex.BlockDev != "." {
			t.Errorf("block_dev of disk: %q", ex.BlockDev)
		}
	}

	buf := make([]byte, 64<<10)
	if _, err := da.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, model[:len(buf)]) {
		t.Fatalf("read before force_close: %v", err)
	}
	es := findExport(t, rs, pfx+"disk", "a")
	if err := rs.ForceClose(es); err != nil {
		t.Fatal(err)
	}
	// Session a's IO to disk fails at once with EIO, synchronous and asynchronous, every
	// time, and the device says why.
	start := time.Now()
	for i := 0; i < 3; i++ {
		if _, err := da.WriteAt(buf, 0); !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "closed by the server") {
			t.Fatalf("write after force_close: %v", err)
		}
	}
	done := make(chan error, 1)
	da.ReadAsync(context.Background(), buf, 4096, func(err error) { done <- err })
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("async read after force_close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("async read after force_close hangs")
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("the errors took %v", time.Since(start))
	}
	if st := da.State(); st != StateClosedByServer || st.String() != "closed-by-server" {
		t.Fatalf("state %v", st)
	}
	// The backing file saw no write.
	if got, _ := os.ReadFile(filepath.Join(e.dir, "disk")); !bytes.Equal(got, model) {
		t.Fatal("a write reached the file after force_close")
	}
	// Everything else goes on: the same session's other device, the other session's open
	// of the same device.
	if _, err := oa.ReadAt(buf, 0); err != nil {
		t.Fatalf("other device of the session: %v", err)
	}
	if _, err := db.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, model[:len(buf)]) {
		t.Fatalf("the device in the other session: %v", err)
	}
	if _, err := vb.WriteAt(buf, 0); err != nil {
		t.Fatalf("the other session's device: %v", err)
	}
	want = pfx + "disk[b:alias:ro:1]\n" + pfx + "other[a:other:ro:1]\n" + pfx + "sub!vol[b:/sub/vol:rw:0]\n"
	if got := exportsString(rs.Exports()); got != want {
		t.Fatalf("exports after force_close\n%s\nwant\n%s", got, want)
	}
	// Its rw no longer counts: another session may open disk rw.
	dc := mustMap(t, e, c, "c", "disk", AccessRW)
	if _, err := dc.WriteAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	// A second force_close of the same open: ENODEV.
	if err := rs.ForceClose(es); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("second force_close: %v", err)
	}
	// A path reconnect does not remap the closed device.
	sess := c.Session("a")
	p := sess.Paths()[0]
	p.Disconnect()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Reconnect(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := oa.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if st := da.State(); st != StateClosedByServer {
		t.Fatalf("state after a reconnect %v", st)
	}
	// Unmapping it is clean: the server answers the CLOSE of the id it kept, then forgets it.
	if err := da.Unmap(ctx); err != nil {
		t.Fatalf("unmap after force_close: %v", err)
	}
	rs.mu.Lock()
	n := 0
	for _, ss := range rs.sessions {
		n += len(ss.forced)
	}
	rs.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d force-closed ids kept after the unmap", n)
	}
	// And it maps again.
	da = mustMap(t, e, c, "a", "disk", AccessRO)
	if _, err := da.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
}

// TestForceClosedIDRaw: IO to a force-closed id is answered ENOTCONN (as the kernel answers
// it), not ENODEV (which would make a client remap and so undo the close).
func TestForceClosedIDRaw(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 5*time.Second)
	d := mustMap(t, e, c, "r", "disk", AccessRW)
	id := d.ID()
	real, _ := filepath.EvalSymlinks(e.dir)
	rs := e.server()
	if err := rs.ForceClose(findExport(t, rs, strings.ReplaceAll(strings.TrimLeft(real, "/"), "/", "!")+"!disk", "r")); err != nil {
		t.Fatal(err)
	}
	var usr [IOSize]byte
	MsgIO{DeviceID: id, RW: uint32(OpRead), BiSize: 512}.Put(usr[:])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := c.Session("r").Do(ctx, 0, usr[:], make([]byte, 512))
	if err != syscall.ENOTCONN {
		t.Fatalf("IO to a force-closed id: %v, want ENOTCONN", err)
	}
	MsgIO{DeviceID: id + 1000, RW: uint32(OpRead), BiSize: 512}.Put(usr[:])
	if err := c.Session("r").Do(ctx, 0, usr[:], make([]byte, 512)); err != syscall.ENODEV {
		t.Fatalf("IO to an unknown id: %v, want ENODEV", err)
	}
	// CLOSE of an id the session does not have open is answered 0, as the kernel does: an
	// unmap after the server lost the session must not fail.
	var cl [CloseSize]byte
	MsgClose{DeviceID: id + 1000}.Put(cl[:])
	if err := c.Session("r").DoAdmin(ctx, transport.Write, cl[:], nil); err != nil {
		t.Fatalf("CLOSE of an unknown id: %v, want success", err)
	}
}

// TestExportNameBlockDevice: a block device is named as the kernel names it, and its
// block_dev points to its sysfs directory (the rnbd tool finds the device's directory by
// that name).
func TestExportNameBlockDevice(t *testing.T) {
	root := t.TempDir()
	old := sysDevBlock
	sysDevBlock = filepath.Join(root, "dev/block")
	t.Cleanup(func() { sysDevBlock = old })
	for _, d := range []string{"dev/block", "devices/virtual/block/nullb0", "devices/pci/block/sda/sda1", "devices/virtual/block/cciss!c0d0"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "devices/pci/block/sda/sda1/partition"), []byte("1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for link, target := range map[string]string{"252:0": "../../devices/virtual/block/nullb0", "8:1": "../../devices/pci/block/sda/sda1",
		"104:0": "../../devices/virtual/block/cciss!c0d0"} {
		if err := os.Symlink(target, filepath.Join(sysDevBlock, link)); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, tc := range []struct {
		maj, min  uint32
		dir, link string
	}{
		{252, 0, "nullb0", "devices/virtual/block/nullb0"},
		{8, 1, "sda1", "devices/pci/block/sda/sda1"},
		{104, 0, "cciss!c0d0", "devices/virtual/block/cciss!c0d0"},
	} {
		b := &backing{f: f, fd: int(f.Fd()), bdev: true, rdev: unix.Mkdev(tc.maj, tc.min)}
		dir, link := exportName(b)
		if dir != tc.dir || link != filepath.Join(root, tc.link) {
			t.Errorf("%d:%d: %q → %q, want %q → %q", tc.maj, tc.min, dir, link, tc.dir, filepath.Join(root, tc.link))
		}
	}
	// A device /sys does not know is named after its path, like a file.
	b := &backing{f: f, fd: int(f.Fd()), bdev: true, rdev: unix.Mkdev(1, 99)}
	if dir, _ := exportName(b); dir != strings.ReplaceAll(strings.TrimLeft(root, "/"), "/", "!") {
		t.Errorf("unknown device: %q", dir)
	}
}

// TestExportNameUnique: two devices that would get one name get distinct ones.
func TestExportNameUnique(t *testing.T) {
	s := &Server{devs: map[devKey]*srvDev{}}
	s.devs[devKey{dev: 1, ino: 1}] = &srvDev{dir: "srv!a!b"}
	if got := s.uniqueDirLocked("srv!a!b"); got != "srv!a!b~2" {
		t.Fatalf("%q", got)
	}
	s.devs[devKey{dev: 1, ino: 2}] = &srvDev{dir: "srv!a!b~2"}
	if got := s.uniqueDirLocked("srv!a!b"); got != "srv!a!b~3" {
		t.Fatalf("%q", got)
	}
	if got := s.uniqueDirLocked("x"); got != "x" {
		t.Fatalf("%q", got)
	}
}

// An export on a file system that fails with ENOTCONN (a FUSE export whose server went) is an
// IO error to the client, not the server's force_close: the device stays mapped.
func TestExportENOTCONNIsEIO(t *testing.T) {
	leakcheck.Check(t)
	if os.Geteuid() != 0 {
		t.Skip("FUSE mounts need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	e := newTestEnv(t)
	// A loopback FUSE file system over a directory, mounted inside the search path.
	src, mnt := t.TempDir(), filepath.Join(e.dir, "fuse")
	if err := os.WriteFile(filepath.Join(src, "disk"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	root, err := fs.NewLoopbackRoot(src)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := fs.Mount(mnt, root, &fs.Options{MountOptions: fuse.MountOptions{DirectMount: true}})
	if err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(mnt, &st); err != nil {
		t.Fatal(err)
	}
	conn := unix.Minor(st.Dev)
	t.Cleanup(func() {
		_ = syscall.Unmount(mnt, syscall.MNT_DETACH)
		srv.Wait()
	})
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "s", "fuse/disk", AccessRW)
	if _, err := d.WriteAt(bytes.Repeat([]byte{7}, 4096), 0); err != nil {
		t.Fatalf("write through FUSE: %v", err)
	}
	// The FUSE server goes: every request on the connection fails with ENOTCONN.
	abort := fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", conn)
	if _, err := os.Stat(abort); errors.Is(err, os.ErrNotExist) {
		if err := syscall.Mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, ""); err != nil && !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("mount fusectl: %v", err)
		}
	}
	if err := os.WriteFile(abort, []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	// The server keeps the file's pages mapped, so reads and writes are still served from
	// memory; a flush reaches the file system.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := d.Flush(ctx); !errors.Is(err, syscall.EIO) {
		t.Fatalf("flush of the dead export: %v, want EIO", err)
	}
	if st := d.State(); st != StateMapped {
		t.Fatalf("device %v after the export's ENOTCONN, want still mapped (only force_close ends it)", st)
	}
	if err := d.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestRemapDevice: remap_device is EALREADY while the device is open; a device the server
// force-closed is opened again by it (its old id closed on the server first, so nothing is
// kept there), IO then works; a remap the server refuses (another session took the device
// rw meanwhile) leaves it closed with the server's errno; once unmapped it is ENODEV.
func TestRemapDevice(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, 5*time.Second)
	d := mustMap(t, e, c, "a", "disk", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := d.Remap(ctx); !errors.Is(err, syscall.EALREADY) {
		t.Fatalf("remap of an open device: %v, want EALREADY", err)
	}
	rs := e.server()
	real, err := filepath.EvalSymlinks(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	pfx := strings.ReplaceAll(strings.TrimLeft(real, "/"), "/", "!") + "!"
	if err := rs.ForceClose(findExport(t, rs, pfx+"disk", "a")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	if _, err := d.WriteAt(buf, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write after force_close: %v", err)
	}
	if err := d.Remap(ctx); err != nil {
		t.Fatalf("remap after force_close: %v", err)
	}
	if st := d.State(); st != StateMapped {
		t.Fatalf("state after the remap %v", st)
	}
	if _, err := d.WriteAt(bytes.Repeat([]byte{9}, 4096), 0); err != nil {
		t.Fatalf("write after the remap: %v", err)
	}
	forced := func() int {
		rs.mu.Lock()
		defer rs.mu.Unlock()
		n := 0
		for _, ss := range rs.sessions {
			n += len(ss.forced)
		}
		return n
	}
	if n := forced(); n != 0 {
		t.Fatalf("%d force-closed ids kept on the server after the remap", n)
	}
	// Force-closed again, and another session takes it rw: the remap is refused (EPERM, the
	// second rw opener) and the device stays closed.
	if err := rs.ForceClose(findExport(t, rs, pfx+"disk", "a")); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(buf, 0); !errors.Is(err, syscall.EIO) { // the client learns it here
		t.Fatalf("write after the second force_close: %v", err)
	}
	mustMap(t, e, c, "b", "disk", AccessRW)
	if err := d.Remap(ctx); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("remap of a device another session holds rw: %v, want EPERM", err)
	}
	if st := d.State(); st != StateClosedByServer {
		t.Fatalf("state after a refused remap %v", st)
	}
	if err := d.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	if n := forced(); n != 0 {
		t.Fatalf("%d force-closed ids kept on the server after the unmap", n)
	}
	if err := d.Remap(ctx); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("remap of an unmapped device: %v, want ENODEV", err)
	}
}
