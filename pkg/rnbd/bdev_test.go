package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// These tests run writeZeroes and discard on real block devices: loop devices over files on
// the disk's file system, on tmpfs, and on a FUSE file system that refuses fallocate.

const (
	loopSize = 8 << 20
	mib      = 1 << 20
)

// requireRoot skips the test unless it runs as root; loop devices and mounts need it.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("loop devices and mounts need root")
	}
}

// attachLoop binds a free loop device to the file at path (LOOP_CTL_GET_FREE, LOOP_CONFIGURE)
// and returns its name under /dev. Cleanup detaches it; AUTOCLEAR detaches it too should the
// test die first (with its last opener).
func attachLoop(t *testing.T, path string) string {
	t.Helper()
	return attachLoopBlock(t, path, 0)
}

// attachLoopBlock is attachLoop with a logical block of bs bytes (0: the loop driver's 512;
// LoopConfig.Size is struct loop_config's block_size).
func attachLoopBlock(t *testing.T, path string, bs uint32) string {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("loop devices: %v", err)
	}
	defer ctl.Close()
	back, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close() // the loop device holds its own reference
	for try := 0; ; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			t.Fatalf("LOOP_CTL_GET_FREE: %v", err)
		}
		name := fmt.Sprintf("loop%d", n)
		dev, err := os.OpenFile("/dev/"+name, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		cfg := unix.LoopConfig{Fd: uint32(back.Fd()), Size: bs, Info: unix.LoopInfo64{Flags: unix.LO_FLAGS_AUTOCLEAR}}
		err = unix.IoctlLoopConfigure(int(dev.Fd()), &cfg)
		if err == nil {
			t.Cleanup(func() {
				if err := unix.IoctlSetInt(int(dev.Fd()), unix.LOOP_CLR_FD, 0); err != nil {
					t.Errorf("detach %s: %v", name, err)
				}
				dev.Close()
			})
			return name
		}
		dev.Close()
		if !errors.Is(err, unix.EBUSY) || try == 10 { // EBUSY: another process took it first
			t.Fatalf("LOOP_CONFIGURE %s: %v", name, err)
		}
	}
}

// writePattern writes loopSize bytes of 0x5a to a new file at path, durably: its blocks are
// allocated.
func writePattern(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(bytes.Repeat([]byte{0x5a}, loopSize)); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// openLoop attaches a loop device to file and opens it as the server opens an export, beneath
// a search path of /dev.
func openLoop(t *testing.T, file string) *backing {
	t.Helper()
	name := attachLoop(t, file)
	root, err := os.Open("/dev")
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	b, err := openBeneath(root, name, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.close() })
	if !b.bdev || b.size != loopSize {
		t.Fatalf("%s: bdev %v, size %d", name, b.bdev, b.size)
	}
	return b
}

// writeZeroesMax is the device's write_zeroes_max_bytes: 0 when it does not zero by itself, and
// then its PUNCH_HOLE fails (the block layer may not fall back to writing zeroes for it).
func writeZeroesMax(t *testing.T, b *backing) int64 {
	t.Helper()
	p := fmt.Sprintf("/sys/dev/block/%d:%d/queue/write_zeroes_max_bytes", unix.Major(b.rdev), unix.Minor(b.rdev))
	s, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(s)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", p, err)
	}
	return n
}

// checkZeroed reads the device and, after a flush, the backing file: zeroes in [zeroFrom,
// zeroTo), 0x5a elsewhere.
func checkZeroed(t *testing.T, b *backing, file string, zeroFrom, zeroTo int) {
	t.Helper()
	want := bytes.Repeat([]byte{0x5a}, loopSize)
	clear(want[zeroFrom:zeroTo])
	got := make([]byte, loopSize)
	if err := b.readAt(got, 0, false); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("device: zeroed range wrong or spilled over")
	}
	if err := b.flush(); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, want) {
		t.Errorf("backing file: zeroed range wrong or spilled over (%v)", err)
	}
}

