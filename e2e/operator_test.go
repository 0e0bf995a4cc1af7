package e2e

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestDaemonHelp: -h of each daemon exits 0, says what the daemon is, describes every flag in
// words rather than by a kernel parameter's name alone, and gives the values that 0 stands for.
func TestDaemonHelp(t *testing.T) {
	want := map[string][]string{
		"rtrs-serverd": {"the RTRS server daemon", "5 s", "1234"},
		"rtrs-clientd": {"the RTRS client daemon", "30 s", "5 s", "CPUs + 1"},
	}
	// A flag line, then its usage lines indented by a tab.
	flagLine := regexp.MustCompile(`^  -([a-z0-9-]+)`)
	bare := regexp.MustCompile(`^[a-z_]+(: .{0,20})?( \(default .*\))?$`)
	for name, phrases := range want {
		out, err := exec.Command(filepath.Join(binDir, name), "-h").CombinedOutput()
		if err != nil {
			t.Fatalf("%s -h: %v\n%s", name, err, out)
		}
		text := string(out)
		for _, p := range phrases {
			if !strings.Contains(text, p) {
				t.Errorf("%s -h does not say %q:\n%s", name, p, text)
			}
		}
		flags := 0
		lines := strings.Split(text, "\n")
		for i, l := range lines {
			m := flagLine.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			flags++
			if i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "    \t") {
				t.Errorf("%s -h: -%s has no description", name, m[1])
				continue
			}
			if u := strings.TrimSpace(lines[i+1]); bare.MatchString(u) {
				t.Errorf("%s -h: -%s is described only as %q", name, m[1], u)
			}
		}
		if flags < 15 {
			t.Errorf("%s -h lists %d flags:\n%s", name, flags, text)
		}
	}
}

// TestSettingsSurviveRestart: every setting changed through the tree that the config can
// express (a path added or removed, mp_policy, mpath_policy, max_reconnect_attempts, a device
// unmapped, a session closed) is as it was left after the client daemon restarts.
func TestSettingsSurviveRestart(t *testing.T) {
	c := startCluster(t)
	mustBash(t, "echo 'sessname=e2e path="+c.p1+"' > "+c.cliMnt+"/ctl/open_session")
	sess := c.cliMnt + "/e2e"
	mustBash(t, "echo "+c.p2+" > "+sess+"/add_path")
	mustBash(t, "echo min-latency > "+sess+"/mp_policy && echo 17 > "+sess+"/max_reconnect_attempts")
	check := func(when string) {
		t.Helper()
		if got := cat(sess + "/mpath_policy"); got != "min-latency (ML: 2)\n" {
			t.Fatalf("%s: mpath_policy %q", when, got)
		}
		if got := cat(sess + "/max_reconnect_attempts"); got != "17\n" {
			t.Fatalf("%s: max_reconnect_attempts %q", when, got)
		}
	}
	check("before the restart")
	c.clid.stop()
	c.clid.start()
	testutil.WaitFor(t, 30*time.Second, "both paths back", func() bool {
		return cat(c.pathFile(c.p1, "state")) == "connected\n" && cat(c.pathFile(c.p2, "state")) == "connected\n"
	})
	check("after the restart")
	// And once more with mpath_policy, the kernel's other name for the file.
	mustBash(t, "echo round-robin > "+sess+"/mpath_policy")
	c.clid.stop()
	c.clid.start()
	testutil.WaitFor(t, 30*time.Second, "session back", func() bool { return cat(sess+"/mpath_policy") == "round-robin (RR: 0)\n" })
	// What is taken away stays away: a path removed, a device unmapped, a session closed.
	dev := c.mapDisk(t)
	mustBash(t, "echo 1 > "+c.pathFile(c.p2, "remove_path"))
	mustBash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/unmap_device")
	mustBash(t, "echo 'sessname=other path="+c.p1+"' > "+c.cliMnt+"/ctl/open_session")
	mustBash(t, "echo other > "+c.cliMnt+"/ctl/close_session")
	c.clid.stop()
	c.clid.start()
	testutil.WaitFor(t, 30*time.Second, "tree back", func() bool { return exists(c.cliMnt+"/ctl/open_session") && exists(c.devMnt+"/ctl/map_device") })
	// The session opened with open_session stays (with its one path left); the device and
	// the closed session do not come back.
	testutil.WaitFor(t, 30*time.Second, "session e2e back", func() bool { return cat(c.pathFile(c.p1, "state")) == "connected\n" })
	time.Sleep(2 * time.Second) // time for anything the config still named to come back
	if got := mustBash(t, "ls "+sess+"/paths"); got != c.p1+"\n" || exists(dev) || exists(c.cliMnt+"/other") {
		t.Fatalf("after the restart: paths %q, device %v, session other %v; config:\n%s", got, exists(dev), exists(c.cliMnt+"/other"), cat(c.cliConf))
	}
}

