package rnbd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/ntcopy"
	"github.com/rtrs-go/rtrs/internal/lib/racebuf"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// backing is an opened export: a regular file or a block device.
type backing struct {
	f    *os.File
	fd   int
	bdev bool
	size int64 // at the open: what the write mapping and the zero-copy source cover
	// end is the export's size as last seen: IO past it looks again (within), so that an
	// export grown on the server is used up to its new end without a reopen.
	end      atomic.Int64
	lbs, pbs int
	dev, ino uint64 // identity, so two names of one file are one device
	rdev     uint64 // a block device's number
	// discardMax and discardGran: a block device's discard limits from its queue, in
	// bytes (discardMax 0: it cannot discard). A file's are maxRangeSectors and pbs.
	discardMax, discardGran int64
	// discardAlign is a partition's offset into its disk's discard granularity (0: none).
	discardAlign int64
	writable     bool
	// memfs: a tmpfs or ramfs file, whose IO never waits for a device, so a nowait
	// attempt just runs it. Otherwise noNowaitR/W record that the file system refused
	// RWF_NOWAIT once, so that later attempts go straight to blocking.
	memfs                bool
	noNowaitR, noNowaitW atomic.Bool
	// mem maps a writable memfs file for writes: a write is a copy into the page cache,
	// without the system call and the file system's per-page work (a fifth of the server's
	// CPU at 1 MiB writes), and concurrent writes do not serialize on the inode lock. Reads
	// stay preads: a read through the mapping would allocate a page for every hole it
	// touched, filling memory with the zeroes of a sparse export.
	mem []byte
	// src lets a memfs file's READs go from the page cache to the client without a copy
	// into the chunk: the page cache never waits, so sending from it cannot stall the
	// transport (a disk-backed file's send could wait for the disk).
	src *transport.FileSource
	// dio serves a block device's READs and WRITEs with O_DIRECT (ExportIODirect).
	dio *directIO
}

// openBeneath opens name under the search path root without leaving it: leading slashes
// are dropped (a client's "/disk" is root/disk, as RNBD joins dev_search_path and the name),
// and ".." or symlinks that would climb out are refused by openat2's RESOLVE_BENEATH.
// Only a block device or a regular file of a real file system is ever opened: the name is
// resolved to an O_PATH descriptor and looked at first (the kernel's server looks a block
// device up without opening it), so that a client cannot make the daemon open a character
// device (a watchdog's open starts it), a FIFO, or a sysfs or proc attribute.
func openBeneath(root *os.File, name string, writable bool) (*backing, error) {
	rel := strings.TrimLeft(name, "/")
	if rel == "" || strings.IndexByte(rel, 0) >= 0 {
		return nil, fmt.Errorf("rnbd: device path %q: %w", name, syscall.EINVAL)
	}
	how := unix.OpenHow{Flags: uint64(unix.O_PATH | unix.O_CLOEXEC), Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS}
	pfd, err := unix.Openat2(int(root.Fd()), rel, &how)
	if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
		pfd, err = unix.Openat2(int(root.Fd()), rel, &how)
	}
	if err != nil {
		if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("rnbd: device path %q leaves the export directory: %w", name, syscall.EACCES)
		}
		return nil, fmt.Errorf("rnbd: open %q: %w", name, err)
	}
	defer unix.Close(pfd)
	if err := exportable(pfd); err != nil {
		return nil, fmt.Errorf("rnbd: %q: %w", name, err)
	}
	flags := unix.O_RDONLY
	if writable {
		flags = unix.O_RDWR
	}
	// The inode just looked at, opened for IO through its O_PATH descriptor: a rename
	// meanwhile cannot put another file in its place.
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(pfd), flags|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("rnbd: open %q: %w", name, err)
	}
	b := &backing{f: os.NewFile(uintptr(fd), filepath.Join(root.Name(), rel)), fd: fd, writable: writable}
	if err := b.probe(); err != nil {
		b.f.Close()
		return nil, fmt.Errorf("rnbd: %q: %w", name, err)
	}
	if b.memfs && b.size > 0 {
		b.src = transport.NewFileSource(b.f, b.size)
	}
	if b.memfs && writable && b.size > 0 {
		// A file too large to map (address space) keeps the system calls.
		if m, err := unix.Mmap(fd, 0, int(b.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
			b.mem = m
			b.populate()
		}
	}
	return b, nil
}

