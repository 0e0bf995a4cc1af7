package fsview

import (
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/rtrs-go/rtrs/pkg/log"
)

// syncFlags are the open flags that make a write durable when it returns.
const syncFlags = syscall.O_DSYNC | syscall.O_SYNC

// syncWrites is the tree's FUSE file system with a write's own RWF_DSYNC or RWF_SYNC
// (pwritev2) kept. The kernel sends such a write with O_DSYNC or O_SYNC in its FUSE flags,
// and go-fuse's node API hands a node only the data and the offset: here a write that carries
// the flag on a file not opened with it is followed by a flush of the file (its device)
// before it is answered, as the kernel's block layer flushes after a dsync write where it
// cannot use FUA. A file opened with the flag writes with FUA already (blockHandle.dsync).
type syncWrites struct {
	fuse.RawFileSystem
	mu     sync.Mutex
	opened map[uint64]bool // FUSE handles of files opened with O_DSYNC or O_SYNC
}

func newSyncWrites(fs fuse.RawFileSystem) *syncWrites {
	return &syncWrites{RawFileSystem: fs, opened: map[uint64]bool{}}
}

func (s *syncWrites) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := s.RawFileSystem.Open(cancel, in, out)
	// Handle 0 is every open without a handle of its own: never taken as one that writes FUA.
	if st == fuse.OK && in.Flags&syncFlags != 0 && out.Fh != 0 {
		s.mu.Lock()
		s.opened[out.Fh] = true
		s.mu.Unlock()
	}
	return st
}

func (s *syncWrites) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	// Forgotten before the handle is freed: the next open may be given the same number.
	s.mu.Lock()
	delete(s.opened, in.Fh)
	s.mu.Unlock()
	s.RawFileSystem.Release(cancel, in)
}

func (s *syncWrites) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	n, st := s.RawFileSystem.Write(cancel, in, data)
	return s.synced(cancel, in, n, st)
}

func (s *syncWrites) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	n, st := s.RawFileSystem.Writev(cancel, in, data)
	return s.synced(cancel, in, n, st)
}

// synced flushes after a successful write that asked to be durable, unless its file writes
// with FUA. A failed flush fails the write: its data may not be on stable storage.
func (s *syncWrites) synced(cancel <-chan struct{}, in *fuse.WriteIn, n uint32, st fuse.Status) (uint32, fuse.Status) {
	if st != fuse.OK || in.Flags&syncFlags == 0 {
		return n, st
	}
	s.mu.Lock()
	fua := s.opened[in.Fh]
	s.mu.Unlock()
	if fua {
		return n, st
	}
	// Every file that takes writes has an fsync (a control file's does nothing, as sysfs's):
	// any error, ENOTSUP included, is the device's.
	if fst := s.RawFileSystem.Fsync(cancel, &fuse.FsyncIn{InHeader: in.InHeader, Fh: in.Fh, FsyncFlags: 1}); fst != fuse.OK {
		log.L.WithFields(log.Fields{"component": "fsview", "node": in.NodeId, "offset": in.Offset, "size": in.Size, "errno": fst.String()}).
			Warn("the flush after a write with RWF_DSYNC failed: the write fails")
		return 0, fst
	}
	return n, st
}
