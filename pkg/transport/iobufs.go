package transport

import (
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// ioBufs is memory a user of the session passes as request data again and again (a ublk
// queue's tag buffers), registered on every path whose device stages data otherwise.
type ioBufs struct {
	buf    []byte
	stride int
	// released is closed once buf is unmapped.
	released chan struct{}
}

// AllocIOBuffers returns n bytes for request data, outside the Go heap, as regions of
// stride bytes (n a multiple of stride, stride at most MaxIOSize). On a device that maps
// only registered memory (verbs: rdma.DeviceAttr.MapRegisteredOnly), each region is
// registered on every path of the session, those that connect later included, and a
// request whose data begins a region goes out from it, and a READ lands in it, without
// the staging copy: the kernel client's way, which registers the pages it is given. The
// key a READ hands the server reaches that region only (at most MaxIOSize bytes), as a
// staged READ's reaches its permit's slot.
//
// Where no path of the session has staged data (the soft provider maps any memory), it
// returns nil and nothing to free: the caller's own memory serves as well. A path on which
// the regions fail to register (locked memory short, say) stages their requests, logged
// once a minute. Registered memory stays resident.
//
// free deregisters and unmaps; no request may use the memory by then. It returns a channel
// closed once the memory is unmapped: at once, unless a window is still bound over a region
// after unregisterWait. Such memory is kept until its last region deregisters, at the
// latest when its path closes; until then it is still the caller's to count.
func (s *Session) AllocIOBuffers(n, stride int) (buf []byte, free func() <-chan struct{}, err error) {
	if n <= 0 || stride <= 0 || n%stride != 0 || stride > s.maxIOSize {
		return nil, nil, fmt.Errorf("rtrs: IO buffers of %d bytes in regions of %d (at most %d each): %w", n, stride, s.maxIOSize, syscall.EINVAL)
	}
	s.umu.Lock()
	defer s.umu.Unlock()
	if !s.staging {
		return nil, nil, nil
	}
	s.releaseKept()
	if buf, err = rdma.Alloc(n); err != nil {
		return nil, nil, err
	}
	b := &ioBufs{buf: buf, stride: stride, released: make(chan struct{})}
	for res := range s.ures {
		if err := res.register(b); err != nil {
			// Once per allocation, and a user may allocate per connection (NBD's arenas).
			s.regFails.Warn(s.log, "IO buffers not registered", res.pd.Device().Name(), err.Error()+": their requests on that path are staged")
		}
	}
	s.iobufs = append(s.iobufs, b)
	var once sync.Once
	return buf, func() <-chan struct{} {
		once.Do(func() { s.freeIOBuffers(b) })
		return b.released
	}, nil
}

// unregisterWait bounds how long free waits for regions that a window is still bound over.
var unregisterWait = 5 * time.Second

func (s *Session) freeIOBuffers(b *ioBufs) {
	s.umu.Lock()
	s.iobufs = slices.DeleteFunc(s.iobufs, func(x *ioBufs) bool { return x == b })
	left := 0
	for res := range s.ures {
		left += res.unregister(b)
	}
	s.umu.Unlock()
	// A region is refused while a window is still bound over it: a READ's key whose
	// invalidation has not run yet, or a path whose teardown (which takes the windows
	// down, then retries what is parked) is under way. The memory is unmapped only once
	// no region holds it.
	for deadline := time.Now().Add(unregisterWait); left > 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		s.umu.Lock()
		left = 0
		for res := range s.ures {
			left += res.retryParked(b)
		}
		s.umu.Unlock()
	}
	if left > 0 {
		s.log.Warnf("%d regions of IO buffers still registered after %v: their %d bytes are kept until they deregister", left, unregisterWait, len(b.buf))
		s.umu.Lock()
		s.kept = append(s.kept, b)
		s.releaseKept()
		s.umu.Unlock()
		return
	}
	b.unmap(s)
}

// unmap gives b's memory back, every region of it deregistered.
func (b *ioBufs) unmap(s *Session) {
	if err := rdma.Free(b.buf); err != nil {
		s.log.WithError(err).Warn("IO buffers not unmapped")
	}
	close(b.released)
}

