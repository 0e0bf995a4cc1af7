package fsview

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

type trees struct {
	cli, srv, dev, rnbd string // mount points
	port                uint16
	exports             string
	client              *rnbd.Client
}

func fast() transport.Timings { return transport.Timings(testutil.FastTimings()) }

// mountTrees starts an RNBD server over soft RTRS and mounts the three trees in-process.
func mountTrees(t *testing.T) *trees {
	t.Helper()
	requireFUSE(t)
	prov := soft.New(soft.Options{})
	exports := t.TempDir()
	if err := os.WriteFile(filepath.Join(exports, "disk"), make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: exports})
	if err != nil {
		t.Fatal(err)
	}
	so := transport.DefaultServerOptions()
	so.Provider, so.Handler, so.Timings = prov, rs, fast()
	so.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	so.QueueDepth = 64
	srv, err := transport.NewServer(so)
	if err != nil {
		t.Fatal(err)
	}
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: prov, ConPerPath: 2,
		MaxReconnectAttempts: -1, Policy: transport.MinInflight, Timings: fast()}, ReconnectTimeout: 5 * time.Second})
	ct := &ClientTree{Ctl: &control.Client{RNBD: c}, Timeout: 20 * time.Second}
	tr := &trees{port: srv.Addr().Port(), exports: exports, client: c}
	tr.cli = mount(t, ct)
	tr.srv = mount(t, &ServerTree{Server: srv})
	tr.dev = mount(t, &DevTree{Ctl: ct.Ctl, Timeout: ct.Timeout})
	tr.rnbd = mount(t, &RNBDServerTree{Server: rs})
	// Mounts go first at cleanup (registered last), then the sessions and the server.
	t.Cleanup(func() {
		c.Close(t.Context())
		_ = srv.Close()
		rs.Close()
	})
	return tr
}

func mustSh(t *testing.T, script string) string {
	t.Helper()
	out, err := sh(t, script)
	if err != nil {
		t.Fatalf("%s: %v\n%s", script, err, out)
	}
	return out
}

// shErr runs a script that must fail with the error text want (what bash's echo prints).
func shErr(t *testing.T, script, want string) {
	t.Helper()
	out, err := sh(t, script)
	if err == nil || !strings.Contains(out, want) {
		t.Errorf("%s: %q %v, want %q", script, out, err, want)
	}
}

