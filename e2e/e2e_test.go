// Package e2e runs the real daemons: rtrs-serverd in one network namespace, rtrs-clientd in
// another, joined by two veth pairs (two real paths), driven through their FUSE trees with
// the shell, with faults made real (links down, daemons killed).
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

var binDir string

func TestMain(m *testing.M) {
	os.Exit(func() int {
		if os.Geteuid() != 0 {
			fmt.Println("e2e: not root, skipped")
			return 0
		}
		d, err := os.MkdirTemp("", "rtrs-e2e-bin-")
		if err != nil {
			panic(err)
		}
		defer os.RemoveAll(d)
		out, err := exec.Command("go", "build", "-race", "-o", d+"/", "../cmd/rtrs-serverd", "../cmd/rtrs-clientd").CombinedOutput()
		if err != nil {
			fmt.Printf("e2e: build: %v\n%s", err, out)
			return 1
		}
		binDir = d
		return m.Run()
	}())
}

func requireTools(t *testing.T, tools ...string) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("RTRS_REQUIRE_TOOLS") != "" {
				t.Fatalf("%s not installed", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func bash(t *testing.T, script string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", script).CombinedOutput()
	return string(out), err
}

func mustBash(t *testing.T, script string) string {
	t.Helper()
	out, err := bash(t, script)
	if err != nil {
		t.Fatalf("%s: %v\n%s", script, err, out)
	}
	return out
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func cat(p string) string { b, _ := os.ReadFile(p); return string(b) }

// netEnv: namespaces S (server) and C (client) joined by two veth pairs:
// 10.77.1.1 (C) – 10.77.1.2 (S) and 10.77.2.1 (C) – 10.77.2.2 (S).
type netEnv struct {
	srv, cli string
	link     [2]string // the client-side veth of each path
}

func setupNet(t *testing.T) *netEnv {
	t.Helper()
	id := strconv.Itoa(os.Getpid() % 100000)
	e := &netEnv{srv: "rtrs-s" + id, cli: "rtrs-c" + id}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", e.srv).Run()
		_ = exec.Command("ip", "netns", "del", e.cli).Run()
	})
	run(t, "ip", "netns", "add", e.srv)
	run(t, "ip", "netns", "add", e.cli)
	for i := 1; i <= 2; i++ {
		c, s := fmt.Sprintf("rc%d-%s", i, id), fmt.Sprintf("rs%d-%s", i, id)
		e.link[i-1] = c
		run(t, "ip", "link", "add", c, "type", "veth", "peer", "name", s)
		run(t, "ip", "link", "set", c, "netns", e.cli)
		run(t, "ip", "link", "set", s, "netns", e.srv)
		run(t, "ip", "-n", e.cli, "addr", "add", fmt.Sprintf("10.77.%d.1/24", i), "dev", c)
		run(t, "ip", "-n", e.srv, "addr", "add", fmt.Sprintf("10.77.%d.2/24", i), "dev", s)
		run(t, "ip", "-n", e.cli, "link", "set", c, "up")
		run(t, "ip", "-n", e.srv, "link", "set", s, "up")
	}
	run(t, "ip", "-n", e.cli, "link", "set", "lo", "up")
	run(t, "ip", "-n", e.srv, "link", "set", "lo", "up")
	return e
}

// daemon is one running daemon in a network namespace (only the network one: its FUSE
// mounts stay visible to the test).
type daemon struct {
	t    *testing.T
	name string
	args []string
	env  []string
	ns   string
	log  string
	cmd  *exec.Cmd
}

func startDaemon(t *testing.T, ns, name string, args ...string) *daemon {
	t.Helper()
	d := &daemon{t: t, name: name, args: args, ns: ns, log: filepath.Join(t.TempDir(), name+".log")}
	d.start()
	t.Cleanup(d.stop)
	return d
}

func (d *daemon) start() {
	f, err := os.OpenFile(d.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		d.t.Fatal(err)
	}
	defer f.Close()
	args := append([]string{"--net=/run/netns/" + d.ns, filepath.Join(binDir, d.name)}, d.args...)
	d.cmd = exec.Command("nsenter", args...)
	d.cmd.Stdout, d.cmd.Stderr = f, f
	d.cmd.Env = append(os.Environ(), d.env...)
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
}

// kill9 kills the daemon as a crash would.
func (d *daemon) kill9() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	_ = d.cmd.Wait()
	d.cmd = nil
}

