package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// bgWrite is a control-file write running in the background.
type bgWrite struct {
	done chan struct{}
	end  time.Time // when the write returned
	out  string
	err  error
}

func startWrite(line, file string) *bgWrite {
	w := &bgWrite{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, "bash", "-c", fmt.Sprintf("echo '%s' > %s", line, file)).CombinedOutput()
		w.end, w.out, w.err = time.Now(), string(out), err
	}()
	return w
}

func (w *bgWrite) pending() bool {
	select {
	case <-w.done:
		return false
	default:
		return true
	}
}

func (w *bgWrite) wait(t *testing.T) {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(3 * time.Minute):
		t.Fatal("a control write did not end")
	}
}

// slowPath leads to 10.77.1.99, which dropAddr sets up.
const slowPath = "ip:10.77.1.1@ip:10.77.1.99"

// dropAddr puts 10.77.1.99 on the server's veth of the first path and makes the client
// send to it with a MAC nobody has (a permanent neighbour entry): the server's veth drops
// those frames as meant for another host, so a connect hangs with no RST and no ICMP, which
// it checks. It returns the server's veth.
func dropAddr(t *testing.T, c *cluster) string {
	t.Helper()
	srvLink := strings.Replace(c.net.link[0], "rc", "rs", 1)
	run(t, "ip", "-n", c.net.srv, "addr", "add", "10.77.1.99/24", "dev", srvLink)
	run(t, "ip", "-n", c.net.cli, "neigh", "replace", "10.77.1.99", "lladdr", "02:00:5e:00:00:99", "dev", c.net.link[0], "nud", "permanent")
	if out, err := bash(t, fmt.Sprintf("ip netns exec %s timeout 2 bash -c 'exec 3<>/dev/tcp/10.77.1.99/1234'", c.net.cli)); err == nil || !strings.Contains(err.Error(), "124") {
		t.Fatalf("a connect to the dropping address did not hang: %v\n%s", err, out)
	}
	return srvLink
}

