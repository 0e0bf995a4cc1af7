package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// syncDevices writes back what is dirty on the block devices at paths: each file system
// mounted on one of them, or on a device stacked over one (its holders: device mapper, md),
// is synced (syncfs), and each device itself (fsync: its page cache and its volatile cache).
// It returns how many file systems it synced.
func syncDevices(paths []string) int {
	devs := map[string]bool{} // "major:minor", as mountinfo names them
	for _, p := range paths {
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
			addHolders(devs, fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), 0)
		}
	}
	n := 0
	for _, mnt := range mountsOf(devs) {
		fd, err := unix.Open(mnt, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if unix.Syncfs(fd) == nil {
			n++
		}
		unix.Close(fd)
	}
	for _, p := range paths {
		if f, err := os.OpenFile(p, os.O_RDONLY, 0); err == nil {
			_ = f.Sync()
			f.Close()
		}
	}
	return n
}

// addHolders adds dev and, through /sys/dev/block/<dev>/holders, every device stacked over
// it (depth bounds a loop a broken sysfs could make).
func addHolders(devs map[string]bool, dev string, depth int) {
	if devs[dev] || depth > 8 {
		return
	}
	devs[dev] = true
	ents, _ := os.ReadDir(filepath.Join("/sys/dev/block", dev, "holders"))
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/block", e.Name(), "dev"))
		if err == nil {
			addHolders(devs, strings.TrimSpace(string(b)), depth+1)
		}
	}
}

// mountsOf lists the mount points whose device (mountinfo's third field) is in devs, each
// file system once.
func mountsOf(devs map[string]bool) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	seen := map[string]bool{}
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 5 || !devs[fs[2]] || seen[fs[2]] {
			continue
		}
		seen[fs[2]] = true
		out = append(out, unescapeMount(fs[4]))
	}
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space, and of tab, newline and
// backslash).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%3o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
