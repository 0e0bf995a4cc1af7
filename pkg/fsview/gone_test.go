package fsview

import (
	"fmt"
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
