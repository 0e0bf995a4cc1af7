package fsview

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// TestRNBDServerTree: the rnbd-server tree lists an open device once, with a directory per
// session that has it open and the kernel's four files; force_close refuses anything but 1
// and changes nothing then; with 1 it ends that session's use of the device (its directory
// goes, the client's IO fails with EIO and the device view says closed-by-server) and leaves
// the other session's alone; the device goes with its last session.
func TestRNBDServerTree(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	dev, rt := tr.dev, tr.rnbd
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	if got := mustSh(t, "ls "+rt+" "+rt+"/ctl "+rt+"/ctl/devices"); got != rt+":\nctl\n\n"+rt+"/ctl:\ndevices\n\n"+rt+"/ctl/devices:\n" {
		t.Fatalf("empty tree: %q", got)
	}
	mustSh(t, fmt.Sprintf("echo 'sessname=s1 device_path=disk dest_port=%d path=%s' > %s/ctl/map_device", tr.port, p1, dev))
	mustSh(t, fmt.Sprintf("echo 'sessname=s2 device_path=/disk dest_port=%d path=%s access_mode=ro' > %s/ctl/map_device", tr.port, p1, dev))
	real, err := filepath.EvalSymlinks(filepath.Join(tr.exports, "disk"))
	if err != nil {
		t.Fatal(err)
	}
	name := strings.ReplaceAll(strings.TrimLeft(real, "/"), "/", "!")
	d := rt + "/ctl/devices/" + name
	want := map[string]string{
		"ls " + rt + "/ctl/devices":                name + "\n",
		"ls " + d:                                  "block_dev\nsessions\n",
		"readlink " + d + "/block_dev":             ".\n",
		"basename $(realpath " + d + "/block_dev)": name + "\n", // how the rnbd tool names it
		"ls " + d + "/sessions":                    "s1\ns2\n",
		"ls " + d + "/sessions/s1":                 "access_mode\nforce_close\nmapping_path\nread_only\n",
		"cat " + d + "/sessions/s1/access_mode":    "rw\n",
		"cat " + d + "/sessions/s1/read_only":      "0\n",
		"cat " + d + "/sessions/s1/mapping_path":   "disk\n",
		"cat " + d + "/sessions/s1/force_close":    "Usage: echo 1 > force_close\n",
		"cat " + d + "/sessions/s2/access_mode":    "ro\n",
		"cat " + d + "/sessions/s2/read_only":      "1\n",
		"cat " + d + "/sessions/s2/mapping_path":   "/disk\n",
		"stat -c '%A %n' " + d + "/sessions/s1/*": "-r--r--r-- " + d + "/sessions/s1/access_mode\n-rw-r--r-- " + d + "/sessions/s1/force_close\n" +
			"-r--r--r-- " + d + "/sessions/s1/mapping_path\n-r--r--r-- " + d + "/sessions/s1/read_only\n",
		"cat " + dev + "/ctl/devices": "s1/disk open rw\ns2/disk open ro\n",
	}
	for script, w := range want {
		if got := mustSh(t, script); got != w {
			t.Errorf("%s: %q, want %q", script, got, w)
		}
	}
	shErr(t, "echo x > "+d+"/sessions/s1/read_only", "Permission denied")
	for _, bad := range []string{"0", "2", "yes", "11", "1 1", ""} {
		shErr(t, "echo '"+bad+"' > "+d+"/sessions/s1/force_close", "Invalid argument")
	}
	// Nothing changed: the session's directory is there and its IO works.
	mustSh(t, "ls "+d+"/sessions/s1 >/dev/null && dd if="+dev+"/s1/disk of=/dev/null bs=64k count=4 status=none")

	mustSh(t, "printf '1' > "+d+"/sessions/s1/force_close")
	if got := mustSh(t, "ls "+d+"/sessions"); got != "s2\n" {
		t.Fatalf("sessions after force_close: %q", got)
	}
	// The client: IO fails with EIO at once, the device view says why.
	shErr(t, "timeout 20 dd if="+dev+"/s1/disk of=/dev/null bs=64k count=4 status=none", "Input/output error")
	shErr(t, "timeout 20 dd if=/dev/zero of="+dev+"/s1/disk bs=64k count=4 conv=notrunc status=none", "Input/output error")
	if got := mustSh(t, "cat "+dev+"/ctl/devices"); got != "s1/disk closed-by-server rw\ns2/disk open ro\n" {
		t.Errorf("device view after force_close: %q", got)
	}
	// The other session goes on.
	mustSh(t, "dd if="+dev+"/s2/disk of=/dev/null bs=64k count=4 status=none")
	// Unmapping the closed device is clean; the device goes with its last session.
	mustSh(t, "echo 'sessname=s1 device_path=disk' > "+dev+"/ctl/unmap_device")
	if got := mustSh(t, "cat "+dev+"/ctl/devices"); got != "s2/disk open ro\n" {
		t.Errorf("device view after the unmap: %q", got)
	}
	mustSh(t, "echo 'sessname=s2 device_path=/disk' > "+dev+"/ctl/unmap_device")
	if got := mustSh(t, "ls "+rt+"/ctl/devices"); got != "" {
		t.Errorf("devices after the last unmap: %q", got)
	}
}
