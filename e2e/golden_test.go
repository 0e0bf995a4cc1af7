package e2e

import (
	"flag"
	"fmt"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the golden files of TestTreesGolden")

// normalize takes out what changes between runs: the interface names (they carry the test's
// pid), latencies, and the per-CPU columns (their count is the machine's).
func normalize(s string) string {
	s = regexp.MustCompile(`soft_r([cs])(\d)-\d+`).ReplaceAllString(s, "soft_r${1}${2}-ID")
	s = regexp.MustCompile(`(?m)^\d+ ns$`).ReplaceAllString(s, "N ns")
	s = regexp.MustCompile(`(?m)^(0 )+$`).ReplaceAllString(s, "0 … ")
	s = regexp.MustCompile(`( CPU\d+)+`).ReplaceAllString(s, " CPU…")
	s = regexp.MustCompile(`(?m)^(from:|to  :)( +0)+$`).ReplaceAllString(s, "$1 0 …")
	// The rnbd-server tree names a file export by its path (the test's temp dir), and ls -l
	// shows the length of block_dev's target.
	s = regexp.MustCompile(`[^/\s]*TestTreesGolden\d+!\d+!exports!`).ReplaceAllString(s, "TMP!exports!")
	s = regexp.MustCompile(`(?m)^(l\S+ \d+ \S+ \S+ )\d+ `).ReplaceAllString(s, "${1}N ")
	return s
}

// walkFiles lists a tree's regular files, relative, sorted.
func walkFiles(t *testing.T, root string) []string {
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			rel, _ := filepath.Rel(root, p)
			out = append(out, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

// TestTreesGolden: every file of both trees and of the device view's ctl/, as cat prints it,
// against testdata/golden; ls -l of the trees; then every writable file takes its good
// input with and without a newline, and refuses bad input with the errno echo prints,
// leaving what the file shows unchanged.
func TestTreesGolden(t *testing.T) {
	c := startCluster(t)
	c.openSession(t, "")
	c.mapDisk(t)
	testutil.WaitFor(t, 5*time.Second, "server paths", func() bool { return exists(c.srvMnt + "/e2e/paths/" + c.p2s) })
	for _, p := range []string{c.p1, c.p2} {
		mustBash(t, "echo 1 > "+c.pathFile(p, "stats/reset_all"))
	}
	for _, p := range []string{c.p1s, c.p2s} {
		mustBash(t, "echo 1 > "+c.srvMnt+"/e2e/paths/"+p+"/stats/reset_all")
	}
	var b strings.Builder
	for _, tree := range []struct{ name, root string }{{"rtrs-client", c.cliMnt}, {"rtrs-server", c.srvMnt}, {"dev", c.devMnt}, {"rnbd-server", c.rnbdMnt}} {
		fmt.Fprintf(&b, "### ls -l %s\n", tree.name)
		b.WriteString(mustBash(t, "cd "+tree.root+" && ls -lR . | awk 'NF < 9 {print; next} {print $1, $2, $3, $4, $5, $9}'"))
		for _, f := range walkFiles(t, tree.root) {
			if strings.HasPrefix(f, "e2e/") && tree.name == "dev" {
				continue // the device itself
			}
			content := mustBash(t, "cat '"+filepath.Join(tree.root, f)+"'")
			if filepath.Base(f) == "wc_completion" { // heartbeats move it at any time
				content = regexp.MustCompile(`\d+`).ReplaceAllString(content, "N")
			}
			fmt.Fprintf(&b, "### %s/%s\n%s", tree.name, f, content)
		}
	}
	got := normalize(b.String())
	golden := "testdata/trees.golden"
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		gl, wl := strings.Split(got, "\n"), strings.Split(string(want), "\n")
		for i := 0; i < len(gl) && i < len(wl); i++ {
			if gl[i] != wl[i] {
				t.Fatalf("trees differ from %s at line %d:\n got %q\nwant %q\n(go test ./e2e -run TestTreesGolden -update rewrites it)", golden, i+1, gl[i], wl[i])
			}
		}
		t.Fatalf("trees differ from %s in length (%d vs %d lines)", golden, len(gl), len(wl))
	}

	// Writable files: good input with and without newline, bad input refused.
	type io struct{ good, bad []string }
	inputs := map[string]io{
		"mpath_policy":           {good: []string{"min-inflight", "1"}, bad: []string{"7", "fastest"}},
		"mp_policy":              {good: []string{"round-robin", "0"}, bad: []string{"-2", "rr rr"}},
		"max_reconnect_attempts": {good: []string{"-1", "7"}, bad: []string{"10000", "seven"}},
		"add_path":               {bad: []string{"10.0.0.1", "ip:", "ip:1.2.3.4@"}},
		"reconnect":              {good: []string{"1"}, bad: []string{"0", "2"}},
		"disconnect":             {bad: []string{"0", "yes"}},
		"remove_path":            {bad: []string{"0", "11"}},
		"open_session":           {bad: []string{"sessname=x", "path=ip:10.77.1.2", "sessname=e2e path=ip:10.77.1.2 x=1"}},
		"close_session":          {bad: []string{"nosuch"}},
		"map_device":             {bad: []string{"sessname=e2e", "device_path=disk", "sessname=e2e device_path=disk bogus=1"}},
		"unmap_device":           {bad: []string{"sessname=e2e", "sessname=e2e device_path=nosuch"}},
		"force_close":            {bad: []string{"0", "2", "yes"}}, // 1 closes: TestRNBDServerForceClose
		// A mapped device's own files (1 remaps: EALREADY while open; pkg/fsview tests).
		"mapped/unmap_device": {bad: []string{"", "Normal", "sessname=e2e device_path=disk"}},
		"mapped/remap_device": {bad: []string{"0", "2", "yes"}},
		"mapped/resize":       {good: []string{"524288", "0x80000"}, bad: []string{"x", "-1", "1_0"}},
		// stats files: reset with 1 only; 0 is EINVAL, as in the kernel's code.
		"*stats": {good: []string{"1"}, bad: []string{"0", "2", "reset"}},
	}
	for _, tree := range []string{c.cliMnt, c.srvMnt, c.devMnt, c.rnbdMnt} {
		for _, f := range walkFiles(t, tree) {
			full := filepath.Join(tree, f)
			st, err := os.Stat(full)
			if err != nil || st.Mode().Perm()&0o200 == 0 || (tree == c.devMnt && strings.HasPrefix(f, "e2e/")) {
				continue
			}
			key := filepath.Base(f)
			if strings.Contains(f, "/stats/") {
				key = "*stats"
			}
			if strings.HasPrefix(f, "ctl/mapped/") {
				key = "mapped/" + key
			}
			in, ok := inputs[key]
			if !ok {
				t.Errorf("no inputs for writable %s", f)
				continue
			}
			for _, g := range in.good {
				for _, cmd := range []string{"echo '%s' > '%s'", "printf '%%s' '%s' > '%s'"} {
					if out, err := bash(t, fmt.Sprintf(cmd, g, full)); err != nil {
						t.Errorf("%s < %q: %v %s", f, g, err, out)
					}
				}
			}
			before := cat(full)
			for _, bad := range in.bad {
				want := "Invalid argument"
				if key == "close_session" || (key == "unmap_device" && strings.Contains(bad, "nosuch")) {
					want = "No such file or directory"
				}
				out, err := bash(t, fmt.Sprintf("echo '%s' > '%s'", bad, full))
				if err == nil || !strings.Contains(out, want) {
					t.Errorf("%s < %q: %q %v, want %q", f, bad, out, err, want)
				}
				// wc_completion moves with every heartbeat: no "unchanged" to check there.
				if after := cat(full); after != before && filepath.Base(f) != "wc_completion" {
					t.Errorf("%s changed after bad input %q: %q → %q", f, bad, before, after)
				}
			}
		}
	}
}
