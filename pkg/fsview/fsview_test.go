package fsview

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/log"
)

// requireFUSE skips unless this process can mount (root and /dev/fuse).
func requireFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("FUSE mounts need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
}

// mount serves root in a temp dir for the test.
func mount(t *testing.T, root Dir) string {
	t.Helper()
	requireFUSE(t)
	dir := t.TempDir()
	srv, err := Mount(dir, root, MountOptions{Name: "fsview-test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Error(err)
		}
		srv.Wait()
	})
	return dir
}

func sh(t *testing.T, script string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "bash", "-c", script).CombinedOutput()
	return string(out), err
}

// testTree: a value file, a read-only file, an action that removes its own directory, and
// a store that blocks for a while.
type testTree struct {
	mu      sync.Mutex
	value   int
	removed bool
	stores  int
}

func (tt *testTree) Entries() []Entry {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	out := []Entry{
		{Name: "value", Attr: &Attr{Name: "value", Mode: 0o644,
			Show: func() string { tt.mu.Lock(); defer tt.mu.Unlock(); return fmt.Sprintf("%d\n", tt.value) },
			Store: func(v string) error {
				var n int
				if _, err := fmt.Sscanf(v, "%d", &n); err != nil || fmt.Sprint(n) != v {
					return syscall.EINVAL
				}
				tt.mu.Lock()
				tt.value = n
				tt.stores++
				tt.mu.Unlock()
				return nil
			}}},
		{Name: "ro", Attr: &Attr{Name: "ro", Mode: 0o444, Show: func() string { return "fixed\n" }}},
		{Name: "slow", Attr: &Attr{Name: "slow", Mode: 0o644, Show: func() string { return "Usage: echo 1 > slow\n" },
			Store: func(v string) error {
				time.Sleep(300 * time.Millisecond)
				tt.mu.Lock()
				tt.stores++
				tt.mu.Unlock()
				return nil
			}}},
	}
	if !tt.removed {
		out = append(out, Entry{Name: "sub", Dir: DirFunc(func() []Entry {
			return []Entry{{Name: "remove", Attr: &Attr{Name: "remove", Mode: 0o644,
				Show: func() string { return "Usage: echo 1 > remove\n" },
				Store: func(v string) error {
					if v != "1" {
						return syscall.EINVAL
					}
					tt.mu.Lock()
					tt.removed = true
					tt.mu.Unlock()
					return nil
				}}}}
		})})
	}
	return out
}

func TestAttrRules(t *testing.T) {
	leakcheck.Check(t)
	tt := &testTree{}
	dir := mount(t, tt)
	v := filepath.Join(dir, "value")
	for _, tc := range []struct{ script, want string }{
		{"cat " + v, "0\n"},
		{"echo 42 > " + v + " && cat " + v, "42\n"},
		{"printf 7 > " + v + " && cat " + v, "7\n"},       // no newline
		{"printf '8\\n' >> " + v + " && cat " + v, "8\n"}, // append: the offset is ignored
		{"cat " + filepath.Join(dir, "ro"), "fixed\n"},
		{"stat -c '%s %a %F' " + v, "4096 644 regular file\n"},
		{"stat -c '%s %a' " + filepath.Join(dir, "ro"), "4096 444\n"},
		{"ls " + dir, "ro\nslow\nsub\nvalue\n"},
	} {
		if got, err := sh(t, tc.script); err != nil || got != tc.want {
			t.Errorf("%s: %q %v, want %q", tc.script, got, err, tc.want)
		}
	}
	// Bad input: the errno reaches echo, the value stays, and the log says what and why.
	var logged syncBuffer
	if _, err := log.Setup(log.Options{Out: &logged}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = log.Setup(log.Options{Out: os.Stderr}) })
	out, err := sh(t, "echo 12x > "+v)
	if err == nil || !strings.Contains(out, "Invalid argument") {
		t.Errorf("bad write: %q %v", out, err)
	}
	if l := logged.String(); !strings.Contains(l, "control write refused") || !strings.Contains(l, "value") || !strings.Contains(l, "12x") {
		t.Errorf("the refused write's log: %q", l)
	}
	if got, _ := sh(t, "cat "+v); got != "8\n" {
		t.Errorf("value after a bad write %q", got)
	}
	// Only one trailing newline is stripped.
	if err := os.WriteFile(v, []byte("9\n\n"), 0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("two newlines: %v", err)
	}
	// Read-only files refuse write opens.
	if _, err := os.OpenFile(filepath.Join(dir, "ro"), os.O_WRONLY, 0); !errors.Is(err, syscall.EACCES) {
		t.Errorf("write open of a read-only file: %v", err)
	}
	// Every read at offset 0 renders anew, as sysfs's seq_file does: a file kept open and
	// read again from the start (pread at 0) shows the value of now; a read further on
	// continues what the read at 0 rendered.
	f, err := os.Open(v)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 16)
	for _, want := range []string{"5", "63"} {
		if _, err := sh(t, "echo "+want+" > "+v); err != nil {
			t.Fatal(err)
		}
		if n, err := f.ReadAt(b, 0); string(b[:n]) != want+"\n" {
			t.Errorf("pread at 0 after writing %s: %q %v", want, b[:n], err)
		}
	}
	if n, _ := f.ReadAt(b[:1], 0); n != 1 || b[0] != '6' {
		t.Fatalf("first byte %q", b[:n])
	}
	if _, err := sh(t, "echo 7 > "+v); err != nil {
		t.Fatal(err)
	}
	if n, _ := f.ReadAt(b, 1); string(b[:n]) != "3\n" {
		t.Errorf("a read past 0 after a change: %q, want the rest of the render at 0", b[:n])
	}
	// An action removes its own directory: it is gone at once.
	if out, err := sh(t, "echo 1 > "+filepath.Join(dir, "sub", "remove")); err != nil {
		t.Fatalf("remove: %q %v", out, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "sub")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("removed dir still there: %v", err)
	}
	if got, _ := sh(t, "ls "+dir); got != "ro\nslow\nvalue\n" {
		t.Errorf("listing after remove %q", got)
	}
}

