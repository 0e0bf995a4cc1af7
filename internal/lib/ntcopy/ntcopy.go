// Package ntcopy copies into memory that will not be read again soon (the pages of a
// memory-backed export) with non-temporal stores, which write whole cache lines to memory
// without first reading them into the cache. An ordinary copy into cold memory reads every
// destination line before overwriting it and evicts hotter data to hold it: on the host's
// block chain the server's copy of a 128 KiB write into its tmpfs export took twice the time
// of the kernel's copy of the same bytes from the socket into the (hot) chunk.
package ntcopy

// Min is the shortest copy made with non-temporal stores. A destination still in the cache (a
// journal's block written again and again) is slower to write that way; into cold memory,
// 4 KiB gains nothing beyond the noise. On the host (BenchmarkNonTemporal): 128 KiB cold
// 7.5-8.3 µs against 16.9-17.0, hot 6.7-7.2 against 2.7; 4 KiB cold 0.5-1.1 against
// 0.6-0.8, hot 0.71 against 0.03. A block of 64 KiB or more is most likely part of a stream
// (the host chain's 1 MiB writes come as 124 KiB requests), which the export does not read
// back soon.
const Min = 64 << 10
