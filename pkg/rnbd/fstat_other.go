//go:build !(amd64 || arm64 || riscv64 || ppc64 || ppc64le || s390x)

package rnbd

import "golang.org/x/sys/unix"

// rawFstat is x/sys's fstat(2) where the kernel's struct stat is not unix.Stat_t as it is, or
// where there is no fstat (loong64 before Linux 6.11 has only statx).
func rawFstat(fd int, st *unix.Stat_t) error { return unix.Fstat(fd, st) }