// blocks is the file's allocated 512-byte blocks.
func blocks(t *testing.T, file string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(file, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks
}

// isHole: the file has a hole at off.
func isHole(t *testing.T, file string, off int64) bool {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h, err := unix.Seek(int(f.Fd()), off, unix.SEEK_HOLE)
	return err == nil && h == off
}

// TestWriteZeroesLoopDevice zeroes and discards on loop devices over a file of the disk's file
// system and of tmpfs, whose PUNCH_HOLE the loop device passes on: WRITE_ZEROES without
// NOUNMAP and DISCARD leave holes in the backing file, with NOUNMAP its blocks stay. tmpfs has
// no ZERO_RANGE, and a loop device refused it once stops announcing write zeroes: from then on
// its PUNCH_HOLE fails, and WRITE_ZEROES without NOUNMAP goes to BLKZEROOUT, which writes zeroes
// and so keeps the blocks.
func TestWriteZeroesLoopDevice(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name  string
		tmpfs bool // a tmpfs of its own
		// keepsWriteZeroes: the loop device still zeroes by itself after a NOUNMAP zeroing.
		keepsWriteZeroes bool
	}{
		{"disk", false, true},
		{"tmpfs", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			var st unix.Statfs_t
			if err := unix.Statfs(dir, &st); err != nil {
				t.Fatal(err)
			}
			if !tc.tmpfs && st.Type == unix.TMPFS_MAGIC {
				t.Skip("the temporary directory is on tmpfs, not a disk")
			}
			if tc.tmpfs {
				if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16m"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() {
					if err := unix.Unmount(dir, 0); err != nil {
						t.Errorf("unmount %s: %v", dir, err)
					}
				})
			}
			file := filepath.Join(dir, "disk")
			writePattern(t, file)
			b := openLoop(t, file)
			full, step := blocks(t, file), int64(mib/512)
			if full < loopSize/512 {
				t.Fatalf("backing file has %d blocks, want %d", full, loopSize/512)
			}

			if err := b.writeZeroes(1*mib, mib, false); err != nil {
				t.Fatal(err)
			}
			if got := blocks(t, file); got > full-step || !isHole(t, file, 1*mib) {
				t.Errorf("write zeroes without NOUNMAP: %d → %d blocks, hole %v", full, got, isHole(t, file, 1*mib))
			}
			if err := b.writeZeroes(2*mib, mib, true); err != nil {
				t.Fatal(err)
			}
			if got := blocks(t, file); got < full-step {
				t.Errorf("write zeroes with NOUNMAP: %d → %d blocks, want them kept", full-step, got)
			}
			if err := b.discard(3*mib, mib); err != nil {
				t.Fatal(err)
			}
			if got := blocks(t, file); got > full-2*step || !isHole(t, file, 3*mib) {
				t.Errorf("discard: %d → %d blocks, hole %v", full-step, got, isHole(t, file, 3*mib))
			}

			if wz := writeZeroesMax(t, b); (wz > 0) != tc.keepsWriteZeroes {
				t.Fatalf("write_zeroes_max_bytes %d after a NOUNMAP zeroing", wz)
			}
			before := blocks(t, file)
			if err := b.writeZeroes(4*mib, 2*mib, false); err != nil {
				t.Fatal(err)
			}
			got := blocks(t, file)
			if tc.keepsWriteZeroes && (got > before-2*step || !isHole(t, file, 4*mib)) {
				t.Errorf("write zeroes without NOUNMAP after one with it: %d → %d blocks, hole %v", before, got, isHole(t, file, 4*mib))
			}
			if !tc.keepsWriteZeroes && got < before {
				t.Errorf("write zeroes by BLKZEROOUT: %d → %d blocks, want them kept", before, got)
			}
			checkZeroed(t, b, file, 1*mib, 6*mib)
		})
	}
}

// noFallocate is a loopback FUSE file system whose files refuse fallocate with EOPNOTSUPP,
// as a FUSE file system without it does; refused counts the refusals.
type noFallocate struct {
	*fs.LoopbackNode
	refused *atomic.Int32
}

func (n *noFallocate) WrapChild(ctx context.Context, ops fs.InodeEmbedder) fs.InodeEmbedder {
	return &noFallocate{ops.(*fs.LoopbackNode), n.refused}
}

func (n *noFallocate) Allocate(ctx context.Context, fh fs.FileHandle, off, size uint64, mode uint32) syscall.Errno {
	n.refused.Add(1)
	return syscall.EOPNOTSUPP
}

// TestWriteZeroesPunchUnsupported zeroes on a block device that cannot zero by unmapping: a
// loop device over a FUSE file that refuses fallocate. The loop device announces write zeroes
// (FUSE has a fallocate), passes the punch on, and fails it with EOPNOTSUPP when the FUSE server
// refuses it: writeZeroes without NOUNMAP falls back to BLKZEROOUT, which the kernel serves by
// writing zeroes, and so does NOUNMAP. The refused punch made the loop device stop announcing
// discard too: the server then announces no discard for it.
func TestWriteZeroesPunchUnsupported(t *testing.T) {
	leakcheck.Check(t)
	requireRoot(t)
	src, mnt := t.TempDir(), t.TempDir()
	lb, err := fs.NewLoopbackRoot(src)
	if err != nil {
		t.Fatal(err)
	}
	root := &noFallocate{lb.(*fs.LoopbackNode), new(atomic.Int32)}
	srv, err := fs.Mount(mnt, root, &fs.Options{MountOptions: fuse.MountOptions{DirectMount: true}})
	if err != nil {
		t.Fatalf("FUSE mount: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("FUSE unmount: %v", err)
		}
	})
	file := filepath.Join(src, "disk") // read directly, not through FUSE or the loop device
	writePattern(t, file)
	b := openLoop(t, filepath.Join(mnt, "disk"))

	if err := b.writeZeroes(1*mib, mib, false); err != nil {
		t.Fatalf("write zeroes without NOUNMAP: %v", err)
	}
	if root.refused.Load() == 0 {
		t.Fatal("the punch did not reach the FUSE server")
	}
	checkZeroed(t, b, file, 1*mib, 2*mib)
	if err := b.writeZeroes(2*mib, mib, true); err != nil {
		t.Fatalf("write zeroes with NOUNMAP: %v", err)
	}
	checkZeroed(t, b, file, 1*mib, 3*mib)

	// An export opened on it from now on announces no discard (the kernel's server reads the
	// same queue limit) and still announces write zeroes.
	if b.discardMax <= 0 {
		t.Errorf("discard limit read at open: %d, want the loop device's first one", b.discardMax)
	}
	again := openBeneathDev(t, b)
	if again.discardMax != 0 {
		t.Errorf("discard limit after the refused punch: %d, want 0", again.discardMax)
	}
	s := &Server{opts: ServerOptions{MaxIOSize: 128 << 10}}
	for _, tc := range []struct {
		b            *backing
		wantDiscards bool
	}{{b, true}, {again, false}} {
		var buf [OpenRspSize]byte
		if err := s.openRsp(buf[:], &sessDev{b: tc.b, mode: AccessRW}); err != nil {
			t.Fatal(err)
		}
		var rsp MsgOpenRsp
		if err := rsp.Unmarshal(buf[:]); err != nil {
			t.Fatal(err)
		}
		if (rsp.MaxDiscardSectors != 0) != tc.wantDiscards || rsp.MaxWriteZeroesSectors == 0 {
			t.Errorf("open response: max_discard_sectors %d (want discards %v), max_write_zeroes_sectors %d",
				rsp.MaxDiscardSectors, tc.wantDiscards, rsp.MaxWriteZeroesSectors)
		}
	}
}

