package nbd

import (
	"fmt"
	"sync"
	"unsafe"
)

// BufferDevice is an AsyncDevice whose transport sends request data from, and lands it in,
// memory it hands out without a copy through a stage (RNBD over verbs, where only
// registered memory reaches the HCA): a connection serves its reads and writes from an
// arena of that memory, and a request's data then moves once between the socket and the
// wire's memory, not twice.
type BufferDevice interface {
	AsyncDevice
	// MaxIO is the most data one piece of a request carries: longer requests are split at
	// it, and each piece skips the stage only if it begins one of the arena's regions.
	MaxIO() int
	// AllocIOBuffers returns n bytes in regions of stride bytes, and how to free them once
	// no request uses them; nil memory where any memory serves as well. free returns a
	// channel closed once the memory is given back, which may be later than free returns
	// (a region the transport could not deregister yet).
	AllocIOBuffers(n, stride int) (buf []byte, free func() <-chan struct{}, err error)
}

// arena hands out runs of whole slots of a connection's device memory, first fit: a
// request of k slots' bytes gets k consecutive slots, so each MaxIO piece of it begins a
// region. A request that finds no run free takes memory of its own, which is staged.
type arena struct {
	mu   sync.Mutex
	buf  []byte
	slot int
	used []bool
	free func() <-chan struct{}
}

// newArena takes an arena for a connection to export name from d, within the server's
// MaxArenaMemory: MaxInflight slots of d's MaxIO, no more than MaxConnMemory. nil where d
// has none to give (the soft provider's paths take any memory), past the bound, or if the
// allocation fails (logged): the pools serve then.
func (s *Server) newArena(d BufferDevice, name string) *arena {
	slot := d.MaxIO()
	if slot <= 0 || s.arenaMem.Limit() < 0 {
		return nil
	}
	slots := int(min(int64(s.opts.MaxInflight), s.opts.MaxConnMemory/int64(slot)))
	size := int64(slots) * int64(slot)
	if !s.arenaMem.Reserve(size) {
		s.refusals.Warn(s.log, "no registered memory", name, fmt.Sprintf("the connections' arenas hold %d MiB, the bound (MaxArenaMemory): this connection's data is copied through the transport's stage", s.opts.MaxArenaMemory>>20))
		return nil
	}
	buf, free, err := d.AllocIOBuffers(int(size), slot)
	if err != nil || buf == nil {
		s.arenaMem.Cancel(size)
		if err != nil {
			s.log.WithError(err).Warnf("nbd: export %q: no memory from its device for a connection's requests: their data is staged", name)
		}
		return nil
	}
	return &arena{buf: buf, slot: slot, used: make([]bool, slots), free: free}
}

// closeArena frees a connection's arena, once every request of it is over. Memory its
// device keeps past the free counts against MaxArenaMemory until it is given back.
func (s *Server) closeArena(a *arena) {
	s.arenaMem.ReleaseWhen(int64(len(a.buf)), a.free())
}

// get returns n bytes beginning a run of slots, or nil if no run of that length is free.
func (a *arena) get(n int) []byte {
	k := (n + a.slot - 1) / a.slot
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, run := 0, 0; i < len(a.used); i++ {
		if a.used[i] {
			run = 0
			continue
		}
		if run++; run == k {
			first := i - k + 1
			for j := first; j <= i; j++ {
				a.used[j] = true
			}
			return a.buf[first*a.slot : first*a.slot+n : first*a.slot+n]
		}
	}
	return nil
}

// put takes b back if it is the arena's, and says whether it was.
func (a *arena) put(b []byte) bool {
	if cap(b) == 0 {
		return false
	}
	start := uintptr(unsafe.Pointer(&a.buf[0]))
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	if p < start || p >= start+uintptr(len(a.buf)) {
		return false
	}
	first := int(p-start) / a.slot
	k := (cap(b) + a.slot - 1) / a.slot
	a.mu.Lock()
	for j := first; j < first+k; j++ {
		a.used[j] = false
	}
	a.mu.Unlock()
	return true
}