// TestBlockingStoreInterrupted: a signal to the writer does not run the action twice or cut
// it short.
func TestBlockingStoreInterrupted(t *testing.T) {
	leakcheck.Check(t)
	tt := &testTree{}
	dir := mount(t, tt)
	cmd := exec.Command("sh", "-c", "echo 1 > "+filepath.Join(dir, "slow"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	_ = cmd.Process.Signal(syscall.SIGINT)
	_ = cmd.Wait()
	time.Sleep(400 * time.Millisecond)
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if tt.stores != 1 {
		t.Fatalf("the store ran %d times", tt.stores)
	}
}

type memBlock struct {
	mu      sync.Mutex
	b       []byte
	flushes int
}

func (m *memBlock) Size() int64    { return int64(len(m.b)) }
func (m *memBlock) BlockSize() int { return 512 }
func (m *memBlock) ReadAtContext(_ context.Context, p []byte, off int64) error {
	if off%512 != 0 || len(p)%512 != 0 {
		return syscall.EINVAL
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(p, m.b[off:])
	return nil
}
func (m *memBlock) WriteAtContext(_ context.Context, p []byte, off int64, _ bool) error {
	if off%512 != 0 || len(p)%512 != 0 {
		return syscall.EINVAL
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(m.b[off:], p)
	return nil
}
func (m *memBlock) Flush(context.Context) error { m.mu.Lock(); m.flushes++; m.mu.Unlock(); return nil }

func TestBlockFile(t *testing.T) {
	leakcheck.Check(t)
	mb := &memBlock{b: make([]byte, 1<<20)}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: mb}} }))
	dev := filepath.Join(dir, "dev")
	src := filepath.Join(t.TempDir(), "src")
	data := make([]byte, 256<<10)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := sh(t, fmt.Sprintf("dd if=%s of=%s bs=64k seek=1 conv=notrunc,fsync status=none", src, dev)); err != nil {
		t.Fatalf("dd: %s %v", out, err)
	}
	mb.mu.Lock()
	ok, fl := string(mb.b[64<<10:64<<10+len(data)]) == string(data), mb.flushes
	mb.mu.Unlock()
	if !ok || fl == 0 {
		t.Fatalf("dd wrote wrong data or did not flush (%d)", fl)
	}
	// Unaligned write and read through the page-less path.
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("hello"), 1000); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 7)
	if _, err := f.ReadAt(b, 999); err != nil || string(b[1:6]) != "hello" {
		t.Fatalf("unaligned read %q %v", b, err)
	}
	if st, err := f.Stat(); err != nil || st.Size() != 1<<20 {
		t.Fatalf("size %v %v", st, err)
	}
	if _, err := f.WriteAt(make([]byte, 512), 1<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the end: %v", err)
	}
	// Across the end: what fits is written, and the count says so, as on a block device.
	tail := bytes.Repeat([]byte{0xee}, 4096)
	if n, err := syscall.Pwrite(int(f.Fd()), tail, 1<<20-2048); n != 2048 || err != nil {
		t.Fatalf("write across the end: %d, %v; want 2048", n, err)
	}
	mb.mu.Lock()
	ok = bytes.Equal(mb.b[1<<20-2048:], tail[:2048])
	mb.mu.Unlock()
	if !ok {
		t.Fatal("the part of a write across the end that fits not written")
	}
	// An empty write anywhere, past the end too, writes nothing and fails nothing (the node
	// called directly: the kernel may not pass one on).
	if n, en := (&blockNode{b: mb}).Write(context.Background(), nil, nil, 2<<20); n != 0 || en != 0 {
		t.Fatalf("an empty write past the end: %d, %v", n, en)
	}
}

