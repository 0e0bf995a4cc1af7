package ublk

import (
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// BlockBusy says whether the block device at path is in use: held exclusively (mounted, a
// device-mapper or md holder, a program that opened it O_EXCL) or open in some process,
// as the kernel's RNBD refuses an unmap while its device is open.
func BlockBusy(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err == unix.EBUSY {
		return true
	}
	if err == nil {
		unix.Close(fd)
	}
	return len(Openers(path)) > 0
}

// Openers lists the pids of the processes that have path open.
func Openers(path string) []int {
	procs, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	seen := map[string]bool{}
	var out []int
	for _, fd := range procs {
		if t, err := os.Readlink(fd); err != nil || t != path {
			continue
		}
		pid := filepath.Base(filepath.Dir(filepath.Dir(fd)))
		if n, err := strconv.Atoi(pid); err == nil && !seen[pid] {
			seen[pid] = true
			out = append(out, n)
		}
	}
	return out
}