func (d *daemon) stop() {
	if d.cmd == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		// SIGQUIT: Go's runtime writes every goroutine's stack into the log and exits.
		_ = d.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = d.cmd.Process.Kill()
			<-done
		}
		d.t.Errorf("%s did not stop on SIGTERM; log:\n%s", d.name, cat(d.log))
	}
	if d.cmd.ProcessState != nil && !d.cmd.ProcessState.Success() {
		d.t.Errorf("%s exited with %v; log:\n%s", d.name, d.cmd.ProcessState, cat(d.log))
	}
	d.cmd = nil
}

type cluster struct {
	net              *netEnv
	srvd, clid       *daemon
	srvMnt, cliMnt   string
	rnbdMnt          string // the server's rnbd-server tree
	devMnt, exports  string
	cliConf, nbdSock string
	p1, p2, p1s, p2s string // client and server path directory names
}

const (
	fastCli = "-heartbeat-interval=200ms"
	fastRec = "-reconnect-delay=300ms"
)

func startCluster(t *testing.T) *cluster { t.Helper(); return startClusterWith(t, nil, nil) }

// startClusterWith starts the daemons with extra arguments for each.
func startClusterWith(t *testing.T, srvArgs, cliArgs []string) *cluster {
	t.Helper()
	requireTools(t, "nsenter", "ip")
	c := &cluster{net: setupNet(t)}
	dir := t.TempDir()
	c.srvMnt, c.cliMnt, c.devMnt = filepath.Join(dir, "srv"), filepath.Join(dir, "cli"), filepath.Join(dir, "dev")
	c.rnbdMnt = filepath.Join(dir, "rnbd")
	c.exports = filepath.Join(dir, "exports")
	if err := os.MkdirAll(c.exports, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(c.exports, "disk"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(c.exports, "disk"), 256<<20); err != nil {
		t.Fatal(err)
	}
	c.cliConf = filepath.Join(dir, "rtrs-clientd.conf")
	if err := os.WriteFile(c.cliConf, []byte("# e2e\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c.srvd = startDaemon(t, c.net.srv, "rtrs-serverd", append([]string{"-config=/dev/null", "-listen=[::]:1234",
		"-dev-search-path=" + c.exports, "-mount=" + c.srvMnt, "-rnbd-mount=" + c.rnbdMnt, "-heartbeat-interval=200ms", "-names-file=" + filepath.Join(dir, "names.json")}, srvArgs...)...)
	c.clid = startDaemon(t, c.net.cli, "rtrs-clientd", append([]string{"-config=" + c.cliConf, "-mount=" + c.cliMnt,
		"-dev-mount=" + c.devMnt, "-nbd-socket=" + filepath.Join(dir, "nbd.sock"), fastCli, fastRec, "-con-per-path=3"}, cliArgs...)...)
	c.nbdSock = filepath.Join(dir, "nbd.sock")
	testutil.WaitFor(t, 20*time.Second, "both trees mounted", func() bool {
		return exists(c.srvMnt) && exists(c.rnbdMnt+"/ctl/devices") && exists(c.cliMnt+"/ctl/open_session") && exists(c.devMnt+"/ctl/map_device")
	})
	c.p1, c.p2 = "ip:10.77.1.1@ip:10.77.1.2", "ip:10.77.2.1@ip:10.77.2.2"
	c.p1s, c.p2s = c.p1, c.p2
	return c
}

func (c *cluster) openSession(t *testing.T, extra string) {
	t.Helper()
	mustBash(t, fmt.Sprintf("echo 'sessname=e2e path=%s path=%s %s' > %s/ctl/open_session", c.p1, c.p2, extra, c.cliMnt))
}