// zeroBlock is a memBlock that zeroes ranges itself (fsview.Zeroer), recording how.
type zeroBlock struct {
	memBlock
	calls []string
}

func (z *zeroBlock) WriteZeroes(_ context.Context, off, n int64, noUnmap bool) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	clear(z.b[off : off+n])
	z.calls = append(z.calls, fmt.Sprintf("%d+%d noUnmap=%v", off, n, noUnmap))
	return nil
}

// TestBlockFallocate: fallocate on a device file is write-zeroes as on a block device:
// zero range keeps the blocks allocated, punch hole (with keep size) lets them go, a range
// across the end is cut with keep size and EINVAL without, unaligned ranges are EINVAL and
// other modes EOPNOTSUPP, each leaving the data as it was.
func TestBlockFallocate(t *testing.T) {
	leakcheck.Check(t)
	zb := &zeroBlock{memBlock: memBlock{b: bytes.Repeat([]byte{1}, 1<<20)}}
	dir := mount(t, DirFunc(func() []Entry { return []Entry{{Name: "dev", Block: zb}} }))
	f, err := os.OpenFile(filepath.Join(dir, "dev"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	for _, c := range []struct {
		mode      uint32
		off, n    int64
		want      error
		wantCalls string
	}{
		{unix.FALLOC_FL_ZERO_RANGE, 4096, 8192, nil, "4096+8192 noUnmap=true"},
		{unix.FALLOC_FL_ZERO_RANGE | unix.FALLOC_FL_KEEP_SIZE, 0, 512, nil, "0+512 noUnmap=true"},
		{unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE, 65536, 4096, nil, "65536+4096 noUnmap=false"},
		{unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE, 1<<20 - 1024, 4096, nil, "1047552+1024 noUnmap=false"},
		{unix.FALLOC_FL_ZERO_RANGE, 1<<20 - 1024, 4096, syscall.EINVAL, ""},
		{unix.FALLOC_FL_ZERO_RANGE | unix.FALLOC_FL_KEEP_SIZE, 1 << 20, 512, syscall.EINVAL, ""},
		{unix.FALLOC_FL_ZERO_RANGE, 100, 512, syscall.EINVAL, ""},
		{0, 0, 4096, syscall.EOPNOTSUPP, ""},
		{unix.FALLOC_FL_KEEP_SIZE, 0, 4096, syscall.EOPNOTSUPP, ""},
	} {
		zb.mu.Lock()
		zb.calls = nil
		zb.mu.Unlock()
		err := unix.Fallocate(fd, c.mode, c.off, c.n)
		zb.mu.Lock()
		calls := strings.Join(zb.calls, ", ")
		zb.mu.Unlock()
		if !errors.Is(err, c.want) && !(c.want == nil && err == nil) || calls != c.wantCalls {
			t.Errorf("fallocate mode %#x %d+%d: %v, zeroed %q; want %v, %q", c.mode, c.off, c.n, err, calls, c.want, c.wantCalls)
		}
	}
	zb.mu.Lock()
	defer zb.mu.Unlock()
	if !bytes.Equal(zb.b[4096:12288], make([]byte, 8192)) || zb.b[12288] != 1 || zb.b[4095] != 1 || zb.b[512] != 1 || zb.b[511] != 0 {
		t.Fatal("the zeroed range not zero, or more than it zeroed")
	}
}

// TestPermissions: other users read the tree but cannot write a control file.
func TestPermissions(t *testing.T) {
	leakcheck.Check(t)
	tt := &testTree{}
	dir := mount(t, tt)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	if err := os.Chmod(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	as := func(script string) (string, error) {
		return sh(t, "setpriv --reuid=65534 --regid=65534 --clear-groups bash -c '"+script+"'")
	}
	if out, err := as("cat " + dir + "/value"); err != nil || out != "0\n" {
		t.Fatalf("read as nobody: %q %v", out, err)
	}
	if out, err := as("echo 3 > " + dir + "/value"); err == nil || !strings.Contains(out, "Permission denied") {
		t.Fatalf("write as nobody: %q %v", out, err)
	}
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if tt.value != 0 {
		t.Fatalf("value %d after a refused write", tt.value)
	}
}

// TestRemoveRefused: rm, rmdir, mkdir, mv, ln, mknod, chmod and chown in a tree fail with
// EPERM (creating a file: EACCES), as in sysfs, and change nothing: what a file or directory shows goes only through the control files.
func TestRemoveRefused(t *testing.T) {
	leakcheck.Check(t)
	tt := &testTree{}
	dir := mount(t, tt)
	for _, name := range []string{"value", "sub/remove"} {
		if err := syscall.Unlink(dir + "/" + name); err != syscall.EPERM {
			t.Errorf("unlink %s: %v, want EPERM", name, err)
		}
	}
	if err := syscall.Rmdir(dir + "/sub"); err != syscall.EPERM {
		t.Errorf("rmdir sub: %v, want EPERM", err)
	}
	if err := syscall.Mkdir(dir+"/new", 0o755); err != syscall.EPERM {
		t.Errorf("mkdir: %v, want EPERM", err)
	}
	if err := syscall.Rename(dir+"/value", dir+"/other"); err != syscall.EPERM {
		t.Errorf("rename: %v, want EPERM", err)
	}
	// A name the tree lacks (a typo) is EACCES, as sysfs says, not "read-only file system";
	// links and nodes are EPERM; a chmod or chown fails visibly instead of changing nothing.
	if err := os.WriteFile(dir+"/valeu", []byte("1"), 0o644); !errors.Is(err, syscall.EACCES) {
		t.Errorf("create: %v, want EACCES", err)
	}
	if err := syscall.Symlink("value", dir+"/link"); err != syscall.EPERM {
		t.Errorf("symlink: %v, want EPERM", err)
	}
	if err := syscall.Link(dir+"/value", dir+"/hard"); err != syscall.EPERM {
		t.Errorf("link: %v, want EPERM", err)
	}
	if err := syscall.Mknod(dir+"/node", syscall.S_IFIFO|0o600, 0); err != syscall.EPERM {
		t.Errorf("mknod: %v, want EPERM", err)
	}
	for _, name := range []string{"value", "sub"} {
		if err := syscall.Chmod(dir+"/"+name, 0o666); err != syscall.EPERM {
			t.Errorf("chmod %s: %v, want EPERM", name, err)
		}
		if err := syscall.Chown(dir+"/"+name, 65534, 65534); err != syscall.EPERM {
			t.Errorf("chown %s: %v, want EPERM", name, err)
		}
	}
	if out, err := sh(t, "stat -c %a "+dir+"/value"); err != nil || out != "644\n" {
		t.Errorf("mode after a refused chmod: %q %v", out, err)
	}
	if out, err := sh(t, "rm -rf "+dir+"/sub"); err == nil || !strings.Contains(out, "Operation not permitted") {
		t.Fatalf("rm -rf sub: %q %v", out, err)
	}
	if out, err := sh(t, "ls "+dir+" "+dir+"/sub"); err != nil || !strings.Contains(out, "remove") || !strings.Contains(out, "value") {
		t.Fatalf("after the refused rm -rf the tree holds %q (%v)", out, err)
	}
	if b, err := os.ReadFile(dir + "/value"); err != nil || string(b) != "0\n" {
		t.Fatalf("value after the refused removals: %q %v", b, err)
	}
}

// syncBuffer is a bytes.Buffer safe for the logger's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// Cleanup says whether it detached something, so -cleanup can tell the operator.
func TestCleanupReports(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	srv, err := Mount(dir, &testTree{}, MountOptions{Name: "fsview-test"})
	if err != nil {
		t.Fatal(err)
	}
	// -cleanup leaves a tree that answers alone.
	if err := CleanupReport(dir); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("-cleanup of a live tree: %v, want EBUSY", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "value")); err != nil {
		t.Fatalf("the live tree after -cleanup: %v", err)
	}
	if detached, err := Cleanup(dir); !detached || err != nil {
		t.Fatalf("cleanup of a mounted tree: %v %v", detached, err)
	}
	srv.Wait() // the detach ends the server
	if detached, err := Cleanup(dir); detached || err != nil {
		t.Fatalf("cleanup with nothing mounted: %v %v", detached, err)
	}
}

// A copy of the mount in another mount namespace keeps the FUSE connection after the
// unmount: Unmount aborts it after UnmountGrace instead of waiting for ever (a daemon that
// never stopped on SIGTERM).
func TestUnmountWithCopyElsewhere(t *testing.T) {
	requireFUSE(t)
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Fatal("unshare (util-linux) is needed")
	}
	dir := t.TempDir()
	m, err := Mount(dir, &testTree{}, MountOptions{Name: "fsview-test"})
	if err != nil {
		t.Fatal(err)
	}
	// A process in a private copy of this mount namespace, holding the tree's mount.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder := exec.CommandContext(ctx, "unshare", "-m", "--propagation", "private", "sh", "-c", "cat "+dir+"/value && echo ready && exec sleep 60")
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); _ = holder.Wait() }()
	buf := make([]byte, 256)
	got := ""
	for !strings.Contains(got, "ready") {
		n, err := out.Read(buf)
		if err != nil {
			t.Fatalf("holder: %v (%q)", err, got)
		}
		got += string(buf[:n])
	}
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- m.Unmount() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
		// Only the abort ends it: the connection outlived the unmount for the whole grace.
		if took := time.Since(start); took < UnmountGrace {
			t.Fatalf("unmounted in %v: the other namespace's copy did not hold the connection, so the abort was not tested", took)
		}
	case <-time.After(3 * UnmountGrace):
		t.Fatal("Unmount still waiting for the FUSE connection that the other namespace holds")
	}
	if _, err := os.Stat(dir + "/value"); err == nil {
		t.Fatal("the tree is still served here")
	}
}