// Magic numbers of <linux/magic.h> that x/sys/unix lacks.
const (
	configfsMagic = 0x62656570
	fusectlMagic  = 0x65735543
	mqueueMagic   = 0x19800202
)

// pseudoFS are the file systems whose files are not storage: their "regular files" are a
// kernel's attributes and controls, which an export must never reach.
var pseudoFS = map[int64]string{
	unix.PROC_SUPER_MAGIC: "proc", unix.SYSFS_MAGIC: "sysfs", unix.DEBUGFS_MAGIC: "debugfs",
	unix.TRACEFS_MAGIC: "tracefs", unix.SECURITYFS_MAGIC: "securityfs", configfsMagic: "configfs",
	unix.CGROUP_SUPER_MAGIC: "cgroup", unix.CGROUP2_SUPER_MAGIC: "cgroup2", unix.BPF_FS_MAGIC: "bpf",
	unix.EFIVARFS_MAGIC: "efivarfs", unix.PSTOREFS_MAGIC: "pstore", unix.SELINUX_MAGIC: "selinuxfs",
	unix.SMACK_MAGIC: "smackfs", unix.DEVPTS_SUPER_MAGIC: "devpts", unix.BINFMTFS_MAGIC: "binfmt_misc",
	fusectlMagic: "fusectl", mqueueMagic: "mqueue", unix.NSFS_MAGIC: "nsfs",
}

// exportable refuses, from an O_PATH descriptor, what is no export: a directory (EISDIR),
// anything but a block device or a regular file (ENODEV; the kernel's server says ENOTBLK
// for all but block devices), and a pseudo file system's file (ENODEV).
func exportable(pfd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFBLK:
		return nil
	case unix.S_IFREG:
		var fs unix.Statfs_t
		if err := unix.Fstatfs(pfd, &fs); err != nil {
			return err
		}
		if name, ok := pseudoFS[int64(fs.Type)]; ok {
			return fmt.Errorf("a file of %s, not storage: %w", name, syscall.ENODEV)
		}
		return nil
	case unix.S_IFDIR:
		return syscall.EISDIR
	}
	return fmt.Errorf("not a regular file or block device: %w", syscall.ENODEV)
}

// populateMax bounds how much of an export populate maps ahead: its page tables cost 2 MiB
// per GiB.
const populateMax = 16 << 30

// populate maps the pages the file already has into the write mapping, so that a write finds
// its page table entry instead of taking a fault (a page fault and a page cache lookup per
// first touch of a page: at 4 KiB random writes, the larger part of the server's time until
// every page has been written once). Holes stay unmapped: populating them would allocate them.
func (b *backing) populate() {
	var done int64
	for off := int64(0); off < b.size && done < populateMax; {
		data, err := unix.Seek(b.fd, off, unix.SEEK_DATA)
		if err != nil || data >= b.size {
			return // ENXIO: no data after off
		}
		hole, err := unix.Seek(b.fd, data, unix.SEEK_HOLE)
		if err != nil {
			return
		}
		hole = min(hole, b.size, data+populateMax-done)
		start := data &^ (pageSize - 1)
		end := (hole + pageSize - 1) &^ (pageSize - 1)
		if end > int64(len(b.mem)) {
			end = int64(len(b.mem))
		}
		if err := unix.Madvise(b.mem[start:end], unix.MADV_POPULATE_WRITE); err != nil {
			return // an older kernel: writes fault pages in as they come
		}
		done += end - start
		off = hole
	}
}

const pageSize = 4096

