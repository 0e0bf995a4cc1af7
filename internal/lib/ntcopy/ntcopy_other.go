//go:build !amd64

package ntcopy

// Copy copies min(len(dst), len(src)) bytes from src to dst and returns how many, as the
// built-in copy does. On amd64 a copy of at least Min bytes between buffers that do not
// overlap goes out with non-temporal stores, ordered before whatever the caller does next
// (a store fence); otherwise, and on other architectures, it is the built-in copy. A fault
// in the destination (a page of a shrunk or full file's mapping) is a run-time panic as in
// the built-in copy, which debug.SetPanicOnFault turns into a recoverable one.
func Copy(dst, src []byte) int { return copy(dst, src) }