func (c *cluster) mapDisk(t *testing.T) string {
	t.Helper()
	mustBash(t, "echo 'sessname=e2e device_path=disk' > "+c.devMnt+"/ctl/map_device")
	return c.devMnt + "/e2e/disk"
}

func (c *cluster) pathFile(p, f string) string {
	return filepath.Join(c.cliMnt, "e2e", "paths", p, f)
}

// rdmaOps is read-count + write-count of a path's stats/rdma.
func rdmaOps(t *testing.T, file string) uint64 {
	f := strings.Fields(cat(file))
	if len(f) < 6 {
		t.Fatalf("%s: %q", file, f)
	}
	r, _ := strconv.ParseUint(f[0], 10, 64)
	w, _ := strconv.ParseUint(f[2], 10, 64)
	return r + w
}

func field(t *testing.T, file string, i int) uint64 {
	f := strings.Fields(cat(file))
	if len(f) <= i {
		t.Fatalf("%s: %q", file, f)
	}
	v, _ := strconv.ParseUint(f[i], 10, 64)
	return v
}

func TestPathOperations(t *testing.T) {
	c := startCluster(t)
	c.openSession(t, "")
	sess := c.cliMnt + "/e2e"
	if got := mustBash(t, "ls "+sess+"/paths"); got != c.p1+"\n"+c.p2+"\n" {
		t.Fatalf("client paths %q", got)
	}
	testutil.WaitFor(t, 5*time.Second, "server paths", func() bool {
		out, _ := bash(t, "ls "+c.srvMnt+"/e2e/paths")
		return out == c.p1s+"\n"+c.p2s+"\n"
	})
	// remove_path, then add_path back.
	mustBash(t, "echo 1 > "+c.pathFile(c.p2, "remove_path"))
	if got := mustBash(t, "ls "+sess+"/paths"); got != c.p1+"\n" {
		t.Fatalf("after remove_path %q", got)
	}
	testutil.WaitFor(t, 5*time.Second, "server path 2 gone", func() bool { return !exists(c.srvMnt + "/e2e/paths/" + c.p2s) })
	mustBash(t, "echo "+c.p2+" > "+sess+"/add_path")
	testutil.WaitFor(t, 5*time.Second, "server path 2 back", func() bool { return exists(c.srvMnt + "/e2e/paths/" + c.p2s) })
	// disconnect and reconnect.
	mustBash(t, "echo 1 > "+c.pathFile(c.p2, "disconnect"))
	if got := cat(c.pathFile(c.p2, "state")); got != "disconnected\n" {
		t.Fatalf("state %q", got)
	}
	testutil.WaitFor(t, 5*time.Second, "server path 2 closed", func() bool { return !exists(c.srvMnt + "/e2e/paths/" + c.p2s) })
	mustBash(t, "echo 1 > "+c.pathFile(c.p2, "reconnect"))
	if got := cat(c.pathFile(c.p2, "state")); got != "connected\n" {
		t.Fatalf("state after reconnect %q", got)
	}
	// Server-side disconnect: the client comes back by itself and counts it.
	testutil.WaitFor(t, 5*time.Second, "server path 2", func() bool { return exists(c.srvMnt + "/e2e/paths/" + c.p2s + "/disconnect") })
	mustBash(t, "echo 1 > "+c.srvMnt+"/e2e/paths/"+c.p2s+"/disconnect")
	testutil.WaitFor(t, 15*time.Second, "client reconnect", func() bool { return field(t, c.pathFile(c.p2, "stats/reconnects"), 0) >= 1 })
	testutil.WaitFor(t, 5*time.Second, "connected", func() bool { return cat(c.pathFile(c.p2, "state")) == "connected\n" })
	// The config file got the session written back.
	if conf := cat(c.cliConf); !strings.Contains(conf, "open_session sessname=e2e") || !strings.Contains(conf, "path="+c.p2) {
		t.Fatalf("config not written back:\n%s", conf)
	}
	// So do the policy and the reconnect attempts changed through the tree.
	mustBash(t, "echo round-robin > "+c.cliMnt+"/e2e/mpath_policy && echo 42 > "+c.cliMnt+"/e2e/max_reconnect_attempts")
	if conf := cat(c.cliConf); !strings.Contains(conf, "mpath_policy=round-robin") || !strings.Contains(conf, "max_reconnect_attempts=42") {
		t.Fatalf("mpath_policy and max_reconnect_attempts not written back:\n%s", conf)
	}
}

