//go:build amd64 || arm64 || riscv64 || ppc64 || ppc64le || s390x

package rnbd

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// rawFstat is fstat(2) without the runtime's system call bookkeeping, for a memfs export's
// size check before each zero-copy READ, as memfs reads are raw preadv2s (rawPreadv2): it
// reads the inode of a memory file system and never waits, and entered as a system call it
// would wake the runtime's monitor thread in a server that had nothing else to do. Only where
// the kernel's fstat fills unix.Stat_t as it is (the architectures of this file's build line;
// elsewhere x/sys converts, or goes through statx).
func rawFstat(fd int, st *unix.Stat_t) error {
	if _, _, e := unix.RawSyscall(unix.SYS_FSTAT, uintptr(fd), uintptr(unsafe.Pointer(st)), 0); e != 0 {
		return e
	}
	return nil
}
