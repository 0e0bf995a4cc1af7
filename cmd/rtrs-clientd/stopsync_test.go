package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSyncDevices: the stop's write-back finds the file system mounted on a device it is
// given (here a loop device, as it would find one on /dev/ublkbN), syncs it and nothing
// else, and takes a device with nothing mounted; mount points with spaces are unescaped.
func TestSyncDevices(t *testing.T) {
	if got := unescapeMount(`/mnt/a\040b\134c`); got != `/mnt/a b\c` {
		t.Fatalf("unescape: %q", got)
	}
	if os.Geteuid() != 0 {
		t.Fatal("needs root: loop devices and mounts (the test command runs as root)")
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	loop := strings.TrimSpace(string(out))
	defer exec.Command("losetup", "-d", loop).Run()
	if n := syncDevices([]string{loop}); n != 0 {
		t.Fatalf("%d file systems synced on a device with none mounted", n)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", loop).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	mnt := filepath.Join(dir, "a mount")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", loop, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	defer exec.Command("umount", mnt).Run()
	if err := os.WriteFile(filepath.Join(mnt, "f"), []byte("dirty"), 0o600); err != nil {
		t.Fatal(err)
	}
	if n := syncDevices([]string{loop, "/nonexistent"}); n != 1 {
		t.Fatalf("%d file systems synced, want the one on %s", n, loop)
	}
}