func TestClientServerTrees(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	cli, srv := tr.cli, tr.srv
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	p2 := "ip:127.0.0.2@ip:127.0.0.1"

	if got := mustSh(t, "cat "+cli+"/ctl/open_session"); got != openUsage {
		t.Errorf("open_session usage %q", got)
	}
	shErr(t, "echo 'sessname=s1' > "+cli+"/ctl/open_session", "Invalid argument")
	shErr(t, "echo 'sessname=s1 path=10.0.0.1' > "+cli+"/ctl/open_session", "Protocol not supported") // no ip: or gid:, as the kernel's map_device
	shErr(t, "echo 'sessname=a/b path="+p1+"' > "+cli+"/ctl/open_session", "Invalid argument")
	shErr(t, "echo 'sessname=s1 path="+p1+" bogus=1' > "+cli+"/ctl/open_session", "Invalid argument")
	if got := mustSh(t, "ls "+cli); got != "ctl\n" {
		t.Fatalf("sessions after bad opens: %q", got)
	}
	mustSh(t, fmt.Sprintf("echo 'sessname=s1 dest_port=%d path=%s mpath_policy=round-robin' > %s/ctl/open_session", tr.port, p1, cli))
	sd := cli + "/s1"
	want := map[string]string{
		"ls " + sd:                              "add_path\nmax_reconnect_attempts\nmp_policy\nmpath_policy\npaths\n",
		"ls " + sd + "/paths":                   p1 + "\n",
		"cat " + sd + "/add_path":               addPathUsage,
		"cat " + sd + "/mpath_policy":           "round-robin (RR: 0)\n",
		"cat " + sd + "/mp_policy":              "round-robin (RR: 0)\n",
		"cat " + sd + "/max_reconnect_attempts": "-1\n",
	}
	for script, w := range want {
		if got := mustSh(t, script); got != w {
			t.Errorf("%s: %q, want %q", script, got, w)
		}
	}
	pd := sd + "/paths/" + p1
	golden := map[string]string{
		"state": "connected\n", "hca_name": "soft_lo\n", "hca_port": "1\n", "src_addr": "ip:127.0.0.1\n",
		"dst_addr": "ip:127.0.0.1\n", "reconnect": "Usage: echo 1 > reconnect\n",
		"disconnect": "Usage: echo 1 > disconnect\n", "remove_path": "Usage: echo 1 > remove_path\n",
		"stats/reset_all":  "echo 1 to reset all statistics\n",
		"stats/rdma":       "1 72 0 0 0 0\n", // SESS_INFO: a 36-byte READ with a 36-byte header
		"stats/reconnects": "0 0\n",
	}
	for f, w := range golden {
		if got := mustSh(t, "cat "+pd+"/"+f); got != w {
			t.Errorf("%s: %q, want %q", f, got, w)
		}
	}
	if got := mustSh(t, "cat "+pd+"/cur_latency"); !regexp.MustCompile(`^\d+ ns\n$`).MatchString(got) {
		t.Errorf("cur_latency %q", got)
	}
	if got := mustSh(t, "cat "+pd+"/stats/cpu_migration_from"); !regexp.MustCompile(`^(\d+ )+\n$`).MatchString(got) {
		t.Errorf("cpu_migration_from %q", got)
	}

	// Policy stores, good and bad.
	for in, w := range map[string]string{"1": "min-inflight (MI: 1)\n", "ML": "min-latency (ML: 2)\n",
		"Round-Robin-please": "round-robin (RR: 0)\n", "mi": "min-inflight (MI: 1)\n"} {
		mustSh(t, "echo "+in+" > "+sd+"/mpath_policy")
		if got := mustSh(t, "cat "+sd+"/mp_policy"); got != w {
			t.Errorf("policy %q → %q, want %q", in, got, w)
		}
	}
	mustSh(t, "echo mi > "+sd+"/mpath_policy")
	for _, bad := range []string{"3", "-1", "mix", "min"} {
		shErr(t, "printf -- '"+bad+"' > "+sd+"/mpath_policy", "Invalid argument")
	}
	// One newline is stripped, not two (one write; bash's printf would make two).
	if err := os.WriteFile(sd+"/mpath_policy", []byte("rr\n\n"), 0); err == nil {
		t.Error("rr with two newlines accepted")
	}
	if got := mustSh(t, "cat "+sd+"/mpath_policy"); got != "min-inflight (MI: 1)\n" {
		t.Errorf("policy changed by bad input: %q", got)
	}
	mustSh(t, "echo 5 > "+sd+"/max_reconnect_attempts")
	shErr(t, "echo 10000 > "+sd+"/max_reconnect_attempts", "Invalid argument")
	shErr(t, "echo ' 3' > "+sd+"/max_reconnect_attempts", "Invalid argument")
	shErr(t, "echo 99999999999 > "+sd+"/max_reconnect_attempts", "Numerical result out of range")
	if got := mustSh(t, "cat "+sd+"/max_reconnect_attempts"); got != "5\n" {
		t.Errorf("max_reconnect_attempts %q", got)
	}

	// add_path: bad, good, duplicate.
	shErr(t, "echo 127.0.0.2 > "+sd+"/add_path", "Invalid argument")
	mustSh(t, "echo "+p2+" > "+sd+"/add_path")
	if got := mustSh(t, "ls "+sd+"/paths"); got != p1+"\n"+p2+"\n" {
		t.Errorf("paths after add_path: %q", got)
	}
	shErr(t, "echo "+p2+" > "+sd+"/add_path", "File exists")

	// The server tree shows the session and both paths.
	if got := mustSh(t, "ls "+srv+" "+srv+"/s1/paths"); got != srv+":\ns1\n\n"+srv+"/s1/paths:\n"+p1+"\n"+p2+"\n" {
		t.Errorf("server tree: %q", got)
	}
	spd := srv + "/s1/paths/" + p2
	if got := mustSh(t, "ls "+spd+" "+spd+"/stats"); !strings.Contains(got, "disconnect\ndst_addr\nhca_name\nhca_port\nsrc_addr\nstats\n") ||
		!strings.Contains(got, "rdma\nreset_all\nwc_completion\n") {
		t.Errorf("server path dir: %q", got)
	}
	if got := mustSh(t, "cat "+spd+"/src_addr "+spd+"/dst_addr "+spd+"/stats/rdma"); got != "ip:127.0.0.2\nip:127.0.0.1\n0 0 0 0\n" {
		t.Errorf("server path files: %q", got)
	}

	// Client disconnect and reconnect of path 2, seen in state.
	mustSh(t, "echo 1 > "+sd+"/paths/"+p2+"/disconnect")
	if got := mustSh(t, "cat "+sd+"/paths/"+p2+"/state"); got != "disconnected\n" {
		t.Errorf("state after disconnect %q", got)
	}
	shErr(t, "echo 2 > "+sd+"/paths/"+p2+"/reconnect", "Invalid argument")
	mustSh(t, "echo 1 > "+sd+"/paths/"+p2+"/reconnect")
	if got := mustSh(t, "cat "+sd+"/paths/"+p2+"/state"); got != "connected\n" {
		t.Errorf("state after reconnect %q", got)
	}
	// Server-side disconnect: the file goes with the write; the client reconnects by itself.
	testutil.WaitFor(t, 5*time.Second, "server path 2", func() bool { _, err := os.Stat(spd + "/disconnect"); return err == nil })
	mustSh(t, "echo 1 > "+spd+"/disconnect")
	testutil.WaitFor(t, 10*time.Second, "the client's reconnect", func() bool {
		out, _ := sh(t, "cat "+sd+"/paths/"+p2+"/stats/reconnects")
		return strings.HasPrefix(out, "1 ")
	})

	// Stats resets: 1 resets, anything else (0 too, as in the kernel) is EINVAL and resets
	// nothing.
	before := mustSh(t, "cat "+pd+"/stats/reconnects")
	shErr(t, "echo 2 > "+pd+"/stats/rdma", "Invalid argument")
	shErr(t, "echo 0 > "+pd+"/stats/reconnects", "Invalid argument")
	if got := mustSh(t, "cat "+pd+"/stats/reconnects"); got != before {
		t.Errorf("reconnects after a refused reset: %q, was %q", got, before)
	}
	mustSh(t, "echo 1 > "+pd+"/stats/reset_all")
	if got := mustSh(t, "cat "+pd+"/stats/reconnects"); got != "0 0\n" {
		t.Errorf("reconnects after reset_all: %q", got)
	}

	// remove_path: the directory goes at once, on both sides.
	mustSh(t, "echo 1 > "+sd+"/paths/"+p2+"/remove_path")
	if got := mustSh(t, "ls "+sd+"/paths"); got != p1+"\n" {
		t.Errorf("paths after remove_path: %q", got)
	}
	testutil.WaitFor(t, 5*time.Second, "server path 2 gone", func() bool { _, err := os.Stat(spd); return os.IsNotExist(err) })

	// ls -l: regular files of 4096 bytes, modes as the kernel's.
	ll := mustSh(t, "ls -l "+pd)
	if !strings.Contains(ll, "-r--r--r-- 1 root root 4096") || !strings.Contains(ll, "-rw-r--r-- 1 root root 4096") {
		t.Errorf("ls -l:\n%s", ll)
	}
	// Read-only files refuse writes with EACCES.
	shErr(t, "echo 1 > "+pd+"/state", "Permission denied")

	shErr(t, "echo nosuch > "+cli+"/ctl/close_session", "No such file or directory")
	mustSh(t, "echo s1 > "+cli+"/ctl/close_session")
	if got := mustSh(t, "ls "+cli); got != "ctl\n" {
		t.Errorf("after close_session: %q", got)
	}
}

