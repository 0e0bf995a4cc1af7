package fsview

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/errno"
	"github.com/rtrs-go/rtrs/pkg/log"
)

// maxBackground bounds the asynchronous requests (a device file's libaio with O_DIRECT) the
// kernel keeps in flight on a mount, each served on a goroutine of its own.
// They are the whole tree's, not a device's: a device whose IO waits (its paths
// reconnecting) with this many requests out holds up the other devices' asynchronous
// submitters until it is served or fails; hence well above one job's queue depth.
const maxBackground = 256

// MountOptions name a mount.
type MountOptions struct {
	// Name shows as the file system type ("fuse.<Name>") and source.
	Name string
	// Debug logs every FUSE request.
	Debug bool
}

// Mount serves root at dir until the returned tree is unmounted. A stale mount left at
// dir by a crashed daemon is cleared first.
func Mount(dir string, root Dir, o MountOptions) (*Mounted, error) {
	if err := clearStale(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	zero := time.Duration(0)
	opts := &fs.Options{
		MountOptions: fuse.MountOptions{
			AllowOther: true, // readable by all; the modes keep control files root's
			// The kernel checks the modes (without it, anyone could write a 0644 file).
			Options:     []string{"default_permissions"},
			DirectMount: true,
			// Never fusermount: mount(2) and umount(2) themselves, whose errors say what
			// happened (EBUSY: a file open in the tree), not that fusermount is missing.
			DirectMountStrict: true,
			FsName:            o.Name,
			Name:              o.Name,
			Debug:             o.Debug,
			Logger:            log.StdLogger(log.G(context.Background()).WithField("component", "fuse"), "debug"),
			MaxReadAhead:      0,
			// A device file's asynchronous O_DIRECT requests (libaio) go out as
			// concurrent FUSE requests (FUSE_ASYNC_DIO): without it the kernel runs each
			// in the submitting thread, one after another, and a job was QD1 whatever
			// its iodepth.
			ExtraCapabilities: fuse.CAP_ASYNC_DIO,
			// Those concurrent requests in flight per mount (the kernel's default is 12).
			MaxBackground: maxBackground,
		},
		// Nothing is cached: every lookup and every stat asks the tree, so state changes
		// (a path removed, a device mapped) show at once.
		EntryTimeout:    &zero,
		AttrTimeout:     &zero,
		NegativeTimeout: &zero,
		NullPermissions: true,
	}
	srv, err := fuse.NewServer(newSyncWrites(fs.NewNodeFS(&dirNode{dir: root}, opts)), dir, &opts.MountOptions)
	if err != nil {
		return nil, err
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		return nil, err
	}
	m := &Mounted{srv: srv, dir: dir}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err == nil {
		m.conn = unix.Minor(st.Dev)
	}
	return m, nil
}

// UnmountGrace is how long Unmount waits for the kernel to end a detached tree's FUSE
// connection before it aborts it.
const UnmountGrace = 5 * time.Second

// Mounted is a tree being served at a mount point.
type Mounted struct {
	srv  *fuse.Server
	dir  string
	conn uint32 // the kernel's number of the FUSE connection (fusectl): the mount's minor
}

// Unmount detaches the tree and waits until its FUSE server has stopped. The kernel ends the
// connection only when the last copy of the mount goes: a mount namespace made while the tree
// was mounted (unshare -m, a container started then, a chroot's bind mount) keeps one. After
// UnmountGrace the connection is aborted through fusectl, so a daemon always stops; that
// copy then answers ENOTCONN, as a crashed daemon's mount does.
func (m *Mounted) Unmount() error {
	done := make(chan error, 1)
	go func() { done <- m.srv.Unmount() }()
	select {
	case err := <-done:
		return err
	case <-time.After(UnmountGrace):
	}
	lg := log.L.WithField("component", "fsview")
	lg.Warnf("%s: the FUSE connection %d outlived the unmount by %v (a copy of the mount in another mount namespace?): aborting it", m.dir, m.conn, UnmountGrace)
	if err := abortConn(m.conn); err != nil {
		return fmt.Errorf("unmount %s: connection %d stays open and could not be aborted: %w", m.dir, m.conn, err)
	}
	select {
	case err := <-done:
		return err
	case <-time.After(UnmountGrace):
		return fmt.Errorf("unmount %s: FUSE connection %d still served after its abort", m.dir, m.conn)
	}
}

// Wait waits until the tree's FUSE server has stopped.
func (m *Mounted) Wait() { m.srv.Wait() }

// fusectlDir is where the fusectl file system shows the kernel's FUSE connections.
const fusectlDir = "/sys/fs/fuse/connections"

// abortConn aborts FUSE connection n: every request fails and the server's reads end. The
// fusectl file system is mounted for it if it is not (systemd mounts it at boot; a container
// or a VM's init may not).
func abortConn(n uint32) error {
	if n == 0 {
		return errors.New("connection number unknown")
	}
	f := fmt.Sprintf("%s/%d/abort", fusectlDir, n)
	if _, err := os.Stat(f); errors.Is(err, os.ErrNotExist) {
		if err := syscall.Mount("fusectl", fusectlDir, "fusectl", 0, ""); err != nil && !errors.Is(err, syscall.EBUSY) {
			return fmt.Errorf("mount fusectl at %s: %w", fusectlDir, err)
		}
	}
	return os.WriteFile(f, []byte("1"), 0)
}

// clearStale detaches a dead mount at dir (its daemon gone: every access is ENOTCONN) and
// refuses a live one: a second daemon given the same mount point must not take the tree
// from under the first.
func clearStale(dir string) error {
	var st, parent syscall.Stat_t
	err := syscall.Stat(dir, &st)
	switch {
	case errors.Is(err, syscall.ENOTCONN):
		_, err = Cleanup(dir)
		return err
	case err != nil:
		return nil // nothing there yet, or MkdirAll will say what is wrong
	}
	if err := syscall.Stat(filepath.Dir(dir), &parent); err == nil && parent.Dev != st.Dev {
		return fmt.Errorf("%s: something is mounted there and answers (another daemon's tree?); stop it or choose another mount point: %w", dir, syscall.EBUSY)
	}
	return nil
}

// Cleanup detaches whatever is mounted at dir (a stale mount of a crashed daemon answers
// every access with ENOTCONN) and says whether there was something. Nothing mounted is not
// an error.
func Cleanup(dir string) (bool, error) {
	err := syscall.Unmount(dir, syscall.MNT_DETACH)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOENT) {
		return false, nil
	}
	return false, err
}