// probe reads the geometry: files get 512-byte logical and 4 KiB physical blocks, block
// devices report theirs.
func (b *backing) probe() error {
	var st unix.Stat_t
	if err := unix.Fstat(b.fd, &st); err != nil {
		return err
	}
	b.dev, b.ino = st.Dev, st.Ino
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		b.size, b.lbs, b.pbs = st.Size, SectorSize, 4096
		var fs unix.Statfs_t
		if unix.Fstatfs(b.fd, &fs) == nil {
			b.memfs = fs.Type == unix.TMPFS_MAGIC || fs.Type == unix.RAMFS_MAGIC
		}
	case unix.S_IFBLK:
		b.bdev, b.rdev = true, st.Rdev
		var sz uint64
		if err := ioctlPtr(b.fd, unix.BLKGETSIZE64, unsafe.Pointer(&sz)); err != nil {
			return err
		}
		var lbs, pbs int32
		if err := ioctlPtr(b.fd, unix.BLKSSZGET, unsafe.Pointer(&lbs)); err != nil {
			return err
		}
		if err := ioctlPtr(b.fd, unix.BLKPBSZGET, unsafe.Pointer(&pbs)); err != nil {
			pbs = lbs
		}
		if b.writable {
			// The kernel's server refuses a read-only device (blockdev --setro, a read-only
			// LV) for writing at the open; every write would fail after it.
			var ro int32
			if err := ioctlPtr(b.fd, unix.BLKROGET, unsafe.Pointer(&ro)); err != nil {
				return err
			}
			if ro != 0 {
				return fmt.Errorf("a read-only block device, opened for writing: %w", syscall.EACCES)
			}
		}
		b.size, b.lbs, b.pbs = int64(sz), int(lbs), int(pbs)
		b.discardMax, b.discardGran = queueLimit(st.Rdev, "discard_max_bytes"), queueLimit(st.Rdev, "discard_granularity")
		if a, err := strconv.ParseInt(readDevAttr(st.Rdev, "discard_alignment"), 10, 64); err == nil && a > 0 {
			b.discardAlign = a
		}

	default:
		return fmt.Errorf("not a regular file or block device: %w", syscall.ENODEV)
	}
	if b.lbs < SectorSize || b.lbs&(b.lbs-1) != 0 || b.pbs < b.lbs {
		return fmt.Errorf("block sizes %d/%d: %w", b.lbs, b.pbs, syscall.EINVAL)
	}
	// A file whose size is not a whole number of blocks exports the whole blocks.
	b.size -= b.size % int64(b.lbs)
	b.end.Store(b.size)
	return nil
}

// within says whether n bytes at off lie inside the export. IO past the end last seen
// looks at the export's size again, as the kernel's server checks IO against its block
// device's size as it is now: an operator who grew the export (lvextend, truncate) and then
// the client's device (its resize) needs no reopen. A shrunk export is seen at the next
// OPEN or IO past the end last seen; IO between its new and its old end is not checked
// here (a file's write then grows it again; a read past its end fails with EIO).
func (b *backing) within(off, n uint64) bool {
	if end := uint64(b.end.Load()); off <= end && n <= end-off {
		return true
	}
	sz := b.sizeNow()
	return off <= uint64(sz) && n <= uint64(sz)-off
}

// sizeNow reads the export's size again, in whole blocks, and keeps it as the end last
// seen; the end last seen when it cannot be read.
func (b *backing) sizeNow() int64 {
	sz, err := b.currentSize()
	if err != nil {
		return b.end.Load()
	}
	sz -= sz % int64(b.lbs)
	b.end.Store(sz)
	return sz
}

