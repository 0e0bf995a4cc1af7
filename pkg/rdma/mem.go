package rdma

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Memory for RDMA lives outside the Go heap: an HCA reads and writes it while no Go code
// holds it in hand, so it must never move, never be freed behind a registration's back, and
// never hold the only reference to a Go object (cgo's pointer rules). Alloc maps anonymous
// memory for that; every provider registers it, and the verbs provider registers nothing
// else.

var allocs struct {
	sync.Mutex
	m map[uintptr]int // base address → length of each live Alloc
}

// Alloc maps n bytes of zeroed memory outside the Go heap, page-aligned. Free returns it.
func Alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: allocation of %d bytes", ErrInvalid, n)
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("rdma: mapping %d bytes: %w", n, err)
	}
	allocs.Lock()
	if allocs.m == nil {
		allocs.m = map[uintptr]int{}
	}
	allocs.m[uintptr(unsafe.Pointer(&b[0]))] = n
	allocs.Unlock()
	return b, nil
}

// Free unmaps memory returned by Alloc. Every region registered over it must be
// deregistered first; b must be the whole slice Alloc returned.
func Free(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	base := uintptr(unsafe.Pointer(&b[0]))
	allocs.Lock()
	n, ok := allocs.m[base]
	if ok && n == len(b) {
		delete(allocs.m, base)
	}
	allocs.Unlock()
	if !ok || n != len(b) {
		return fmt.Errorf("%w: free of memory Alloc did not return", ErrInvalid)
	}
	return unix.Munmap(b)
}

// Allocated reports whether b lies wholly inside memory from Alloc.
func Allocated(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	allocs.Lock()
	defer allocs.Unlock()
	for base, n := range allocs.m {
		if p >= base && p-base <= uintptr(n) && uintptr(len(b)) <= uintptr(n)-(p-base) {
			return true
		}
	}
	return false
}