// CleanupReport is Cleanup for a daemon's -cleanup: it detaches only a mount that no
// longer answers (ENOTCONN, or no answer within cleanupWait: a hung daemon), refuses one
// that does (EBUSY: a live daemon's tree, or a mistyped -mount over another file system),
// and logs what it did.
func CleanupReport(dir string) error {
	if answersAsMount(dir) {
		err := fmt.Errorf("cleanup: %s is mounted and answers (a running daemon's tree?); stop that daemon instead: %w", dir, syscall.EBUSY)
		log.L.Warn(err)
		return err
	}
	detached, err := Cleanup(dir)
	switch {
	case err != nil:
		log.L.WithError(err).Warnf("cleanup: %s not detached", dir)
	case detached:
		log.L.Infof("cleanup: detached a stale mount at %s", dir)
	default:
		log.L.Infof("cleanup: nothing mounted at %s", dir)
	}
	return err
}

// cleanupWait bounds -cleanup's look at a mount: a hung FUSE daemon never answers it.
const cleanupWait = 5 * time.Second

// answersAsMount says whether dir is a mount point that answers a stat within cleanupWait.
// The stat of a hung mount is left behind (the process exits soon after -cleanup).
func answersAsMount(dir string) bool {
	ch := make(chan bool, 1)
	go func() {
		var st, parent syscall.Stat_t
		ch <- syscall.Stat(dir, &st) == nil && syscall.Stat(filepath.Dir(dir), &parent) == nil && parent.Dev != st.Dev
	}()
	select {
	case ok := <-ch:
		return ok
	case <-time.After(cleanupWait):
		return false
	}
}