func TestDeviceView(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	dev := tr.dev
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	shErr(t, "echo 'device_path=disk' > "+dev+"/ctl/map_device", "Invalid argument")
	shErr(t, fmt.Sprintf("echo 'sessname=b device_path=missing dest_port=%d path=%s' > %s/ctl/map_device", tr.port, p1, dev), "No such file or directory")
	seven := strings.Repeat(" path="+p1, 7)
	shErr(t, "echo 'sessname=b device_path=disk"+seven+"' > "+dev+"/ctl/map_device", "Cannot allocate memory")
	mustSh(t, fmt.Sprintf("echo 'sessname=b device_path=/disk dest_port=%d path=%s access_mode=rw' > %s/ctl/map_device", tr.port, p1, dev))
	if got := mustSh(t, "ls "+dev+" "+dev+"/b"); got != dev+":\nb\nctl\n\n"+dev+"/b:\ndisk\n" {
		t.Fatalf("device view: %q", got)
	}
	// The session shows in the client tree too.
	if got := mustSh(t, "ls "+tr.cli); got != "b\nctl\n" {
		t.Errorf("client tree: %q", got)
	}
	f := dev + "/b/disk"
	if got := mustSh(t, "stat -c %s "+f); got != "4194304\n" {
		t.Errorf("device size %q", got)
	}
	src := filepath.Join(t.TempDir(), "src")
	data := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	mustSh(t, fmt.Sprintf("dd if=%s of=%s bs=256k seek=4 conv=notrunc,fsync status=none", src, f))
	back := mustSh(t, fmt.Sprintf("dd if=%s bs=256k skip=4 count=4 status=none | sha256sum", f))
	wantSum := mustSh(t, "sha256sum < "+src)
	if back != wantSum {
		t.Fatalf("read back %q, want %q", back, wantSum)
	}
	onServer, err := os.ReadFile(filepath.Join(tr.exports, "disk"))
	if err != nil || !bytes.Equal(onServer[1<<20:2<<20], data) {
		t.Fatalf("backing file differs (%v)", err)
	}
	// fallocate zeroes through the server, as on a block device.
	mustSh(t, "fallocate -z -o 1179648 -l 65536 "+f+" && fallocate -p -o 1310720 -l 4096 "+f)
	onServer, err = os.ReadFile(filepath.Join(tr.exports, "disk"))
	if err != nil || !bytes.Equal(onServer[1179648:1179648+65536], make([]byte, 65536)) || !bytes.Equal(onServer[1310720:1310720+4096], make([]byte, 4096)) ||
		!bytes.Equal(onServer[1179648+65536:1310720], data[1179648+65536-1<<20:1310720-1<<20]) {
		t.Fatalf("after fallocate's zero range and punch hole the backing file holds other data (%v)", err)
	}
	shErr(t, fmt.Sprintf("echo 'sessname=b device_path=disk dest_port=%d path=%s' > %s/ctl/map_device", tr.port, p1, dev), "File exists")
	shErr(t, "echo 'sessname=b device_path=other' > "+dev+"/ctl/unmap_device", "No such file or directory")
	mustSh(t, "echo 'sessname=b device_path=/disk' > "+dev+"/ctl/unmap_device")
	if got := mustSh(t, "ls "+dev); got != "ctl\n" {
		t.Errorf("after unmap: %q", got)
	}
	if got := mustSh(t, "ls "+tr.cli); got != "ctl\n" {
		t.Errorf("session kept after its last device: %q", got)
	}
}

