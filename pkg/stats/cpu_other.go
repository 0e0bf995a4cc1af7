//go:build !amd64

package stats

// CPU returns the CPU the calling thread runs on.
func CPU() int { return getcpu() }