func setTimes(a *fuse.Attr) {
	a.SetTimes(&mountTime, &mountTime, &mountTime)
}

// dirNode adapts a Dir.
type dirNode struct {
	fs.Inode
	mu  sync.Mutex
	dir Dir
	obj any // Entry.Obj: the object the directory shows, if it says
}

func (n *dirNode) set(d Dir) { n.mu.Lock(); n.dir = d; n.mu.Unlock() }
func (n *dirNode) get() Dir  { n.mu.Lock(); defer n.mu.Unlock(); return n.dir }

var (
	_ fs.NodeLookuper  = (*dirNode)(nil)
	_ fs.NodeReaddirer = (*dirNode)(nil)
	_ fs.NodeGetattrer = (*dirNode)(nil)
	_ fs.NodeUnlinker  = (*dirNode)(nil)
	_ fs.NodeRmdirer   = (*dirNode)(nil)
	_ fs.NodeMkdirer   = (*dirNode)(nil)
	_ fs.NodeRenamer   = (*dirNode)(nil)
	_ fs.NodeCreater   = (*dirNode)(nil)
	_ fs.NodeSymlinker = (*dirNode)(nil)
	_ fs.NodeMknoder   = (*dirNode)(nil)
	_ fs.NodeLinker    = (*dirNode)(nil)
	_ fs.NodeSetattrer = (*dirNode)(nil)
)

// Unlink refuses, as sysfs does: a tree's files go with what they show, through its
// control files (go-fuse would report success and do nothing, and an operator's rm of a
// device file would seem to have unmapped it).
func (n *dirNode) Unlink(ctx context.Context, name string) syscall.Errno { return syscall.EPERM }