// TestDeviceViewPerDevice: ctl/mapped/<device>@<session>/ holds the kernel's rnbd-client
// files for each mapped device, in its formats and with its errnos: remap_device of an open
// device is EALREADY, resize takes a new size (the export grown on the server), unmap_device
// takes normal or force.
func TestDeviceViewPerDevice(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	dev := tr.dev
	mustSh(t, fmt.Sprintf("echo 'sessname=b device_path=/disk dest_port=%d path=ip:127.0.0.1@ip:127.0.0.1' > %s/ctl/map_device", tr.port, dev))
	m := dev + "/ctl/mapped"
	if got := mustSh(t, "ls "+m+" "+m+"/!disk@b"); got != m+":\n!disk@b\n\n"+m+"/!disk@b:\naccess_mode\nmapping_path\nnr_poll_queues\nremap_device\nresize\nsession\nstate\nunmap_device\n" {
		t.Fatalf("ctl/mapped: %q", got)
	}
	d := m + "/!disk@b/" // the kernel's name: '/' as '!'

	for f, want := range map[string]string{"state": "open\n", "session": "b\n", "mapping_path": "/disk\n", "access_mode": "rw\n",
		"nr_poll_queues": "0\n", "remap_device": "Usage: echo <1> > remap_device\n", "resize": "Usage: echo <new size in sectors> > resize\n",
		"unmap_device": "Usage: echo <normal|force> > unmap_device\n"} {
		if got := mustSh(t, "cat "+d+f); got != want {
			t.Errorf("%s: %q, want %q", f, got, want)
		}
	}
	shErr(t, "echo 1 > "+d+"remap_device", "Operation already in progress")
	shErr(t, "echo 2 > "+d+"remap_device", "Invalid argument")
	mustSh(t, "echo 8192 > "+d+"resize") // 4 MiB: its size
	mustSh(t, "echo 0x2000 > "+d+"resize")
	shErr(t, "echo 8_192 > "+d+"resize", "Invalid argument")
	shErr(t, "echo 0 > "+d+"resize", "Invalid argument")
	// The export grown on the server, then the device: its file shows the new size and
	// takes IO past the old end.
	mustSh(t, "truncate -s 8M "+tr.exports+"/disk")
	mustSh(t, "echo 16384 > "+d+"resize")
	if got := mustSh(t, "stat -c %s "+dev+"/b/disk"); got != "8388608\n" {
		t.Fatalf("device file after resize: %q bytes", got)
	}
	mustSh(t, "printf resized | dd of="+dev+"/b/disk bs=512 seek=16000 conv=notrunc status=none")
	if got := mustSh(t, "dd if="+dev+"/b/disk bs=512 skip=16000 count=1 status=none | head -c 7"); got != "resized" {
		t.Fatalf("read past the old end: %q", got)
	}
	shErr(t, "echo later > "+d+"unmap_device", "Invalid argument")
	mustSh(t, "echo normal > "+d+"unmap_device")
	if got := mustSh(t, "ls "+m); got != "" {
		t.Fatalf("ctl/mapped after the unmap: %q", got)
	}
}

