//go:build !amd64

package stats

// CPU returns the CPU the calling thread runs on.
func CPU() int { return getcpu() }

// cheapCPU: without RDPID the CPU number is a system call, too dear per update.
func cheapCPU() (int, bool) { return 0, false }