// Rmdir refuses, as Unlink does.
func (n *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno { return syscall.EPERM }

// Mkdir refuses, as sysfs does (go-fuse would say EOPNOTSUPP).
func (n *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Create refuses with EACCES, as sysfs does for a name it does not have (go-fuse would say
// EROFS, as if the whole tree had gone read-only): `echo 1 > mpath_polcy` is a typo.
func (n *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	return nil, nil, 0, syscall.EACCES
}

// Symlink, Mknod and Link refuse, as sysfs does.
func (n *dirNode) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Mknod refuses, as Symlink does.
func (n *dirNode) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Link refuses, as Symlink does.
func (n *dirNode) Link(ctx context.Context, target fs.InodeEmbedder, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

// Setattr refuses a change of mode or owner (noAttrChange).
func (n *dirNode) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if en := noAttrChange(in); en != 0 {
		return en
	}
	return n.Getattr(ctx, f, out)
}

// noAttrChange is EPERM for a chmod or chown: the tree's modes and owners are its tables',
// and a change that reported success and changed nothing would leave a delegated group's
// writes failing with no word why (sysfs keeps such a change; this tree cannot).
func noAttrChange(in *fuse.SetAttrIn) syscall.Errno {
	if in.Valid&(fuse.FATTR_MODE|fuse.FATTR_UID|fuse.FATTR_GID) != 0 {
		return syscall.EPERM
	}
	return 0
}

// Rename refuses, as sysfs does.
func (n *dirNode) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	return syscall.EPERM
}

func (n *dirNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | 0o755
	out.Nlink = 2
	setTimes(&out.Attr)
	return 0
}

func (n *dirNode) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	var list []fuse.DirEntry
	for _, e := range n.get().Entries() {
		mode := uint32(syscall.S_IFREG)
		switch {
		case e.Dir != nil:
			mode = syscall.S_IFDIR
		case e.Link != "":
			mode = syscall.S_IFLNK
		}
		list = append(list, fuse.DirEntry{Name: e.Name, Mode: mode})
	}
	return fs.NewListDirStream(list), 0
}

func (n *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	for _, e := range n.get().Entries() {
		if e.Name != name {
			continue
		}
		old := n.GetChild(name)
		var ch *fs.Inode
		switch {
		case e.Dir != nil:
			// A name keeps its inode while it exists and shows the same object; what it
			// shows is asked anew each time. Another object under the name (a session
			// closed and opened again) gets a new inode, and a shell left in the old one
			// stays with the old object.
			if d, ok := nodeOf[*dirNode](old); ok && d.obj == e.Obj {
				d.set(e.Dir)
				ch = old
			} else {
				ch = n.NewInode(ctx, &dirNode{dir: e.Dir, obj: e.Obj}, fs.StableAttr{Mode: syscall.S_IFDIR})
			}
			out.Mode, out.Nlink = syscall.S_IFDIR|0o755, 2
			setTimes(&out.Attr)
		case e.Attr != nil:
			if a, ok := nodeOf[*attrNode](old); ok {
				a.set(e.Attr)
				ch = old
			} else {
				ch = n.NewInode(ctx, &attrNode{attr: e.Attr}, fs.StableAttr{Mode: syscall.S_IFREG})
			}
			ch.Operations().(*attrNode).fill(&out.Attr)
		case e.Block != nil:
			if b, ok := nodeOf[*blockNode](old); ok {
				b.set(e.Block)
				ch = old
			} else {
				ch = n.NewInode(ctx, &blockNode{b: e.Block}, fs.StableAttr{Mode: syscall.S_IFREG})
			}
			ch.Operations().(*blockNode).fill(&out.Attr)
		case e.Link != "":
			if l, ok := nodeOf[*linkNode](old); ok {
				l.set(e.Link)
				ch = old
			} else {
				ch = n.NewInode(ctx, &linkNode{target: e.Link}, fs.StableAttr{Mode: syscall.S_IFLNK})
			}
			ch.Operations().(*linkNode).fill(&out.Attr)
		default:
			return nil, syscall.EIO
		}
		return ch, 0
	}
	return nil, syscall.ENOENT
}

func nodeOf[T fs.InodeEmbedder](in *fs.Inode) (T, bool) {
	var zero T
	if in == nil {
		return zero, false
	}
	t, ok := in.Operations().(T)
	return t, ok
}

// linkNode is a symbolic link (a sysfs link such as the rnbd-server tree's block_dev).
type linkNode struct {
	fs.Inode
	mu     sync.Mutex
	target string
}

var (
	_ fs.NodeReadlinker = (*linkNode)(nil)
	_ fs.NodeGetattrer  = (*linkNode)(nil)
)

func (n *linkNode) set(t string) { n.mu.Lock(); n.target = t; n.mu.Unlock() }
func (n *linkNode) get() string  { n.mu.Lock(); defer n.mu.Unlock(); return n.target }

func (n *linkNode) fill(a *fuse.Attr) {
	a.Mode = syscall.S_IFLNK | 0o777
	a.Size = uint64(len(n.get()))
	a.Nlink = 1
	setTimes(a)
}

func (n *linkNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.fill(&out.Attr)
	return 0
}

func (n *linkNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	return []byte(n.get()), 0
}

// attrNode adapts an Attr.
type attrNode struct {
	fs.Inode
	mu   sync.Mutex
	attr *Attr
}

var (
	_ fs.NodeOpener    = (*attrNode)(nil)
	_ fs.NodeReader    = (*attrNode)(nil)
	_ fs.NodeWriter    = (*attrNode)(nil)
	_ fs.NodeGetattrer = (*attrNode)(nil)
	_ fs.NodeSetattrer = (*attrNode)(nil)
)

func (n *attrNode) set(a *Attr) { n.mu.Lock(); n.attr = a; n.mu.Unlock() }
func (n *attrNode) get() *Attr  { n.mu.Lock(); defer n.mu.Unlock(); return n.attr }

func (n *attrNode) fill(a *fuse.Attr) {
	a.Mode = syscall.S_IFREG | n.get().Mode
	a.Size = 4096 // as sysfs: the content is rendered when read
	a.Nlink = 1
	setTimes(a)
}

func (n *attrNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.fill(&out.Attr)
	return 0
}

// Setattr accepts the truncate that `echo x > file` sends before its write (and refuses
// a chmod or chown: noAttrChange).
func (n *attrNode) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if en := noAttrChange(in); en != 0 {
		return en
	}
	n.fill(&out.Attr)
	return 0
}

