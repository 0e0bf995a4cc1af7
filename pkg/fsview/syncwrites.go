package fsview

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/rtrs-go/rtrs/pkg/log"
)

// syncFlags are the flags that make a write durable when it returns. The kernel sends a
// write with the file's open flags and, for a write of its own RWF_DSYNC or RWF_SYNC
// (pwritev2, or an AIO's), O_DSYNC or O_SYNC added.
const syncFlags = syscall.O_DSYNC | syscall.O_SYNC

// syncWrites is the tree's FUSE file system with a durable write's flag kept. go-fuse's node
// API hands a node's Write only the data and the offset, so a write that carries the flag is
// marked here, by its request's cancel channel (go-fuse gives every request in flight its own
// and passes it to the node in the write's context), for the node to take as FUA
// (takeFUA): a device file writes it with FUA, as the kernel's block device does a direct
// dsync write. A write that no node took that way is followed by a flush of its file before
// it is answered.
type syncWrites struct {
	fuse.RawFileSystem
}

func newSyncWrites(fs fuse.RawFileSystem) *syncWrites {
	return &syncWrites{RawFileSystem: fs}
}

// fuaWrites holds the durable writes in flight: their cancel channel → whether a node took
// the write as FUA. Package-wide, since a channel is one request's whatever its mount.
var fuaWrites sync.Map

// takeFUA says whether the write whose context ctx is asked to be durable, and records that
// the caller writes it with FUA, so that no flush follows.
func takeFUA(ctx context.Context) bool {
	c, ok := ctx.(*fuse.Context)
	if !ok || c.Cancel == nil {
		return false
	}
	v, ok := fuaWrites.Load(c.Cancel)
	if !ok {
		return false
	}
	v.(*atomic.Bool).Store(true)
	return true
}

func (s *syncWrites) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if in.Flags&syncFlags == 0 {
		return s.RawFileSystem.Write(cancel, in, data)
	}
	taken, forget := s.mark(cancel)
	defer forget() // also if the node panics (go-fuse recovers above us)
	n, st := s.RawFileSystem.Write(cancel, in, data)
	return s.synced(cancel, in, taken, n, st)
}

func (s *syncWrites) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if in.Flags&syncFlags == 0 {
		return s.RawFileSystem.Writev(cancel, in, data)
	}
	taken, forget := s.mark(cancel)
	defer forget() // also if the node panics (go-fuse recovers above us)
	n, st := s.RawFileSystem.Writev(cancel, in, data)
	return s.synced(cancel, in, taken, n, st)
}

// mark records a durable write in flight, and returns what its node sets when it takes the
// write as FUA and what forgets the record: before the answer, since the request, and so its
// channel, is reused after it. Without a channel (never from go-fuse's server) no node can
// take the write as FUA, and it is flushed. A channel some other request in flight holds
// (go-fuse never makes one) is marked shared: a node still writes FUA on it, but neither
// request is credited, so both are flushed.
func (s *syncWrites) mark(cancel <-chan struct{}) (*atomic.Bool, func()) {
	taken := new(atomic.Bool)
	if cancel == nil {
		return taken, func() {}
	}
	if _, held := fuaWrites.LoadOrStore(cancel, taken); held {
		fuaWrites.Store(cancel, sharedMark)
		return taken, func() { fuaWrites.CompareAndDelete(cancel, sharedMark) }
	}
	return taken, func() { fuaWrites.CompareAndDelete(cancel, taken) }
}

// sharedMark marks a channel two durable writes held at once: what a node records on it
// credits neither.
var sharedMark = new(atomic.Bool)

// synced ends a durable write: unless a node wrote it with FUA, its file is flushed. A
// failed flush fails the write: its data may not be on stable storage.
func (s *syncWrites) synced(cancel <-chan struct{}, in *fuse.WriteIn, taken *atomic.Bool, n uint32, st fuse.Status) (uint32, fuse.Status) {
	if st != fuse.OK || taken.Load() {
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
