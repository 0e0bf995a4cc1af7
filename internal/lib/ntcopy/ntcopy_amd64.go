package ntcopy

import (
	"unsafe"

	"github.com/rtrs-go/rtrs/internal/lib/racebuf"
)

// Copy copies min(len(dst), len(src)) bytes from src to dst and returns how many, as the
// built-in copy does. On amd64 a copy of at least Min bytes between buffers that do not
// overlap goes out with non-temporal stores, ordered before whatever the caller does next
// (a store fence); otherwise, and on other architectures, it is the built-in copy. A fault
// in the destination (a page of a shrunk or full file's mapping) is a run-time panic as in
// the built-in copy, which debug.SetPanicOnFault turns into a recoverable one.
func Copy(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n < Min || overlap(dst[:n], src[:n]) {
		return copy(dst, src)
	}
	copyNT(dst[:n], src[:n])
	return n
}

// ntStore copies n bytes, a multiple of 128, from src to dst, which is 16-byte aligned, with
// non-temporal stores, then fences them (ntcopy_amd64.s: SSE2's MOVNTDQ, which every amd64
// CPU has).
//
//go:noescape
func ntStore(dst, src *byte, n uintptr)

// copyNT copies src to dst (of the same length): the head up to dst's first cache line and
// the tail under 128 bytes plainly, the rest with ntStore. The race detector is told of the
// whole ranges, which the assembly does not report.
func copyNT(dst, src []byte) {
	racebuf.Read(src)
	racebuf.Written(dst)
	h := int(-uintptr(unsafe.Pointer(&dst[0])) & 63)
	copy(dst[:h], src[:h])
	body := (len(dst) - h) &^ 127
	ntStore(&dst[h], &src[h], uintptr(body))
	copy(dst[h+body:], src[h+body:])
}

// overlap says whether a and b (non-empty) share any byte.
func overlap(a, b []byte) bool {
	pa, pb := uintptr(unsafe.Pointer(&a[0])), uintptr(unsafe.Pointer(&b[0]))
	return pa < pb+uintptr(len(b)) && pb < pa+uintptr(len(a))
}