// attrHandle is one open: the attribute it was opened on (a later lookup may give the name
// another object's) and the content its last read at offset 0 rendered.
type attrHandle struct {
	attr *Attr
	mu   sync.Mutex
	data []byte
}

func (n *attrNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	a := n.get()
	acc := flags & syscall.O_ACCMODE
	if acc != syscall.O_RDONLY && a.Store == nil {
		return nil, 0, syscall.EACCES
	}
	return &attrHandle{attr: a}, fuse.FOPEN_DIRECT_IO, 0
}

// Read renders the content at every read at offset 0, as sysfs's seq_file does: a monitor
// that keeps the file open and reads it again from the start (pread at 0, or lseek and
// read) sees the value of now. Reads further on continue what that read rendered.
func (n *attrNode) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	h, _ := f.(*attrHandle)
	if h == nil || h.attr.Show == nil {
		return fuse.ReadResultData(nil), 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if off == 0 {
		h.data = []byte(h.attr.Show())
	}
	if off >= int64(len(h.data)) {
		return fuse.ReadResultData(nil), 0
	}
	end := min(int64(len(h.data)), off+int64(len(dest)))
	return fuse.ReadResultData(h.data[off:end]), 0
}

// Fsync does nothing and succeeds, as sysfs's does: a store has acted when its write returns.
func (n *attrNode) Fsync(ctx context.Context, f fs.FileHandle, flags uint32) syscall.Errno {
	return 0
}

// Write runs the store with the whole write (the offset is ignored, as sysfs does for a
// first write) minus one trailing newline.
func (n *attrNode) Write(ctx context.Context, f fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	a := n.get()
	if h, ok := f.(*attrHandle); ok {
		a = h.attr
	}
	if a.Store == nil {
		return 0, syscall.EACCES
	}
	val := strings.TrimSuffix(string(data), "\n")
	if err := a.Store(val); err != nil {
		en := errno.Of(err)
		// The writer sees only the errno; the log says which file, what was written, and why.
		log.G(ctx).WithFields(log.Fields{"component": "fsview", "file": n.Path(nil), "input": fmt.Sprintf("%.200q", val), "errno": en.Error(),
			"error": clipped(err.Error(), maxLoggedError)}).Warn("control write refused")
		return 0, en
	}
	return uint32(len(data)), 0
}

// maxLoggedError bounds the reason a refused control write logs: a reason may quote the
// input, and a write of a megabyte must not make a log line of several.
const maxLoggedError = 512

// clipped is s cut to at most max bytes, saying how long it was.
func clipped(s string, max int) string {
	if len(s) <= max {
		return s
	}
	return fmt.Sprintf("%s… (%d bytes in all)", strings.ToValidUTF8(s[:max], ""), len(s))
}

// blockNode adapts a Block: reads and writes go to the device; anything not in whole blocks
// is read, merged and written back.
type blockNode struct {
	fs.Inode
	// mu: a partial-block write (read, merge, write back) excludes every other write, which
	// could land between its read and its write back; whole-block writes run side by side.
	mu  sync.RWMutex
	bmu sync.Mutex
	b   Block
}

func (n *blockNode) set(b Block) { n.bmu.Lock(); n.b = b; n.bmu.Unlock() }
func (n *blockNode) dev() Block  { n.bmu.Lock(); defer n.bmu.Unlock(); return n.b }