// A second Mount at a mount point whose tree is alive is refused (EBUSY) and leaves that tree
// served; a dead one (its server gone) is detached and mounted over.
func TestMountOverLiveTreeRefused(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	first, err := Mount(dir, &testTree{}, MountOptions{Name: "fsview-test"})
	if err != nil {
		t.Fatal(err)
	}
	if m, err := Mount(dir, &testTree{}, MountOptions{Name: "fsview-test"}); !errors.Is(err, syscall.EBUSY) {
		if m != nil {
			_ = m.Unmount()
		}
		t.Fatalf("second Mount over a live tree: %v, want EBUSY", err)
	}
	if _, err := os.ReadFile(dir + "/value"); err != nil {
		t.Fatalf("the first tree after the refused Mount: %v", err)
	}
	if err := first.Unmount(); err != nil {
		t.Fatal(err)
	}
}

// TestClipped: a refused write's reason is logged whole up to maxLoggedError bytes, cut
// beyond with its length said, never splitting a character.
func TestClipped(t *testing.T) {
	if got := clipped("short", 8); got != "short" {
		t.Errorf("short: %q", got)
	}
	long := strings.Repeat("x", 1<<20)
	if got := clipped(long, maxLoggedError); len(got) > maxLoggedError+64 || !strings.HasSuffix(got, "(1048576 bytes in all)") {
		t.Errorf("a megabyte: %d bytes, ends %q", len(got), got[len(got)-30:])
	}
	if got := clipped("ab€", 3); got != "ab… (5 bytes in all)" {
		t.Errorf("cut inside a character: %q", got)
	}
}

// TestUnmountBusy: an unmount while a process works inside the tree fails with EBUSY itself
// (no fusermount fallback whose "not found" would hide why), and succeeds once it has gone.
func TestUnmountBusy(t *testing.T) {
	requireFUSE(t)
	leakcheck.Check(t)
	dir := t.TempDir()
	srv, err := Mount(dir, &testTree{}, MountOptions{Name: "fsview-test"})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "30")
	cmd.Dir = dir
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	err = srv.Unmount()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if !errors.Is(err, syscall.EBUSY) {
		t.Errorf("unmount with a process inside: %v, want EBUSY", err)
	}
	if err := srv.Unmount(); err != nil {
		t.Fatalf("unmount once it left: %v", err)
	}
	srv.Wait()
}
