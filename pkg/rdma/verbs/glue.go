//go:build verbs

// Package verbs is the pkg/rdma provider over rdma-core: libibverbs for devices, memory,
// queues and completions, librdmacm for connections (RDMA_PS_TCP, as the kernel's RTRS).
// It is built with the verbs tag, and needs rdma-core's development files to build and its
// libraries to run. docs/rdma-api.md says how each call maps onto verbs, and how fast
// registration is done with memory windows.
package verbs

// #cgo LDFLAGS: -libverbs -lrdmacm
import "C"