// TestRailDownAtRestart: a client daemon restarted while one rail of a two-path session is
// down brings the session and its device up on the other rail at once, keeps the missing
// path in its config, and adds it when the rail comes back (the open needs every path; the
// declaration does not).
func TestRailDownAtRestart(t *testing.T) {
	c := startCluster(t)
	c.openSession(t, "")
	dev := c.mapDisk(t)
	c.clid.stop()
	rail2 := c.net.link[1]
	run(t, "ip", "-n", c.net.cli, "addr", "del", "10.77.2.1/24", "dev", rail2)
	c.clid.start()
	testutil.WaitFor(t, 20*time.Second, "the session on rail 1 and its device back", func() bool {
		return cat(c.pathFile(c.p1, "state")) == "connected\n" && exists(dev)
	})
	if exists(c.pathFile(c.p2, "state")) {
		t.Fatal("a path over the rail that is down")
	}
	mustBash(t, "dd if="+dev+" of=/dev/null bs=4k count=16 status=none")
	if conf := cat(c.cliConf); !strings.Contains(conf, c.p2) {
		t.Fatalf("the path over the rail that is down left the config:\n%s", conf)
	}
	run(t, "ip", "-n", c.net.cli, "addr", "add", "10.77.2.1/24", "dev", rail2)
	testutil.WaitFor(t, 60*time.Second, "the path over rail 2 added once it is back", func() bool {
		return cat(c.pathFile(c.p2, "state")) == "connected\n"
	})
	testutil.WaitFor(t, 10*time.Second, "one open_session line for e2e in the config", func() bool {
		return strings.Count(cat(c.cliConf), "open_session sessname=e2e ") == 1
	})
}

// TestRefusalsLogged: a control write that fails leaves a line naming the file, the input and
// the reason in the client's log, and the server logs the connection it refused with the
// peer's address and the cause.
func TestRefusalsLogged(t *testing.T) {
	c := startClusterWith(t, []string{"-allow=10.77.1.1"}, nil) // path 2's address is not allowed
	mustBash(t, "echo 'sessname=e2e path="+c.p1+"' > "+c.cliMnt+"/ctl/open_session")
	sess := c.cliMnt + "/e2e"
	for _, tc := range []struct{ file, input, errno string }{
		{sess + "/mpath_policy", "fastest-please", "invalid argument"},
		{sess + "/add_path", c.p1, "file exists"},
		{sess + "/add_path", c.p2, ""}, // refused by the server: its errno is the transport's
		{c.cliMnt + "/ctl/open_session", "sessname=bad#name path=" + c.p1, "invalid argument"},
	} {
		if out, err := bash(t, "echo '"+tc.input+"' > "+tc.file); err == nil {
			t.Fatalf("%s < %q accepted: %s", tc.file, tc.input, out)
		}
		name := filepath.Base(tc.file)
		testutil.WaitFor(t, 5*time.Second, "log line for "+name+" "+tc.input, func() bool {
			for _, l := range strings.Split(cat(c.clid.log), "\n") {
				if strings.Contains(l, "control write refused") && strings.Contains(l, name) &&
					strings.Contains(l, tc.input) && strings.Contains(strings.ToLower(l), tc.errno) {
					return true
				}
			}
			return false
		})
	}
	testutil.WaitFor(t, 5*time.Second, "server's refusal logged", func() bool {
		for _, l := range strings.Split(cat(c.srvd.log), "\n") {
			if strings.Contains(l, "10.77.2.1") && strings.Contains(l, "not allowed") {
				return true
			}
		}
		return false
	})
	// An OPEN the server refuses: the client's writer sees the errno, the server's log says why.
	if out, err := bash(t, "echo 'sessname=e2e device_path=no-such-export' > "+c.devMnt+"/ctl/map_device"); err == nil || !strings.Contains(out, "No such file or directory") {
		t.Fatalf("map_device of a missing export: %v %q", err, out)
	}
	testutil.WaitFor(t, 5*time.Second, "server's open refusal logged", func() bool {
		for _, l := range strings.Split(cat(c.srvd.log), "\n") {
			if strings.Contains(l, "open refused: no such file or directory") && strings.Contains(l, "no-such-export") && strings.Contains(l, "10.77.1.1") {
				return true
			}
		}
		return false
	})
	// Nothing refused changed anything.
	if got := mustBash(t, "ls "+sess+"/paths"); got != c.p1+"\n" {
		t.Fatalf("paths after the refusals %q", got)
	}
	if got := cat(sess + "/mpath_policy"); got != "min-inflight (MI: 1)\n" {
		t.Fatalf("mpath_policy after the refusal %q", got)
	}
}