var (
	_ fs.NodeOpener    = (*blockNode)(nil)
	_ fs.NodeReader    = (*blockNode)(nil)
	_ fs.NodeWriter    = (*blockNode)(nil)
	_ fs.NodeFsyncer   = (*blockNode)(nil)
	_ fs.NodeGetattrer = (*blockNode)(nil)
	_ fs.NodeSetattrer = (*blockNode)(nil)
	_ fs.NodeAllocater = (*blockNode)(nil)
)

func (n *blockNode) fill(a *fuse.Attr) {
	a.Mode = syscall.S_IFREG | 0o600
	a.Size = uint64(n.dev().Size())
	a.Blksize = uint32(n.dev().BlockSize())
	a.Blocks = a.Size / 512
	a.Nlink = 1
	setTimes(a)
}

func (n *blockNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.fill(&out.Attr)
	return 0
}

// Setattr ignores size changes, as a block device ignores O_TRUNC (and refuses a chmod or
// chown: noAttrChange).
func (n *blockNode) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if en := noAttrChange(in); en != 0 {
		return en
	}
	n.fill(&out.Attr)
	return 0
}

// Holder is a Block that counts its openers (rnbd.Device): an open file of the device view
// is one until it is closed, so that a normal unmap_device refuses to unmap it. revoke is
// called if the device is unmapped all the same (nil: the file's IO then fails).
type Holder interface {
	Hold(who string, revoke func()) (release func(), err error)
}

// blockHandle is an open device file: the device it was opened on (a later map of the same
// name is another device) and its hold.
type blockHandle struct {
	b       Block
	release func()
	// dsync: opened with O_DSYNC or O_SYNC, so every write is FUA, durable when it
	// completes, as the kernel makes a block device's O_DSYNC direct writes. A write's
	// own RWF_DSYNC comes through syncWrites, a layer below the nodes (takeFUA).
	dsync bool
}

var _ fs.FileReleaser = (*blockHandle)(nil)

func (h *blockHandle) Release(ctx context.Context) syscall.Errno {
	if h.release != nil {
		h.release()
	}
	return 0
}

func (n *blockNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	h := &blockHandle{b: n.dev(), dsync: flags&syscall.O_DSYNC != 0}
	if hd, ok := h.b.(Holder); ok {
		rel, err := hd.Hold("device view file", nil)
		if err != nil {
			return nil, 0, errno.Of(err)
		}
		h.release = rel
	}
	// Parallel writes: without the flag the kernel holds the inode's lock across each
	// write, so the device file took one write at a time whatever the queue depth.
	return h, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES, 0
}

// blk is the device f was opened on; without a handle (a FUSE request that carries none),
// the node's current one.
func (n *blockNode) blk(f fs.FileHandle) Block {
	if h, ok := f.(*blockHandle); ok {
		return h.b
	}
	return n.dev()
}

// fua says whether a write through f, of context ctx, is to be durable when it completes:
// its file opened with O_DSYNC, or the write's own RWF_DSYNC. Either way it is written with
// FUA, and syncWrites is told so (no flush after it).
func fua(ctx context.Context, f fs.FileHandle) bool {
	own := takeFUA(ctx)
	h, ok := f.(*blockHandle)
	return own || ok && h.dsync
}

// ioCtx: device IO is bounded by the device's own reconnect timeout, not by FUSE interrupts.
func ioCtx() context.Context { return context.Background() }

func (n *blockNode) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	d := n.blk(f)
	size := d.Size()
	if off >= size {
		return fuse.ReadResultData(nil), 0
	}
	dest = dest[:min(int64(len(dest)), size-off)]
	bs := int64(d.BlockSize())
	start, end := off-off%bs, off+int64(len(dest))
	if end%bs != 0 {
		end += bs - end%bs
	}
	if start == off && end == off+int64(len(dest)) {
		if err := d.ReadAtContext(ioCtx(), dest, off); err != nil {
			return nil, errno.Of(err)
		}
		return fuse.ReadResultData(dest), 0
	}
	buf := make([]byte, end-start)
	if err := d.ReadAtContext(ioCtx(), buf, start); err != nil {
		return nil, errno.Of(err)
	}
	return fuse.ReadResultData(buf[off-start : off-start+int64(len(dest))]), 0
}

