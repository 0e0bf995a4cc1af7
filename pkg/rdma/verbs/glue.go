//go:build verbs

// Package verbs is the pkg/rdma provider over rdma-core: libibverbs for devices, memory,
// queues and completions, librdmacm for connections (RDMA_PS_TCP, as the kernel's RTRS).
// It is built with the verbs tag, and needs rdma-core's development files to build and its
// libraries to run. docs/rdma-api.md says how each call maps onto verbs, and how fast
// registration is done with memory windows.
package verbs

// #cgo LDFLAGS: -libverbs -lrdmacm
// #include <stdint.h>
import "C"

import "unsafe"

// handle passes C memory to the glue's hot-path calls as an integer (see glue.h).
func handle[T any](p *T) C.uintptr_t { return C.uintptr_t(uintptr(unsafe.Pointer(p))) }