// TestSlowOpenDoesNotFreezeTree: a session opens to an address whose SYNs vanish (a
// permanent neighbour entry with a MAC nobody has: the server's veth drops the frames, so
// there is no RST and no ICMP). While that open_session waits, the client tree, a healthy
// session's stats, ctl/devices, a metrics scrape and the NBD export list all answer, and
// none shows the session being opened. A second open_session and a map_device of the same
// name wait for the open; once the address is reachable (the neighbour entry then points
// at the server) the open succeeds, the second open_session is EEXIST, the map_device maps
// into that session, and the tree holds one session of that name.
func TestSlowOpenDoesNotFreezeTree(t *testing.T) {
	requireTools(t, "nbdinfo", "curl")
	const metricsAddr = "127.0.0.1:9853"
	c := startClusterWith(t, nil, []string{"-metrics=" + metricsAddr})
	c.openSession(t, "")
	c.mapDisk(t)

	srvLink := dropAddr(t, c)
	start := time.Now()
	open := startWrite("sessname=slow path="+slowPath, c.cliMnt+"/ctl/open_session")
	time.Sleep(time.Second) // its first SYN is out and dropped (seen as a hanging write below)
	if !open.pending() {
		t.Fatalf("open_session to the dropping address ended: %v\n%s", open.err, open.out)
	}

	// Readers: each must return while the open is pending.
	type read struct {
		what string
		fn   func() (string, error)
		want string
	}
	statsFile := c.pathFile(c.p1, "stats/rdma")
	reads := []read{
		{"ls of the client tree", func() (string, error) { return bash(t, "ls "+c.cliMnt) }, "e2e"},
		{"stats of the healthy session", func() (string, error) { return bash(t, "cat "+statsFile) }, ""},
		{"ctl/devices", func() (string, error) { return bash(t, "cat "+c.devMnt+"/ctl/devices") }, "e2e/disk"},
		{"metrics scrape", func() (string, error) {
			return bash(t, fmt.Sprintf("ip netns exec %s curl -sS --fail --max-time 60 http://%s/metrics", c.net.cli, metricsAddr))
		}, `session="e2e"`},
		{"NBD export list", func() (string, error) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out, err := exec.CommandContext(ctx, "nbdinfo", "--list", "nbd+unix:///?socket="+c.nbdSock).CombinedOutput()
			return string(out), err
		}, "e2e/disk"},
	}
	for _, r := range reads {
		t0 := time.Now()
		out, err := r.fn()
		took := time.Since(t0)
		if err != nil {
			t.Fatalf("%s: %v\n%s", r.what, err, out)
		}
		if !open.pending() {
			t.Fatalf("%s returned (after %v) only once the open had ended", r.what, took.Round(time.Millisecond))
		}
		if !strings.Contains(out, r.want) || strings.Contains(out, "slow") {
			t.Fatalf("%s during the open: want %q in it and no session slow:\n%s", r.what, r.want, out)
		}
		t.Logf("%s: %v while the open was pending", r.what, took.Round(time.Millisecond))
	}

	// Same name meanwhile: both wait for the pending open and make no second session.
	again := startWrite("sessname=slow path="+slowPath, c.cliMnt+"/ctl/open_session")
	mapped := startWrite("sessname=slow device_path=disk access_mode=ro path="+slowPath, c.devMnt+"/ctl/map_device")
	time.Sleep(2 * time.Second)
	if !open.pending() || !again.pending() || !mapped.pending() {
		t.Fatalf("pending: open %v, second open %v, map %v (the first must still hang, the others wait for it)\n%s%s%s",
			open.pending(), again.pending(), mapped.pending(), open.out, again.out, mapped.out)
	}
	if ents, err := filepath.Glob(c.cliMnt + "/slow*"); err != nil || len(ents) != 0 {
		t.Fatalf("session directories of slow while it opens: %q %v", ents, err)
	}

	// Make the address reachable: TCP's next SYN retransmission connects.
	mac := strings.TrimSpace(mustBash(t, fmt.Sprintf("ip -n %s link show %s | awk '/link\\/ether/ {print $2}'", c.net.srv, srvLink)))
	run(t, "ip", "-n", c.net.cli, "neigh", "replace", "10.77.1.99", "lladdr", mac, "dev", c.net.link[0], "nud", "permanent")
	lifted := time.Now()
	if !open.pending() {
		t.Fatalf("the open ended before the address became reachable: %v\n%s", open.err, open.out)
	}
	open.wait(t)
	if open.err != nil {
		t.Fatalf("open_session once reachable: %v\n%s", open.err, open.out)
	}
	t.Logf("open_session took %v (pending %v until the address was reachable)", open.end.Sub(start).Round(time.Millisecond), lifted.Sub(start).Round(time.Millisecond))
	again.wait(t)
	if again.err == nil || !strings.Contains(again.out, "File exists") {
		t.Fatalf("second open_session of slow: %v %q, want EEXIST", again.err, again.out)
	}
	mapped.wait(t)
	if mapped.err != nil {
		t.Fatalf("map_device into slow while it opened: %v\n%s", mapped.err, mapped.out)
	}
	if got := strings.Fields(mustBash(t, "ls "+c.cliMnt)); strings.Join(got, " ") != "ctl e2e slow" {
		t.Fatalf("client tree %q, want ctl e2e slow", got)
	}
	if got := strings.Fields(mustBash(t, "ls "+c.cliMnt+"/slow/paths")); len(got) != 1 {
		t.Fatalf("paths of slow: %q, want one", got)
	}
	if devs := cat(c.devMnt + "/ctl/devices"); !strings.Contains(devs, "slow/disk open ro") {
		t.Fatalf("ctl/devices:\n%s", devs)
	}
}

// TestStopDuringSlowOpen: SIGTERM while an open_session waits for an address that drops
// its SYNs: rtrs-clientd aborts the open and exits well within the connect timeout (30 s;
// the daemon helper fails the test after 20 s), the pending write fails.
func TestStopDuringSlowOpen(t *testing.T) {
	c := startCluster(t)
	dropAddr(t, c)
	open := startWrite("sessname=slow path="+slowPath, c.cliMnt+"/ctl/open_session")
	time.Sleep(time.Second)
	if !open.pending() {
		t.Fatalf("open_session to the dropping address ended: %v\n%s", open.err, open.out)
	}
	t0 := time.Now()
	c.clid.stop()
	t.Logf("rtrs-clientd stopped in %v with an open pending", time.Since(t0).Round(time.Millisecond))
	open.wait(t)
	if open.err == nil {
		t.Fatalf("open_session succeeded while the daemon stopped:\n%s", open.out)
	}
}