// fioVerify writes and verifies the device through the device file, 4 jobs on disjoint
// regions; it returns fio's output.
func fioVerify(t *testing.T, dev string, size string) (string, error) {
	return bash(t, fmt.Sprintf("fio --name=v --filename=%s --rw=randwrite --bs=16k --size=%s --numjobs=4 "+
		"--offset_increment=%s --ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --group_reporting", dev, size, size))
}

func TestFailoverLinkDown(t *testing.T) {
	requireTools(t, "fio")
	c := startCluster(t)
	c.openSession(t, "mpath_policy=round-robin")
	dev := c.mapDisk(t)
	done := make(chan error, 1)
	var out string
	go func() {
		var err error
		out, err = fioVerify(t, dev, "48m")
		done <- err
	}()
	testutil.WaitFor(t, 30*time.Second, "IO on path 2", func() bool { return rdmaOps(t, c.pathFile(c.p2, "stats/rdma")) > 300 })
	run(t, "ip", "-n", c.net.cli, "link", "set", c.net.link[1], "down")
	testutil.WaitFor(t, 10*time.Second, "path 2 down", func() bool { return cat(c.pathFile(c.p2, "state")) == "disconnected\n" })
	time.Sleep(time.Second)
	run(t, "ip", "-n", c.net.cli, "link", "set", c.net.link[1], "up")
	if err := <-done; err != nil {
		t.Fatalf("fio: %v\n%s", err, out)
	}
	if fo := field(t, c.pathFile(c.p1, "stats/rdma"), 5); fo == 0 {
		t.Errorf("failovered on path 1 is 0; path 2 rdma %q", cat(c.pathFile(c.p2, "stats/rdma")))
	}
	testutil.WaitFor(t, 20*time.Second, "path 2 back", func() bool { return cat(c.pathFile(c.p2, "state")) == "connected\n" })
	if ok := field(t, c.pathFile(c.p2, "stats/reconnects"), 0); ok == 0 {
		t.Errorf("reconnects %q", cat(c.pathFile(c.p2, "stats/reconnects")))
	}
}

func TestDaemonsKilled(t *testing.T) {
	requireTools(t, "fio")
	c := startCluster(t)
	c.openSession(t, "")
	dev := c.mapDisk(t)
	mustBash(t, fmt.Sprintf("printf 'rtrs-e2e%%.0s' $(seq 131072) | dd of=%s bs=1M count=1 conv=notrunc,fsync iflag=fullblock status=none", dev))

	// The server crashes and comes back: the client reconnects, remaps, IO goes on.
	c.srvd.kill9()
	c.srvd.start()
	testutil.WaitFor(t, 30*time.Second, "both paths back", func() bool {
		return cat(c.pathFile(c.p1, "state")) == "connected\n" && cat(c.pathFile(c.p2, "state")) == "connected\n"
	})
	got := mustBash(t, "dd if="+dev+" bs=1M count=1 status=none | sha256sum")
	want := mustBash(t, fmt.Sprintf("printf 'rtrs-e2e%%.0s' $(seq 131072) | sha256sum"))
	if got != want {
		t.Fatalf("data after the server restart: %q, want %q", got, want)
	}
	if out, err := fioVerify(t, dev, "8m"); err != nil {
		t.Fatalf("fio after the server restart: %v\n%s", err, out)
	}
	want = mustBash(t, "dd if="+dev+" bs=1M count=32 status=none | sha256sum") // what fio left

	// The client crashes: its mounts go stale; the restart clears them and restores the
	// session and the device from the config it wrote back.
	c.clid.kill9()
	if _, err := os.Stat(c.cliMnt + "/ctl"); err == nil {
		t.Log("client mount answered after kill -9")
	}
	c.clid.start()
	testutil.WaitFor(t, 30*time.Second, "device restored", func() bool { return exists(dev) })
	got = mustBash(t, "dd if="+dev+" bs=1M count=32 status=none | sha256sum")
	if got != want {
		t.Fatalf("data after the client restart: %q", got)
	}
	if got := mustBash(t, "ls "+c.cliMnt+"/e2e/paths"); got != c.p1+"\n"+c.p2+"\n" {
		t.Fatalf("paths after the client restart %q", got)
	}
}

