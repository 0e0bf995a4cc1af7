package fsview

import (
	"strings"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// fakeRaw is a FUSE file system that records writes and fsyncs; with takes, its writes take
// a durable write as FUA, as a device file's node does.
type fakeRaw struct {
	fuse.RawFileSystem
	takes   bool
	panics  bool
	ops     []string
	fsyncSt fuse.Status
}

func (f *fakeRaw) Write(cancel <-chan struct{}, _ *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if f.panics {
		panic("a node's bug")
	}
	if f.takes && takeFUA(&fuse.Context{Cancel: cancel}) {
		f.ops = append(f.ops, "write FUA")
	} else {
		f.ops = append(f.ops, "write")
	}
	return uint32(len(data)), fuse.OK
}

func (f *fakeRaw) Fsync(<-chan struct{}, *fuse.FsyncIn) fuse.Status {
	f.ops = append(f.ops, "fsync")
	return f.fsyncSt
}

func (f *fakeRaw) take() string {
	out := strings.Join(f.ops, ", ")
	f.ops = nil
	return out
}

// TestSyncWritesFUA: a durable write (O_DSYNC or O_SYNC in its flags) that the node takes as
// FUA is not flushed after; one the node writes plainly is, and so is one without a request
// channel; a plain write is never marked; a failed flush fails the write, ENOTSUP included;
// a request's mark is gone when it is answered, so the channel's next request is plain.
func TestSyncWritesFUA(t *testing.T) {
	raw := &fakeRaw{RawFileSystem: fuse.NewDefaultRawFileSystem(), fsyncSt: fuse.OK}
	s := newSyncWrites(raw)
	cancel := make(chan struct{})
	write := func(c <-chan struct{}, flags uint32) (uint32, fuse.Status) {
		return s.Write(c, &fuse.WriteIn{Fh: 5, Flags: flags}, make([]byte, 512))
	}
	dsync := uint32(syscall.O_WRONLY | syscall.O_DSYNC)
	for _, tc := range []struct {
		name  string
		takes bool
		c     <-chan struct{}
		flags uint32
		want  string
	}{
		{"plain, a node that takes FUA", true, cancel, syscall.O_WRONLY, "write"},
		{"O_DSYNC, a node that takes FUA", true, cancel, dsync, "write FUA"},
		{"O_SYNC, a node that takes FUA", true, cancel, syscall.O_WRONLY | syscall.O_SYNC, "write FUA"},
		{"O_DSYNC, no request channel", true, nil, dsync, "write, fsync"},
		{"O_DSYNC, a node that writes plainly", false, cancel, dsync, "write, fsync"},
		{"plain, a node that writes plainly", false, cancel, syscall.O_WRONLY, "write"},
	} {
		raw.takes = tc.takes
		if n, st := write(tc.c, tc.flags); st != fuse.OK || n != 512 {
			t.Fatalf("%s: %d, %v", tc.name, n, st)
		}
		if got := raw.take(); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	// The channel's mark went with its request: a context of it is no durable write now.
	if takeFUA(&fuse.Context{Cancel: cancel}) {
		t.Fatal("a request's mark outlived its answer")
	}
	raw.takes = false
	for _, st := range []fuse.Status{fuse.EIO, fuse.ENOTSUP} {
		raw.fsyncSt = st
		if n, got := write(cancel, dsync); got != st || n != 0 || raw.take() != "write, fsync" {
			t.Fatalf("flush failing with %v: the write gave %d, %v", st, n, got)
		}
	}
	// A node that panics (go-fuse recovers above syncWrites) leaves no mark behind for the
	// channel's next request.
	raw.panics, raw.fsyncSt = true, fuse.OK
	func() {
		defer func() { _ = recover() }()
		_, _ = write(cancel, dsync)
	}()
	raw.panics, raw.takes = false, true
	raw.take()
	if _, st := write(cancel, syscall.O_WRONLY); st != fuse.OK || raw.take() != "write" {
		t.Fatalf("a plain write after a durable one whose node panicked: %v, want a plain write", st)
	}
	// A channel some other request in flight holds: the second write is flushed although
	// its node wrote FUA, and that FUA is credited to neither, so the first is flushed too
	// (its node finds no mark of its own any more).
	other, forget := s.mark(cancel)
	if _, st := write(cancel, dsync); st != fuse.OK || raw.take() != "write FUA, fsync" {
		t.Fatalf("a durable write on a channel in use: %v, want the write, then a flush", st)
	}
	if other.Load() {
		t.Fatal("one request's FUA was credited to another that held the channel")
	}
	forget()
	kept := 0
	fuaWrites.Range(func(any, any) bool { kept++; return true })
	if kept != 0 {
		t.Fatalf("%d durable writes still marked after their answers", kept)
	}
}