// Write writes data at off; a write across the end writes what fits (a short count), one at
// or past it gets ENOSPC, as a block device's.
func (n *blockNode) Write(ctx context.Context, f fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	d := n.blk(f)
	size := d.Size()
	switch {
	case len(data) == 0:
		return 0, 0
	case off >= size:
		return 0, syscall.ENOSPC
	}
	data = data[:min(int64(len(data)), size-off)]
	bs := int64(d.BlockSize())
	if off%bs == 0 && int64(len(data))%bs == 0 {
		n.mu.RLock()
		defer n.mu.RUnlock()
		if err := d.WriteAtContext(ioCtx(), data, off, fua(ctx, f)); err != nil {
			return 0, errno.Of(err)
		}
		return uint32(len(data)), 0
	}
	// Partial blocks: read the covering blocks, merge, write them back.
	n.mu.Lock()
	defer n.mu.Unlock()
	start, end := off-off%bs, off+int64(len(data))
	if end%bs != 0 {
		end += bs - end%bs
	}
	buf := make([]byte, end-start)
	if err := d.ReadAtContext(ioCtx(), buf, start); err != nil {
		return 0, errno.Of(err)
	}
	copy(buf[off-start:], data)
	if err := d.WriteAtContext(ioCtx(), buf, start, fua(ctx, f)); err != nil {
		return 0, errno.Of(err)
	}
	return uint32(len(data)), 0
}

// Zeroer is a Block that zeroes ranges without sending their data (rnbd.Device), for
// fallocate's zero range and punch hole, which a block device turns into write-zeroes.
type Zeroer interface {
	WriteZeroes(ctx context.Context, off, n int64, noUnmap bool) error
}

// Allocate is fallocate as on a block device: FALLOC_FL_ZERO_RANGE (with or without
// KEEP_SIZE) zeroes the range and keeps it allocated, PUNCH_HOLE|KEEP_SIZE zeroes it and
// lets the server deallocate it; other modes are EOPNOTSUPP. A range from or past the end
// is EINVAL, one across it too unless KEEP_SIZE (then cut at the end); it must be in whole
// logical blocks.
func (n *blockNode) Allocate(ctx context.Context, f fs.FileHandle, off uint64, size uint64, mode uint32) syscall.Errno {
	d := n.blk(f)
	z, ok := d.(Zeroer)
	if !ok {
		return syscall.EOPNOTSUPP
	}
	var noUnmap bool
	switch mode {
	case unix.FALLOC_FL_ZERO_RANGE, unix.FALLOC_FL_ZERO_RANGE | unix.FALLOC_FL_KEEP_SIZE:
		noUnmap = true
	case unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE:
	default:
		return syscall.EOPNOTSUPP
	}
	isize := uint64(d.Size())
	if off >= isize || size == 0 {
		return syscall.EINVAL
	}
	if size > isize-off {
		if mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			return syscall.EINVAL
		}
		size = isize - off
	}
	if bs := uint64(d.BlockSize()); (off|size)&(bs-1) != 0 {
		return syscall.EINVAL
	}
	// Beside whole-block writes, not inside a partial one's read, merge and write back.
	n.mu.RLock()
	defer n.mu.RUnlock()
	return errno.Of(z.WriteZeroes(ioCtx(), int64(off), int64(size), noUnmap))
}

func (n *blockNode) Fsync(ctx context.Context, f fs.FileHandle, flags uint32) syscall.Errno {
	d := n.blk(f)
	return errno.Of(d.Flush(ioCtx()))
}
