package fsview

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// TestGoneDirectories: a shell sitting in a session's directory, and a file of it held open,
// outlive a close and reopen of the same name: the old directory then lists nothing (also
// once the new session has been looked up under the name) and a write through the old file
// is ENODEV and does nothing, as sysfs answers for a removed kobject; the new session is
// untouched. The same holds for a removed path's directory.
func TestGoneDirectories(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	open := fmt.Sprintf("echo 'sessname=n dest_port=%d path=%s' > %s/ctl/open_session", tr.port, p1, tr.cli)
	mustSh(t, open)
	out, err := sh(t, `set -e
cd `+tr.cli+`/n
exec 3>mpath_policy 4>paths/`+p1+`/reconnect
echo n > ../ctl/close_session
`+open+`
ls `+tr.cli+`/n >/dev/null # the new session looked up under the same name
echo "ls: [$(ls)]"
echo min-latency >&3 || echo "policy refused"
echo 1 >&4 || echo "reconnect refused"
`)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"ls: []", "No such device", "policy refused", "reconnect refused"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
	if got := mustSh(t, "cat "+tr.cli+"/n/mpath_policy"); got != "min-inflight (MI: 1)\n" {
		t.Errorf("the new session's policy: %q", got)
	}

	// A removed path: its open file is ENODEV too.
	p2 := "ip:127.0.0.2@ip:127.0.0.1"
	mustSh(t, "echo "+p2+" > "+tr.cli+"/n/add_path")
	out, _ = sh(t, `exec 3>`+tr.cli+`/n/paths/`+p2+`/reconnect
echo 1 > `+tr.cli+`/n/paths/`+p2+`/remove_path
echo 1 >&3 || echo "reconnect refused"`)
	if !strings.Contains(out, "No such device") || !strings.Contains(out, "reconnect refused") {
		t.Errorf("a removed path's reconnect:\n%s", out)
	}
	if got := mustSh(t, "ls "+tr.cli+"/n/paths"); got != p1+"\n" {
		t.Errorf("paths: %q", got)
	}
	mustSh(t, "echo n > "+tr.cli+"/ctl/close_session")
}

// TestDeviceViewSessionDir: a shell sitting in a session's directory of the device view sees
// the devices mapped and unmapped after it came in (the directory is not a copy of the list
// at its lookup), and nothing once the last one is gone.
func TestDeviceViewSessionDir(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	if err := os.WriteFile(filepath.Join(tr.exports, "disk2"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	mapDev := func(p string) string {
		return fmt.Sprintf("echo 'sessname=b device_path=%s dest_port=%d path=ip:127.0.0.1@ip:127.0.0.1' > %s/ctl/map_device", p, tr.port, tr.dev)
	}
	unmapDev := func(p string) string {
		return fmt.Sprintf("echo 'sessname=b device_path=%s' > %s/ctl/unmap_device", p, tr.dev)
	}
	mustSh(t, mapDev("disk"))
	out := mustSh(t, `set -e
cd `+tr.dev+`/b
echo "1: $(ls | tr '\n' ' ')"
`+mapDev("disk2")+`
echo "2: $(ls | tr '\n' ' ')"
`+unmapDev("disk")+`
echo "3: $(ls | tr '\n' ' ')"
`+unmapDev("disk2")+`
echo "4: $(ls | tr '\n' ' ')"
`)
	if want := "1: disk \n2: disk disk2 \n3: disk2 \n4: \n"; out != want {
		t.Errorf("a shell in the session's directory saw:\n%s\nwant:\n%s", out, want)
	}
}

// TestRNBDServerSessionGone: a shell left in an rnbd-server session's directory after the
// client unmapped the device and mapped it again under the same session sees nothing there
// (the new open is another directory, with its own access mode), and its force_close is
// ENODEV and leaves the new open alone.
func TestRNBDServerSessionGone(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	mapDev := func(mode string) string {
		return fmt.Sprintf("echo 'sessname=s1 device_path=disk dest_port=%d path=ip:127.0.0.1@ip:127.0.0.1 access_mode=%s' > %s/ctl/map_device", tr.port, mode, tr.dev)
	}
	mustSh(t, mapDev("rw"))
	real, err := filepath.EvalSymlinks(filepath.Join(tr.exports, "disk"))
	if err != nil {
		t.Fatal(err)
	}
	sd := tr.rnbd + "/ctl/devices/" + strings.ReplaceAll(strings.TrimLeft(real, "/"), "/", "!") + "/sessions/s1"
	out, err := sh(t, `set -e
cd `+sd+`
exec 3>force_close
echo "old: $(cat access_mode)"
echo 'sessname=s1 device_path=disk' > `+tr.dev+`/ctl/unmap_device
`+mapDev("ro")+`
echo "new: $(cat `+sd+`/access_mode)"
echo "left: [$(ls)]"
echo 1 >&3 || echo "force_close refused"
`)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"old: rw\n", "new: ro\n", "left: []\n", "No such device", "force_close refused"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
	if got := mustSh(t, "cat "+tr.dev+"/ctl/devices"); got != "s1/disk open ro\n" {
		t.Errorf("the new open: %q", got)
	}
	mustSh(t, "echo 'sessname=s1 device_path=disk' > "+tr.dev+"/ctl/unmap_device")
}
