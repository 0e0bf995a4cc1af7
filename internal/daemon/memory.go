package daemon

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// DefaultChunkMemory is the bound on the chunk memory of all sessions a server takes when
// none is configured (transport.ServerLimits.MaxChunkMemory): half the memory the process may
// use (physMemory).
func DefaultChunkMemory() int64 { return physMemory() / 2 }

// physMemory is the memory the process may use in bytes: the machine's, or its cgroup's
// memory.max where that is lower (a unit with MemoryMax=, a container); 1 GiB if neither can
// be read.
func physMemory() int64 {
	var si unix.Sysinfo_t
	total := int64(1 << 30)
	if err := unix.Sysinfo(&si); err == nil && si.Totalram != 0 {
		total = int64(si.Totalram) * int64(si.Unit)
	}
	if lim, ok := cgroupMemoryMax(); ok && lim < total {
		total = lim
	}
	return total
}

// cgroupMemoryMax reads the memory limit of the process's cgroup: memory.max (v2) or
// memory.limit_in_bytes (v1).
func cgroupMemoryMax() (int64, bool) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		var file string
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			file = filepath.Join("/sys/fs/cgroup", rest, "memory.max")
		} else if _, rest, ok := strings.Cut(line, ":memory:"); ok {
			file = filepath.Join("/sys/fs/cgroup/memory", rest, "memory.limit_in_bytes")
		} else {
			continue
		}
		v, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		// "max" (v2) does not parse, and v1's "no limit" is a huge number: no limit either way.
		if n, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64); err == nil && n > 0 {
			return n, true
		}
	}
	return 0, false
}