// openBeneathDev opens b's block device again, as the server opens an export.
func openBeneathDev(t *testing.T, b *backing) *backing {
	t.Helper()
	root, err := os.Open("/dev")
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	again, err := openBeneath(root, filepath.Base(b.f.Name()), true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.close() })
	return again
}

// TestOpenLooksFirst: the server opens only block devices and regular files of real file
// systems, and looks before it opens (inotify sees no open of a FIFO or a character device a
// client named); a read-only block device is refused for writing (EACCES), as the kernel's
// server refuses it; two nodes of one block device are one device for the access-mode rule.
func TestOpenLooksFirst(t *testing.T) {
	requireRoot(t)
	leakcheck.Check(t)
	dir := t.TempDir()
	if err := unix.Mkfifo(filepath.Join(dir, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	ifd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ifd)
	for _, n := range []string{"fifo", "null"} {
		if _, err := unix.InotifyAddWatch(ifd, filepath.Join(dir, n), unix.IN_OPEN); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "proc"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("proc", filepath.Join(dir, "proc"), "proc", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(filepath.Join(dir, "proc"), unix.MNT_DETACH)
	root, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for _, n := range []string{"fifo", "null", "proc/sys/kernel/hostname"} {
		for _, rw := range []bool{false, true} {
			if b, err := openBeneath(root, n, rw); !errors.Is(err, syscall.ENODEV) {
				if err == nil {
					b.close()
				}
				t.Errorf("open %s (rw %v): %v, want ENODEV", n, rw, err)
			}
		}
	}
	var ev [4096]byte
	if n, err := unix.Read(ifd, ev[:]); n > 0 || !errors.Is(err, unix.EAGAIN) {
		t.Errorf("inotify saw %d bytes of open events (%v): the server opened what it refused", n, err)
	}

	// A read-only block device: refused for writing, taken for reading.
	writePattern(t, filepath.Join(dir, "ro"))
	name := attachLoop(t, filepath.Join(dir, "ro"))
	dev, err := os.OpenFile("/dev/"+name, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if err := unix.IoctlSetPointerInt(int(dev.Fd()), unix.BLKROSET, 1); err != nil {
		t.Fatal(err)
	}
	// The flag outlives the loop device's file: the next test to take this loop device
	// must find it writable.
	defer func() {
		if err := unix.IoctlSetPointerInt(int(dev.Fd()), unix.BLKROSET, 0); err != nil {
			t.Error(err)
		}
	}()
	devRoot, err := os.Open("/dev")
	if err != nil {
		t.Fatal(err)
	}
	defer devRoot.Close()
	if b, err := openBeneath(devRoot, name, true); !errors.Is(err, syscall.EACCES) {
		if err == nil {
			b.close()
		}
		t.Fatalf("open read-only %s for writing: %v, want EACCES", name, err)
	}
	b, err := openBeneath(devRoot, name, false)
	if err != nil {
		t.Fatalf("open read-only %s for reading: %v", name, err)
	}
	b.close()

	// A second node of the device, in another directory: the same key.
	var st unix.Stat_t
	if err := unix.Stat("/dev/"+name, &st); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(dir, "other"), unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		t.Fatal(err)
	}
	b1, err := openBeneath(devRoot, name, false)
	if err != nil {
		t.Fatal(err)
	}
	defer b1.close()
	b2, err := openBeneath(root, "other", false)
	if err != nil {
		t.Fatal(err)
	}
	defer b2.close()
	if b1.ino == b2.ino || b1.key() != b2.key() {
		t.Fatalf("two nodes of %s: keys %+v and %+v", name, b1.key(), b2.key())
	}
}