// TestPolicyUnderLoad: round-robin spreads requests evenly; min-inflight moves them off a
// path whose link is rate-limited.
func TestPolicyUnderLoad(t *testing.T) {
	requireTools(t, "fio", "tc")
	c := startCluster(t)
	c.openSession(t, "mpath_policy=round-robin")
	dev := c.mapDisk(t)
	load := func() {
		if out, err := bash(t, "fio --name=l --filename="+dev+" --rw=randwrite --bs=16k --size=64m --numjobs=4 --offset_increment=64m --ioengine=psync --runtime=3 --time_based"); err != nil {
			t.Fatalf("fio: %v\n%s", err, out)
		}
	}
	reset := func() {
		for _, p := range []string{c.p1, c.p2} {
			mustBash(t, "echo 1 > "+c.pathFile(p, "stats/reset_all"))
		}
	}
	reset()
	load()
	a, b := rdmaOps(t, c.pathFile(c.p1, "stats/rdma")), rdmaOps(t, c.pathFile(c.p2, "stats/rdma"))
	if a == 0 || b == 0 || float64(a)/float64(b) > 1.2 || float64(b)/float64(a) > 1.2 {
		t.Errorf("round-robin: %d and %d requests", a, b)
	}
	// Path 2 at 20 Mbit/s; min-inflight must send most requests to path 1.
	run(t, "tc", "-n", c.net.cli, "qdisc", "add", "dev", c.net.link[1], "root", "tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms")
	mustBash(t, "echo min-inflight > "+c.cliMnt+"/e2e/mpath_policy")
	reset()
	load()
	a, b = rdmaOps(t, c.pathFile(c.p1, "stats/rdma")), rdmaOps(t, c.pathFile(c.p2, "stats/rdma"))
	if a < 3*b {
		t.Errorf("min-inflight with path 2 throttled: path 1 %d, path 2 %d requests", a, b)
	}
	t.Logf("min-inflight: path 1 %d, path 2 %d requests", a, b)
}