// TestDeviceViewNameTaken: sub/x and sub!x would both be shown as sub!x; the second mapping
// is refused (EEXIST) and the first stays reachable under that name, as the kernel's client
// refuses a device whose sysfs link name is taken.
func TestDeviceViewNameTaken(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	dev := tr.dev
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	if err := os.MkdirAll(filepath.Join(tr.exports, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, size := range map[string]int64{"sub/x": 8 << 20, "sub!x": 16 << 20} {
		if err := os.WriteFile(filepath.Join(tr.exports, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(filepath.Join(tr.exports, name), size); err != nil {
			t.Fatal(err)
		}
	}
	mustSh(t, fmt.Sprintf("echo 'sessname=b device_path=sub/x dest_port=%d path=%s' > %s/ctl/map_device", tr.port, p1, dev))
	shErr(t, "echo 'sessname=b device_path=sub!x' > "+dev+"/ctl/map_device", "File exists")
	if got := mustSh(t, "ls "+dev+"/b; stat -c %s "+dev+"/b/sub!x; cut -d' ' -f1 "+dev+"/ctl/devices"); got != "sub!x\n8388608\nb/sub!x\n" {
		t.Fatalf("after the refused mapping: %q", got)
	}
	mustSh(t, "echo 'sessname=b device_path=sub!x' > "+dev+"/ctl/unmap_device")                                              // by its file name
	mustSh(t, fmt.Sprintf("echo 'sessname=b device_path=sub!x dest_port=%d path=%s' > %s/ctl/map_device", tr.port, p1, dev)) // free again
	if got := mustSh(t, "stat -c %s "+dev+"/b/sub!x"); got != "16777216\n" {
		t.Fatalf("sub!x mapped after sub/x's unmap: size %q", got)
	}
	mustSh(t, "echo 'sessname=b device_path=sub!x' > "+dev+"/ctl/unmap_device")
}
