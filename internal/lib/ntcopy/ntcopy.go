// Package ntcopy copies into memory that will not be read again soon (the pages of a
// memory-backed export) with non-temporal stores, which write whole cache lines to memory
// without first reading them into the cache. An ordinary copy into cold memory reads every
// destination line before overwriting it and evicts hotter data to hold it: on the host's
// block chain the server's copy of a 128 KiB write into its tmpfs export took twice the time
// of the kernel's copy of the same bytes from the socket into the (hot) chunk.
package ntcopy

// Min is the shortest copy made with non-temporal stores. A destination still in the cache (a
// journal's block written again and again) is slower to write that way: on the host 4 KiB
// took 0.42 µs against 0.03 µs, 128 KiB 7-8 µs against 3 µs; into cold memory 128 KiB took
// 9-12 µs against 21-28 µs, and 4 KiB gained nothing beyond the noise. A block of 64 KiB
// or more is most likely part of a stream (the host chain's 1 MiB writes come as 128 KiB
// requests), which the export does not read back soon.
const Min = 64 << 10
