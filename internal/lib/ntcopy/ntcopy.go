// Package ntcopy copies into memory that will not be read again soon (the pages of a
// memory-backed export) with non-temporal stores, which write whole cache lines to memory
// without first reading them into the cache. An ordinary copy into cold memory reads every
// destination line before overwriting it and evicts hotter data to hold it: on the host's
// block chain the server's copy of a 128 KiB write into its tmpfs export took twice the time
// of the kernel's copy of the same bytes from the socket into the (hot) chunk.
package ntcopy

// Min is the shortest copy made with non-temporal stores: below it the lines written are few
// and a plain copy is as fast.
const Min = 4 << 10
