package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestRNBDServerForceClose: the server's rnbd-server tree shows who has which export open,
// with the kernel's files; force_close throws one session off one export under IO: the
// client's IO to that device ends with EIO (not a hang), the client logs it and shows the
// device closed-by-server, the session's entry leaves the server's tree, and the other
// device of the session and the other session's open of the same export go on. Bad input is
// EINVAL, changes nothing, and is logged.
func TestRNBDServerForceClose(t *testing.T) {
	requireTools(t, "fio")
	c := startCluster(t)
	if err := os.WriteFile(filepath.Join(c.exports, "disk2"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(c.exports, "disk2"), 64<<20); err != nil {
		t.Fatal(err)
	}
	c.openSession(t, "")
	dev := c.mapDisk(t)
	mustBash(t, "echo 'sessname=e2e device_path=disk2' > "+c.devMnt+"/ctl/map_device")
	mustBash(t, "echo 'sessname=other device_path=/disk access_mode=ro path="+c.p1+"' > "+c.devMnt+"/ctl/map_device")
	dev2, devOther := c.devMnt+"/e2e/disk2", c.devMnt+"/other/disk"

	// IO first: a pattern written through one mapping reads back through the other session.
	mustBash(t, fmt.Sprintf("printf 'rnbd-srv%%.0s' $(seq 131072) | dd of=%s bs=1M count=1 conv=notrunc,fsync iflag=fullblock status=none", dev))
	want := mustBash(t, "printf 'rnbd-srv%.0s' $(seq 131072) | sha256sum")
	if got := mustBash(t, "dd if="+devOther+" bs=1M count=1 iflag=direct status=none | sha256sum"); got != want {
		t.Fatalf("the other session reads %q, want %q", got, want)
	}

	real, err := filepath.EvalSymlinks(c.exports)
	if err != nil {
		t.Fatal(err)
	}
	name := func(f string) string { return strings.ReplaceAll(strings.TrimLeft(real+"/"+f, "/"), "/", "!") }
	devs := c.rnbdMnt + "/ctl/devices"
	d1, d2 := devs+"/"+name("disk"), devs+"/"+name("disk2")
	files := map[string]string{
		"ls " + c.rnbdMnt:                            "ctl\n",
		"ls " + devs:                                 name("disk") + "\n" + name("disk2") + "\n",
		"ls " + d1 + "/sessions":                     "e2e\nother\n",
		"ls " + d2 + "/sessions":                     "e2e\n",
		"readlink " + d1 + "/block_dev":              ".\n",
		"basename $(realpath " + d1 + "/block_dev)":  name("disk") + "\n", // how the rnbd tool names it
		"ls " + d1 + "/sessions/e2e":                 "access_mode\nforce_close\nmapping_path\nread_only\n",
		"cat " + d1 + "/sessions/e2e/access_mode":    "rw\n",
		"cat " + d1 + "/sessions/e2e/read_only":      "0\n",
		"cat " + d1 + "/sessions/e2e/mapping_path":   "disk\n",
		"cat " + d1 + "/sessions/e2e/force_close":    "Usage: echo 1 > force_close\n",
		"cat " + d1 + "/sessions/other/access_mode":  "ro\n",
		"cat " + d1 + "/sessions/other/read_only":    "1\n",
		"cat " + d1 + "/sessions/other/mapping_path": "/disk\n",
		"cat " + d2 + "/sessions/e2e/mapping_path":   "disk2\n",
		"cat " + c.devMnt + "/ctl/devices":           "e2e/disk open rw\ne2e/disk2 open rw\nother/disk open ro\n",
	}
	for script, w := range files {
		if got := mustBash(t, script); got != w {
			t.Errorf("%s: %q, want %q", script, got, w)
		}
	}

	// Bad input: EINVAL, nothing changes, the server logs it.
	fc := d1 + "/sessions/e2e/force_close"
	for _, bad := range []string{"0", "2", "yes"} {
		if out, err := bash(t, "echo '"+bad+"' > "+fc); err == nil || !strings.Contains(out, "Invalid argument") {
			t.Errorf("force_close < %q: %q %v", bad, out, err)
		}
	}
	if got := mustBash(t, "ls "+d1+"/sessions"); got != "e2e\nother\n" {
		t.Fatalf("sessions after bad input: %q", got)
	}
	testutil.WaitFor(t, 5*time.Second, "refused write logged", func() bool {
		l := cat(c.srvd.log)
		return strings.Contains(l, "control write refused") && strings.Contains(l, "force_close") && strings.Contains(l, `input="\"yes\""`)
	})

	// fio on the device, time-based for far longer than the test waits: it must end early,
	// with EIO, once the server closes the device.
	type result struct {
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := bash(t, "fio --name=fc --filename="+dev+" --rw=randrw --bs=16k --size=64m --ioengine=psync --numjobs=2 "+
			"--offset_increment=64m --runtime=120 --time_based --group_reporting")
		done <- result{out, err}
	}()
	rdma := c.pathFile(c.p1, "stats/rdma")
	base := rdmaOps(t, rdma)
	testutil.WaitFor(t, 30*time.Second, "fio moving IO", func() bool { return rdmaOps(t, rdma) > base+200 })
	select {
	case r := <-done:
		t.Fatalf("fio ended before force_close: %v\n%s", r.err, r.out)
	default:
	}
	start := time.Now()
	mustBash(t, "echo 1 > "+fc)
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("fio still running 30 s after force_close (IO hangs); client log:\n%s", cat(c.clid.log))
	}
	t.Logf("fio ended %v after force_close", time.Since(start).Round(time.Millisecond))
	if r.err == nil || !strings.Contains(r.out, "Input/output error") {
		t.Fatalf("fio after force_close: %v, want an EIO\n%s", r.err, r.out)
	}
	if out, err := bash(t, "timeout 20 dd if="+dev+" of=/dev/null bs=64k count=1 iflag=direct status=none"); err == nil ||
		!strings.Contains(out, "Input/output error") {
		t.Fatalf("read after force_close: %q %v", out, err)
	}

	// The server: the session's entry is gone, the rest stays; it says what it did.
	if got := mustBash(t, "ls "+d1+"/sessions"); got != "other\n" {
		t.Errorf("sessions of disk after force_close: %q", got)
	}
	if got := mustBash(t, "ls "+d2+"/sessions"); got != "e2e\n" {
		t.Errorf("sessions of disk2 after force_close: %q", got)
	}
	if l := cat(c.srvd.log); !strings.Contains(l, "force_close: closed") || !strings.Contains(l, "session=e2e") {
		t.Errorf("server log says nothing of the force_close:\n%s", l)
	}
	// The client: a log line naming device and session; the device view's state.
	testutil.WaitFor(t, 5*time.Second, "client log", func() bool {
		for _, line := range strings.Split(cat(c.clid.log), "\n") {
			if strings.Contains(line, "the server closed the device") && strings.Contains(line, "device=disk") && strings.Contains(line, "session=e2e") {
				return true
			}
		}
		return false
	})
	if got := cat(c.devMnt + "/ctl/devices"); got != "e2e/disk closed-by-server rw\ne2e/disk2 open rw\nother/disk open ro\n" {
		t.Errorf("device view after force_close: %q", got)
	}
	// Unaffected: the session's paths, its other device, the other session on the same export.
	for _, p := range []string{c.p1, c.p2} {
		if st := cat(c.pathFile(p, "state")); st != "connected\n" {
			t.Errorf("path %s: %q", p, st)
		}
	}
	if out, err := fioVerify(t, dev2, "8m"); err != nil {
		t.Fatalf("fio on disk2 after force_close of disk: %v\n%s", err, out)
	}
	// fio wrote the export; the other session reads what the file has.
	want = mustBash(t, "dd if="+filepath.Join(c.exports, "disk")+" bs=1M count=1 status=none | sha256sum")
	if got := mustBash(t, "dd if="+devOther+" bs=1M count=1 iflag=direct status=none | sha256sum"); got != want {
		t.Fatalf("the other session reads %q after the force_close, want %q", got, want)
	}

	// Unmapping the closed device is clean; mapped again, it works.
	mustBash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/unmap_device")
	mustBash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/map_device")
	if got := mustBash(t, "dd if="+dev+" bs=1M count=1 iflag=direct status=none | sha256sum"); got != want {
		t.Fatalf("remapped device reads %q, want %q", got, want)
	}
	if got := mustBash(t, "ls "+d1+"/sessions"); got != "e2e\nother\n" {
		t.Errorf("sessions of disk after the remap: %q", got)
	}

	// A device goes from the tree with its last session.
	mustBash(t, "echo 1 > "+d2+"/sessions/e2e/force_close")
	if got := mustBash(t, "ls "+devs); got != name("disk")+"\n" {
		t.Errorf("devices after the last session of disk2 went: %q", got)
	}
}