// TestNotifyAndSignals: READY=1 and STATUS= reach systemd's socket; SIGHUP re-reads the
// config (RELOADING=1 … READY=1) and applies a new declaration; SIGUSR1 dumps the stacks;
// SIGTERM says STOPPING=1, unmounts and exits 0.
func TestNotifyAndSignals(t *testing.T) {
	requireTools(t, "nsenter", "ip")
	n := setupNet(t)
	dir := t.TempDir()
	exports := filepath.Join(dir, "exports")
	if err := os.MkdirAll(exports, 0o755); err != nil {
		t.Fatal(err)
	}
	srvd := startDaemon(t, n.srv, "rtrs-serverd", "-config=/dev/null", "-dev-search-path="+exports, "-mount="+dir+"/srv", "-rnbd-mount="+dir+"/rnbd", "-names-file=")
	_ = srvd
	sock := filepath.Join(dir, "notify.sock")
	ln, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	msgs := make(chan string, 64)
	go func() {
		buf := make([]byte, 4096)
		for {
			k, _, err := ln.ReadFromUnix(buf)
			if err != nil {
				close(msgs)
				return
			}
			msgs <- string(buf[:k])
		}
	}()
	expect := func(what string) string {
		t.Helper()
		timeout := time.After(20 * time.Second)
		for {
			select {
			case m, ok := <-msgs:
				if !ok {
					t.Fatalf("notify socket closed waiting for %s", what)
				}
				if strings.Contains(m, what) {
					return m
				}
			case <-timeout:
				t.Fatalf("no %s", what)
			}
		}
	}
	// A declaration whose server cannot be reached: retried until the reload drops it.
	conf := filepath.Join(dir, "c.conf")
	if err := os.WriteFile(conf, []byte("log-level = info\nopen_session sessname=ghost path=ip:10.77.1.1@ip:10.77.9.9\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cli := &daemon{t: t, name: "rtrs-clientd", ns: n.cli, log: filepath.Join(dir, "cli.log"), env: []string{"NOTIFY_SOCKET=" + sock},
		args: []string{"-config=" + conf, "-mount=" + dir + "/cli", "-dev-mount=" + dir + "/dev", "-nbd-socket="}}
	cli.start()
	t.Cleanup(cli.stop)
	if m := expect("READY=1"); !strings.Contains(m, "STATUS=0 sessions, 0/0 paths connected, 0 devices mapped") {
		t.Errorf("ready message %q", m)
	}
	testutil.WaitFor(t, 10*time.Second, "the unreachable declaration tried", func() bool { return strings.Contains(cat(cli.log), "sessname=ghost") })
	// A file that would not start the daemon (a mistyped token) is refused whole at the
	// reload: nothing changes, the log says so, and the ghost is still retried.
	if err := os.WriteFile(conf, []byte("log-level = info\nmap_device sessname=hup device_path=d acess_mode=ro\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = cli.cmd.Process.Signal(syscall.SIGHUP)
	testutil.WaitFor(t, 10*time.Second, "the bad reload refused", func() bool { return strings.Contains(cat(cli.log), "reload refused, nothing changed") })
	ghosts := strings.Count(cat(cli.log), "sessname=ghost")
	testutil.WaitFor(t, 10*time.Second, "the ghost retried after the refused reload", func() bool { return strings.Count(cat(cli.log), "sessname=ghost") > ghosts })
	// The operator replaces it: the reload drops the old line and applies the new one.
	if err := os.WriteFile(conf, []byte("log-level = info\nopen_session sessname=hup path=ip:10.77.1.1@ip:10.77.1.2 # the operator's note\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = cli.cmd.Process.Signal(syscall.SIGHUP)
	expect("RELOADING=1")
	expect("READY=1")
	testutil.WaitFor(t, 10*time.Second, "session from the reloaded config", func() bool { return exists(dir + "/cli/hup/paths/ip:10.77.1.1@ip:10.77.1.2") })
	expect("STATUS=1 sessions, 1/1 paths connected")
	testutil.WaitFor(t, 10*time.Second, "the config written back", func() bool { return strings.Contains(cat(conf), "written back") })
	if c := cat(conf); strings.Contains(c, "ghost") {
		t.Fatalf("a declaration deleted before the reload written back:\n%s", c)
	}
	// A line the operator adds and mistypes without a reload survives the next write-back
	// as it stands, for the next reload to refuse by name.
	bad := "map_device sessname=hup device_path=d acess_mode=ro"
	f, err := os.OpenFile(conf, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString(bad + "\n")
	f.Close()
	if err := os.WriteFile(dir+"/cli/hup/mpath_policy", []byte("round-robin"), 0); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the policy written back", func() bool {
		return strings.Contains(cat(conf), "mp_policy=round-robin") || strings.Contains(cat(conf), "mpath_policy=round-robin")
	})
	if c := cat(conf); !strings.Contains(c, bad) || strings.Contains(c, "the operator's note") || strings.Count(c, "sessname=hup path=") != 1 || strings.Count(c, "written back by") != 1 {
		// The declaration with a trailing comment is the daemon's (written back once, as
		// it now is); the one that does not parse stays as it stands.
		t.Fatalf("after the write-back:\n%s", c)
	}
	tried := strings.Count(cat(cli.log), "sessname=ghost")
	time.Sleep(3 * time.Second) // the old retries came every 1, 2, 4 s
	if n := strings.Count(cat(cli.log), "sessname=ghost"); n != tried {
		t.Fatalf("the deleted declaration still retried after the reload (%d log lines, %d before)", n, tried)
	}
	_ = cli.cmd.Process.Signal(syscall.SIGUSR1)
	testutil.WaitFor(t, 10*time.Second, "goroutine dump", func() bool { return strings.Contains(cat(cli.log), "goroutine dump (SIGUSR1)") })
	_ = cli.cmd.Process.Signal(syscall.SIGTERM)
	expect("STOPPING=1")
	if err := cli.cmd.Wait(); err != nil {
		t.Fatalf("exit: %v\n%s", err, cat(cli.log))
	}
	cli.cmd = nil
	if out := run(t, "cat", "/proc/self/mounts"); strings.Contains(out, dir+"/cli") {
		t.Fatal("client tree still mounted after SIGTERM")
	}
}

// TestLoopDevice: the device file backs a loop device carrying an ext4 file system.
func TestLoopDevice(t *testing.T) {
	requireTools(t, "losetup", "mkfs.ext4")
	if !exists("/dev/loop-control") {
		t.Skip("no loop devices")
	}
	c := startCluster(t)
	c.openSession(t, "")
	dev := c.mapDisk(t)
	loop := strings.TrimSpace(run(t, "losetup", "-f", "--show", dev))
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", loop).Run() })
	run(t, "mkfs.ext4", "-q", "-F", loop)
	mnt := t.TempDir()
	run(t, "mount", loop, mnt)
	mustBash(t, "seq 100000 > "+mnt+"/numbers && sync")
	run(t, "umount", mnt)
	run(t, "mount", "-o", "ro", loop, mnt)
	if got := mustBash(t, "md5sum < "+mnt+"/numbers"); got != mustBash(t, "seq 100000 | md5sum") {
		t.Errorf("file read back through ext4 on the loop device differs")
	}
	run(t, "umount", mnt)
}

// TestNBDSocket: a device mapped through the tree is served on the daemon's NBD socket.
func TestNBDSocket(t *testing.T) {
	requireTools(t, "nbdinfo", "nbdcopy")
	c := startCluster(t)
	c.openSession(t, "")
	dev := c.mapDisk(t)
	out := run(t, "nbdinfo", "--list", "nbd+unix:///?socket="+c.nbdSock)
	if !strings.Contains(out, "e2e/disk") || !strings.Contains(out, "268435456") {
		t.Fatalf("nbdinfo --list:\n%s", out)
	}
	src := filepath.Join(t.TempDir(), "src")
	mustBash(t, "head -c 8M /dev/urandom > "+src)
	run(t, "nbdcopy", src, "nbd+unix:///e2e/disk?socket="+c.nbdSock)
	if got, want := mustBash(t, "head -c 8M "+dev+" | sha256sum"), mustBash(t, "sha256sum < "+src); got != want {
		t.Fatalf("device file after nbdcopy: %q, want %q", got, want)
	}
}

// TestServerReload: SIGHUP makes rtrs-serverd take a new export search path from its config.
func TestServerReload(t *testing.T) {
	requireTools(t, "nsenter", "ip")
	n := setupNet(t)
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, d := range []string{a, b} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(b, "only-in-b"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "s.conf")
	if err := os.WriteFile(conf, []byte("dev-search-path = "+a+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir+"/c.conf", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	srv := startDaemon(t, n.srv, "rtrs-serverd", "-config="+conf, "-mount="+dir+"/srv", "-rnbd-mount="+dir+"/rnbd")
	cli := startDaemon(t, n.cli, "rtrs-clientd", "-config="+dir+"/c.conf", "-mount="+dir+"/cli",
		"-dev-mount="+dir+"/dev", "-nbd-socket=")
	_ = cli
	testutil.WaitFor(t, 20*time.Second, "mounts", func() bool { return exists(dir+"/srv") && exists(dir+"/dev/ctl/map_device") })
	mapIt := "echo 'sessname=r device_path=only-in-b path=ip:10.77.1.1@ip:10.77.1.2' > " + dir + "/dev/ctl/map_device"
	if out, err := bash(t, mapIt); err == nil || !strings.Contains(out, "No such file or directory") {
		t.Fatalf("map before the reload: %q %v", out, err)
	}
	// A file that would not start the server is refused whole: the search path stays.
	if err := os.WriteFile(conf, []byte("dev-search-path = "+b+"\nmax-sessions = 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = srv.cmd.Process.Signal(syscall.SIGHUP)
	testutil.WaitFor(t, 10*time.Second, "the bad reload refused", func() bool { return strings.Contains(cat(srv.log), "reload refused, nothing changed") })
	if out, err := bash(t, mapIt); err == nil || !strings.Contains(out, "No such file or directory") {
		t.Fatalf("map after a refused reload: %q %v", out, err)
	}
	if err := os.WriteFile(conf, []byte("dev-search-path = "+b+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = srv.cmd.Process.Signal(syscall.SIGHUP)
	for end := time.Now().Add(10 * time.Second); !strings.Contains(cat(srv.log), "reload: exports under "+b); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("no reload; log:\n%s", cat(srv.log))
		}
	}
	mustBash(t, mapIt)
	if !exists(dir + "/dev/r/only-in-b") {
		t.Fatal("device not mapped after the reload")
	}
}

// TestPathReadd: remove_path immediately followed by add_path of the same path (what
// `rnbd client path readd` does), 200 times through the tree: every add works, though the
// server may still be closing the removed path when the new one connects.
func TestPathReadd(t *testing.T) {
	c := startCluster(t)
	c.openSession(t, "")
	sess := c.cliMnt + "/e2e"
	script := fmt.Sprintf(`for i in $(seq 200); do
		echo 1 > %s || { echo "round $i: remove_path failed"; exit 1; }
		echo %s > %s/add_path || { echo "round $i: add_path failed"; exit 1; }
	done`, c.pathFile(c.p2, "remove_path"), c.p2, sess)
	start := time.Now()
	if out, err := bash(t, script); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("200 remove/add rounds in %v", time.Since(start).Round(time.Millisecond))
	if got := mustBash(t, "ls "+sess+"/paths"); got != c.p1+"\n"+c.p2+"\n" {
		t.Fatalf("paths after the rounds %q", got)
	}
	if got := cat(c.pathFile(c.p2, "state")); got != "connected\n" {
		t.Fatalf("state after the rounds %q", got)
	}
}

// TestDemoPipedInterrupted: `make demo | cat` stopped with Ctrl-C (SIGINT to the whole
// pipeline) leaves nothing behind: no mount, no socket, no config, no export.
func TestDemoPipedInterrupted(t *testing.T) {
	requireTools(t, "setsid", "mountpoint")
	for _, p := range []string{"/run/rtrs-demo", "/dev/shm/rtrs-demo-exports"} {
		if exists(p) {
			t.Fatalf("%s exists before the demo: another demo is running?", p)
		}
	}
	cmd := exec.Command("setsid", "bash", "-c", "exec ../scripts/demo.sh 2>&1 | cat")
	out := &bytes.Buffer{}
	cmd.Stdout = out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	// A failure before the interrupt below must not leave the demo running: it holds the demo's
	// port and paths, which the next run checks for.
	t.Cleanup(func() {
		select {
		case <-done:
			return
		default:
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	})
	testutil.WaitFor(t, 3*time.Minute, "the demo's device", func() bool { return exists("/run/rtrs-demo/dev/demo/disk") })
	// Ctrl-C: SIGINT to the process group, pipe reader included.
	if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		t.Fatalf("the demo did not stop:\n%s", out)
	}
	mounts := cat("/proc/self/mountinfo")
	for _, p := range []string{"/run/rtrs-demo", "/dev/shm/rtrs-demo-exports"} {
		if exists(p) || strings.Contains(mounts, p) {
			t.Errorf("%s left behind", p)
		}
	}
	if t.Failed() {
		t.Logf("demo output:\n%s", out)
	}
}