// currentSize is the export's size now: the file's, or the block device's.
func (b *backing) currentSize() (int64, error) {
	if b.bdev {
		var sz uint64
		if err := ioctlPtr(b.fd, unix.BLKGETSIZE64, unsafe.Pointer(&sz)); err != nil {
			return 0, err
		}
		return int64(min(sz, maxSectors*SectorSize)), nil
	}
	var st unix.Stat_t
	// Raw only for a memory file system's file, which never waits: another file's fstat
	// may wait for its file system (a FUSE export answered by a process that needs this
	// one's threads, or by this process itself), and a raw system call holds its P the
	// while, which stops the garbage collector for good.
	fstat := unix.Fstat
	if b.memfs {
		fstat = rawFstat
	}
	if err := fstat(b.fd, &st); err != nil {
		return 0, err
	}
	return st.Size, nil
}

// queueLimit reads a block device's numeric queue attribute, -1 when it cannot be read.
func queueLimit(rdev uint64, name string) int64 {
	if v, err := strconv.ParseInt(queueAttr(rdev, name), 10, 64); err == nil && v >= 0 {
		return v
	}
	return -1
}

// queueAttr reads a block device's queue attribute (a partition's is its disk's), "" when
// it cannot be read.
func queueAttr(rdev uint64, name string) string {
	if v := readDevAttr(rdev, "queue/"+name); v != "" {
		return v
	}
	return readDevAttr(rdev, "../queue/"+name)
}

// readDevAttr reads the block device's sysfs attribute name, "" when it cannot be read.
func readDevAttr(rdev uint64, name string) string {
	b, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/%s", unix.Major(rdev), unix.Minor(rdev), name))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func ioctlPtr(fd int, req uint, p unsafe.Pointer) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(p)); e != 0 {
		return e
	}
	return nil
}

// key names the device for the access-mode rule: a block device by its number, whatever
// node of it was opened (two nodes of one disk are one device), a file by its inode.
func (b *backing) key() devKey {
	if b.bdev {
		return devKey{blk: true, dev: b.rdev}
	}
	return devKey{dev: b.dev, ino: b.ino}
}

// errResponded: the request has been answered (RespondFile); errFallback: it could not be,
// and the READ goes the usual way.
var (
	errResponded = errors.New("rnbd: answered")
	errFallback  = errors.New("rnbd: not answered from the file")
)

// respondFile answers a READ at off straight from the file. The file is checked for having
// shrunk first: sending past its end would cost the client its connection, where a READ
// beyond the end should only fail.
func (b *backing) respondFile(r *transport.SrvRequest, off int64) error {
	var st unix.Stat_t
	if err := rawFstat(b.fd, &st); err != nil {
		return err
	}
	if off+int64(len(r.Data)) > st.Size {
		return fmt.Errorf("read beyond the end of %s: %w", b.f.Name(), syscall.EIO)
	}
	if r.RespondFile(b.src, off) != nil {
		return errFallback
	}
	return errResponded
}

// errWouldBlock: a nowait attempt found the data not in the page cache (or the write
// would wait); the operation must run again, from the start, where blocking is fine.
var errWouldBlock = errors.New("rnbd: would block")

