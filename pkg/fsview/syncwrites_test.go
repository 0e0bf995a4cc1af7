package fsview

import (
	"strings"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// fakeRaw is a FUSE file system that opens with the handle number it is given and records
// writes and fsyncs.
type fakeRaw struct {
	fuse.RawFileSystem
	fh      uint64
	ops     []string
	fsyncSt fuse.Status
}

func (f *fakeRaw) Open(_ <-chan struct{}, _ *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	out.Fh = f.fh
	return fuse.OK
}

func (f *fakeRaw) Release(<-chan struct{}, *fuse.ReleaseIn) {}

func (f *fakeRaw) Write(_ <-chan struct{}, _ *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	f.ops = append(f.ops, "write")
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

// TestSyncWritesHandles: syncWrites knows a handle opened with O_DSYNC (its writes are FUA:
// no flush) only until it is released, so a later open given the same number is flushed
// after a dsync write; an open without a handle (number 0) is never taken for one; a failed
// flush fails the write, ENOTSUP included; nothing is kept after the releases.
func TestSyncWritesHandles(t *testing.T) {
	raw := &fakeRaw{RawFileSystem: fuse.NewDefaultRawFileSystem(), fsyncSt: fuse.OK}
	s := newSyncWrites(raw)
	write := func(fh uint64, flags uint32) (uint32, fuse.Status) {
		return s.Write(nil, &fuse.WriteIn{Fh: fh, Flags: flags}, make([]byte, 512))
	}
	open := func(fh uint64, flags uint32) {
		raw.fh = fh
		if st := s.Open(nil, &fuse.OpenIn{Flags: flags}, &fuse.OpenOut{}); st != fuse.OK {
			t.Fatal(st)
		}
	}
	dsync := uint32(syscall.O_WRONLY | syscall.O_DSYNC)

	open(5, dsync)
	if _, st := write(5, dsync); st != fuse.OK || raw.take() != "write" {
		t.Fatalf("a write to a file opened O_DSYNC: %v, want a write and no flush (it is FUA)", st)
	}
	s.Release(nil, &fuse.ReleaseIn{Fh: 5})
	open(5, syscall.O_WRONLY)
	if _, st := write(5, syscall.O_WRONLY); st != fuse.OK || raw.take() != "write" {
		t.Fatalf("a plain write: %v, want a write and no flush", st)
	}
	if _, st := write(5, dsync); st != fuse.OK || raw.take() != "write, fsync" {
		t.Fatalf("RWF_DSYNC on handle 5 opened again without O_DSYNC: %v, want a write, then a flush", st)
	}
	s.Release(nil, &fuse.ReleaseIn{Fh: 5})

	open(0, dsync)
	if _, st := write(0, dsync); st != fuse.OK || raw.take() != "write, fsync" {
		t.Fatalf("a dsync write without a handle: %v, want a write, then a flush", st)
	}
	for _, st := range []fuse.Status{fuse.EIO, fuse.ENOTSUP} {
		raw.fsyncSt = st
		if n, got := write(7, dsync); got != st || n != 0 || raw.take() != "write, fsync" {
			t.Fatalf("flush failing with %v: the write gave %d, %v", st, n, got)
		}
	}
	if len(s.opened) != 0 {
		t.Fatalf("%d handles kept after their releases", len(s.opened))
	}
}