// releaseKept (s.umu held) tries again to deregister what kept IO buffers left parked, and
// unmaps each whose regions are all gone.
func (s *Session) releaseKept() {
	s.kept = slices.DeleteFunc(s.kept, func(b *ioBufs) bool {
		left := 0
		for res := range s.ures {
			left += res.retryParked(b)
		}
		if left > 0 {
			return false
		}
		s.log.Infof("kept IO buffers (%d bytes) unmapped: no window holds their regions any more, or their paths are gone", len(b.buf))
		b.unmap(s)
		return true
	})
}

// addStaging registers the session's IO buffers on a new path's resources, which stage
// data: a region that fails to register is staged on this path, as before.
func (s *Session) addStaging(p *Path, res *pathRes) {
	s.umu.Lock()
	defer s.umu.Unlock()
	if s.ures == nil {
		s.ures = map[*pathRes]struct{}{}
	}
	s.ures[res] = struct{}{}
	s.staging = true
	s.releaseKept()
	for _, b := range s.iobufs {
		if err := res.register(b); err != nil {
			p.lg().WithError(err).Warn("IO buffers not registered on this path: their requests are staged")
		}
	}
}

// dropStaging deregisters the IO buffers from a path's resources going away.
func (s *Session) dropStaging(res *pathRes) {
	s.umu.Lock()
	defer s.umu.Unlock()
	if _, ok := s.ures[res]; !ok {
		return
	}
	delete(s.ures, res)
	for _, b := range s.iobufs {
		res.unregister(b)
	}
	// The windows are gone by now: what they held up goes too.
	for _, m := range res.parked {
		if err := m.mr.Dereg(); err != nil {
			p := res.pd.Device().Name()
			s.log.WithError(err).Warnf("a region of IO buffers on %s not deregistered", p)
		}
	}
	res.parked = nil
	s.releaseKept()
}

// register registers b's regions on res (s.umu held), all or none.
func (res *pathRes) register(b *ioBufs) error {
	old := res.direct.Load()
	next := map[uintptr]rdma.MR{}
	if old != nil {
		for k, v := range *old {
			next[k] = v
		}
	}
	var added []rdma.MR
	for off := 0; off < len(b.buf); off += b.stride {
		m, err := res.pd.RegMR(b.buf[off:off+b.stride], rdma.AccessLocalWrite)
		if err != nil {
			for _, m := range added {
				_ = m.Dereg()
			}
			return err
		}
		added = append(added, m)
		next[uintptr(unsafe.Pointer(&b.buf[off]))] = m
	}
	res.direct.Store(&next)
	return nil
}

// unregister deregisters b's regions from res (s.umu held); those refused (a window still
// bound over them) are parked on res, and counted.
func (res *pathRes) unregister(b *ioBufs) (parked int) {
	old := res.direct.Load()
	if old == nil {
		return 0
	}
	next := map[uintptr]rdma.MR{}
	for k, v := range *old {
		next[k] = v
	}
	for off := 0; off < len(b.buf); off += b.stride {
		k := uintptr(unsafe.Pointer(&b.buf[off]))
		if m := next[k]; m != nil {
			delete(next, k)
			if m.Dereg() != nil {
				res.parked = append(res.parked, parkedMR{mr: m, of: b})
				parked++
			}
		}
	}
	res.direct.Store(&next)
	return parked
}

// parkedMR is a region of freed IO buffers that could not be deregistered yet.
type parkedMR struct {
	mr rdma.MR
	of *ioBufs
}

// retryParked tries again to deregister b's parked regions (s.umu held), and counts those
// still refused.
func (res *pathRes) retryParked(b *ioBufs) (left int) {
	keep := res.parked[:0]
	for _, m := range res.parked {
		if m.of == b && m.mr.Dereg() == nil {
			continue
		}
		if m.of == b {
			left++
		}
		keep = append(keep, m)
	}
	clear(res.parked[len(keep):])
	res.parked = keep
	return left
}

// directMR is the registered region data begins and fits in, if any.
func (res *pathRes) directMR(data []byte) rdma.MR {
	d := res.direct.Load()
	if d == nil {
		return nil
	}
	m := (*d)[uintptr(unsafe.Pointer(&data[0]))]
	if m == nil || len(data) > m.Len() {
		return nil
	}
	return m
}