// readAt fills p from off; a short read means the device shrank under us: EIO. With nowait
// it takes only what the page cache has (RWF_NOWAIT); a partial read then is errWouldBlock
// too, and the blocking retry reads it all again.
func (b *backing) readAt(p []byte, off int64, nowait bool) error {
	var iov [1][]byte
	flags := 0
	if nowait && !b.memfs {
		if b.noNowaitR.Load() {
			return errWouldBlock
		}
		flags = unix.RWF_NOWAIT
	}
	for len(p) > 0 {
		iov[0] = p
		var n int
		var err error
		if b.memfs {
			n, err = rawPreadv2(b.fd, p, off, flags)
		} else {
			n, err = unix.Preadv2(b.fd, iov[:], off, flags)
		}
		if err == unix.EINTR {
			continue
		}
		if flags&unix.RWF_NOWAIT != 0 && (err == unix.EAGAIN || err == unix.EOPNOTSUPP) {
			if err == unix.EOPNOTSUPP {
				b.noNowaitR.Store(true)
			}
			return errWouldBlock
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("read beyond the end of %s: %w", b.f.Name(), syscall.EIO)
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// rawPreadv2 is preadv2(2) of p without the runtime's system call bookkeeping, for a memfs
// file's read: a copy from memory, which waits only where a touch of our own memory could
// (swap-in), or briefly for a page lock a concurrent write or a migration holds. Entered as a blocking system call, it would wake the runtime's monitor thread
// (sysmon) from its sleep in a server with nothing else to do, on every IO. Not for other
// files, RWF_NOWAIT or not: a page cache miss there still starts the readahead (block
// mapping, a request slot) before EAGAIN, and a hit may write the atime, all while the
// runtime counts the thread as running Go code.
func rawPreadv2(fd int, p []byte, off int64, flags int) (int, error) {
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	const longBits = 8 * unsafe.Sizeof(uintptr(0))
	r, _, e := unix.RawSyscall6(unix.SYS_PREADV2, uintptr(fd), uintptr(unsafe.Pointer(&iov)), 1,
		uintptr(off), uintptr(uint64(off)>>(longBits-1)>>1), uintptr(flags))
	if e != 0 {
		return 0, e
	}
	racebuf.Written(p[:r])
	return int(r), nil
}

// writeAt writes p at off; fua makes each write durable before it returns (RWF_DSYNC);
// nowait gives up where the write would wait (RWF_NOWAIT).
func (b *backing) writeAt(p []byte, off int64, fua, nowait bool) error {
	if b.mem != nil && off <= int64(len(b.mem))-int64(len(p)) {
		return b.writeMapped(p, off) // memfs: a write is as durable as it gets at once
	}
	var iov [1][]byte
	flags := 0
	if fua {
		flags |= unix.RWF_DSYNC
	}
	if nowait && !b.memfs {
		if b.noNowaitW.Load() {
			return errWouldBlock
		}
		flags |= unix.RWF_NOWAIT
	}
	for len(p) > 0 {
		iov[0] = p
		n, err := unix.Pwritev2(b.fd, iov[:], off, flags)
		if err == unix.EINTR {
			continue
		}
		if flags&unix.RWF_NOWAIT != 0 && (err == unix.EAGAIN || err == unix.EOPNOTSUPP) {
			if err == unix.EOPNOTSUPP {
				b.noNowaitW.Store(true)
			}
			return errWouldBlock
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return syscall.EIO
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// writeMapped copies p into the mapping at off. A page that is not there any more (the file
// shrank) or cannot be allocated (the file system is full) faults; the fault becomes this
// write's error instead of the daemon's end. The copy uses non-temporal stores (ntcopy): the
// export's pages are not read again soon, and a plain copy would first read every line it
// overwrites.
func (b *backing) writeMapped(p []byte, off int64) (err error) {
	if off < 0 || off > int64(len(b.mem))-int64(len(p)) {
		return fmt.Errorf("write at %d of %d bytes beyond the mapping of %s: %w", off, len(p), b.f.Name(), syscall.EIO)
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		if _, ok := r.(interface{ Addr() uintptr }); !ok {
			panic(r)
		}
		err = b.faultErr(off, len(p))
	}()
	ntcopy.Copy(b.mem[off:], p)
	return nil
}

// faultErr names why a write to the mapping faulted: past the file's end now, or, inside
// it, no space for the page.
func (b *backing) faultErr(off int64, n int) error {
	var st unix.Stat_t
	if err := unix.Fstat(b.fd, &st); err == nil && off+int64(n) <= st.Size {
		return fmt.Errorf("write at %d to %s: %w", off, b.f.Name(), syscall.ENOSPC)
	}
	return fmt.Errorf("write at %d beyond the end of %s: %w", off, b.f.Name(), syscall.EIO)
}

func (b *backing) flush() error { return unix.Fdatasync(b.fd) }

// discard deallocates the range: a hole in a file, BLKDISCARD on a block device.
func (b *backing) discard(off, n int64) error {
	if b.bdev {
		r := [2]uint64{uint64(off), uint64(n)}
		return ioctlPtr(b.fd, unix.BLKDISCARD, unsafe.Pointer(&r))
	}
	return unix.Fallocate(b.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

// writeZeroes makes the range read as zeroes. noUnmap (RNBD_F_NOUNMAP) keeps it allocated:
// BLKZEROOUT on a block device, for a file ZERO_RANGE, or where that is not supported (tmpfs) a
// punched hole allocated again, or written zeroes as the last resort. Without it the range may
// be deallocated: a punched hole (on a block device, fallocate's PUNCH_HOLE, which zeroes by
// unmapping where the device can), falling back to the allocating ways. A block device that
// does not zero by itself fails the punch with EOPNOTSUPP, and BLKZEROOUT, which the kernel
// then serves by writing zeroes, follows (bdev_test.go: a loop device over a FUSE file without
// fallocate, and one over tmpfs, which stops zeroing by itself after a NOUNMAP).
func (b *backing) writeZeroes(off, n int64, noUnmap bool) error {
	if !noUnmap {
		err := unix.Fallocate(b.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		if !unsupported(err) {
			return err
		}
	}
	if b.bdev {
		r := [2]uint64{uint64(off), uint64(n)}
		return ioctlPtr(b.fd, unix.BLKZEROOUT, unsafe.Pointer(&r))
	}
	err := unix.Fallocate(b.fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if !unsupported(err) {
		return err
	}
	if noUnmap {
		// A hole allocated again reads as zeroes and keeps its blocks, without writing them.
		err = unix.Fallocate(b.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		if err == nil {
			err = unix.Fallocate(b.fd, unix.FALLOC_FL_KEEP_SIZE, off, n)
		}
		if !unsupported(err) {
			return err
		}
	}
	for n > 0 {
		k := min(n, int64(len(zeroes)))
		if err := b.writeAt(zeroes[:k], off, false, false); err != nil {
			return err
		}
		off, n = off+k, n-k
	}
	return nil
}

// zeroes is what zeroes are written from where a range cannot be zeroed otherwise (the
// server's export without fallocate, the client's fallback for a server that refuses
// NOUNMAP): one buffer, only ever read, for every request (one each was up to 2 GiB of heap
// at the server's blocking IO bound).
var zeroes = make([]byte, 1<<20)

// unsupported: the file system or device does not do this fallocate mode.
func unsupported(err error) bool { return err == unix.EOPNOTSUPP || err == unix.EINVAL }

// openDirect starts direct IO on a block device, answering through answer. The device is
// opened again through its descriptor, not its name, which may have changed since.
func (b *backing) openDirect(answer func(*transport.SrvRequest, error)) error {
	d, err := newDirectIO(fmt.Sprintf("/proc/self/fd/%d", b.fd), b.writable, b.lbs, answer)
	if err != nil {
		return err
	}
	b.dio = d
	return nil
}

// closing is what a device's close leaves behind: io is closed once none of the session's IO
// is at the device any more (its access mode may stop counting), gone once its descriptors
// and direct IO's context have been let go.
type closing struct{ io, gone <-chan struct{} }

// closed is a close that left nothing behind.
var closed = closing{closedChan, closedChan}

// close unmaps and closes. No IO may be starting (the device's lock sees to it). Direct IO
// in flight is waited for, dioDrainTimeout at most, and the open's late probe read not at
// all: what is still at the device after that is let go when it ends, and the descriptors
// stay open until then.
func (b *backing) close() closing {
	if d := b.dio; d != nil {
		b.dio = nil
		if err := d.close(); err != nil {
			gone := make(chan struct{})
			go func() {
				<-d.ended
				_ = d.release()
				_ = b.closeFiles()
				close(gone)
			}()
			return closing{io: d.quiet, gone: gone}
		}
	}
	_ = b.closeFiles()
	return closed
}

// closeFiles closes what close closes besides direct IO.
func (b *backing) closeFiles() error {
	if b.src != nil {
		b.src.Close()
	}
	if b.mem != nil {
		_ = unix.Munmap(b.mem)
		b.mem = nil
	}
	return b.f.Close()
}