// TestMapAfterLastUnmap: unmapping the last device closes the session, as the kernel does; a
// later map_device without path= fails with ENXIO and the log says what is missing; with
// path= it opens the session again.
func TestMapAfterLastUnmap(t *testing.T) {
	c := startCluster(t)
	mustBash(t, "echo 'sessname=e2e device_path=disk path="+c.p1+"' > "+c.devMnt+"/ctl/map_device")
	mustBash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/unmap_device")
	testutil.WaitFor(t, 10*time.Second, "session closed", func() bool { return !exists(c.cliMnt + "/e2e") })
	out, err := bash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/map_device")
	if err == nil || !strings.Contains(out, "No such device or address") {
		t.Fatalf("short map_device of a closed session: %v %q, want ENXIO", err, out)
	}
	testutil.WaitFor(t, 5*time.Second, "the reason in the log", func() bool {
		return strings.Contains(cat(c.clid.log), "no session \\\"e2e\\\" is open (unmapping its last device closes it) and the request names no path=")
	})
	mustBash(t, "echo 'sessname=e2e device_path=disk path="+c.p1+"' > "+c.devMnt+"/ctl/map_device")
	if !exists(c.devMnt + "/e2e/disk") {
		t.Fatal("map_device with path= did not map the device again")
	}
}

// TestLastPathRemovedSurvivesRestart: a session whose last path was removed (the kernel
// allows it) keeps, in the written-back config, the path it was declared with: a restart
// brings the session and its device back there, rather than dropping a declaration without
// path= and retrying the device's map forever.
func TestLastPathRemovedSurvivesRestart(t *testing.T) {
	c := startCluster(t)
	mustBash(t, "echo 'sessname=e2e path="+c.p1+"' > "+c.cliMnt+"/ctl/open_session")
	dev := c.mapDisk(t)
	mustBash(t, "echo 1 > "+c.pathFile(c.p1, "remove_path"))
	testutil.WaitFor(t, 10*time.Second, "the path gone", func() bool { return !exists(c.pathFile(c.p1, "state")) })
	if conf := cat(c.cliConf); !strings.Contains(conf, "open_session sessname=e2e ") || !strings.Contains(conf, "path="+c.p1) {
		t.Fatalf("the session's declaration after its last path went:\n%s", conf)
	}
	c.clid.stop()
	c.clid.start()
	testutil.WaitFor(t, 30*time.Second, "the session and its device back", func() bool {
		return cat(c.pathFile(c.p1, "state")) == "connected\n" && exists(dev)
	})
	mustBash(t, "dd if="+dev+" of=/dev/null bs=4k count=16 status=none")
}
