package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"

	"github.com/rtrs-go/rtrs/internal/daemon/metrics/metricstest"
)

// scrapeNS fetches http://addr/metrics from inside network namespace ns with curl, as
// OpenMetrics or the text format, and parses it with expfmt's parser of the format the
// daemon answered in. It returns the samples of counters (histograms: count, sum, buckets)
// and gauges by name and labels, and the body.
func scrapeNS(t *testing.T, ns, addr string, openMetrics bool) (counters, gauges map[string]float64, body string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "scrape")
	accept := "text/plain;version=0.0.4"
	if openMetrics {
		accept = "application/openmetrics-text;version=1.0.0"
	}
	ctype := strings.TrimSpace(mustBash(t, fmt.Sprintf("ip netns exec %s curl -sS --fail --max-time 10 -H 'Accept: %s' -o %s -w '%%{content_type}' http://%s/metrics", ns, accept, out, addr)))
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	body = string(b)
	format := expfmt.ResponseFormat(map[string][]string{"Content-Type": {ctype}})
	if openMetrics != (format.FormatType() == expfmt.TypeOpenMetrics) {
		t.Fatalf("asked for OpenMetrics %v, got %q", openMetrics, ctype)
	}
	fam, err := metricstest.Parse(body, format)
	if err != nil {
		t.Fatalf("%s: %s does not parse: %v\n%s", ns, format, err, body)
	}
	return fam.Counters(), fam.Gauges(), body
}

// sumOf adds the samples whose key starts with name{ and contains every label in want.
func sumOf(m map[string]float64, name string, want ...string) float64 {
	v := 0.0
	for k, x := range m {
		if !strings.HasPrefix(k, name+"{") || strings.Contains(k, "}_") {
			continue
		}
		ok := true
		for _, w := range want {
			ok = ok && strings.Contains(k, w)
		}
		if ok {
			v += x
		}
	}
	return v
}

// checkPromtool lints a text scrape with Prometheus's promtool.
func checkPromtool(t *testing.T, who, body string) {
	t.Helper()
	cmd := exec.Command("promtool", "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("%s: promtool check metrics: %v\n%s", who, err, out)
	}
}

// TestMetrics: both daemons serve metrics (the server's address from its config file, the
// client's from its flag); scraped twice during fio the IO counters move, both scrapes parse
// as the text format and OpenMetrics and pass promtool; after reset_all in both trees the
// sysfs stats are zero and no metric counter went back.
func TestMetrics(t *testing.T) {
	requireTools(t, "fio", "curl")
	if _, err := exec.LookPath("promtool"); err != nil {
		t.Fatal("promtool (Debian package prometheus) is not installed: the metrics cannot be checked")
	}
	const srvAddr, cliAddr = "127.0.0.1:9851", "127.0.0.1:9852"
	conf := filepath.Join(t.TempDir(), "rtrs-serverd.conf")
	if err := os.WriteFile(conf, []byte("metrics = "+srvAddr+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := startClusterWith(t, []string{"-config=" + conf}, []string{"-metrics=" + cliAddr})
	c.openSession(t, "mpath_policy=round-robin")
	dev := c.mapDisk(t)

	fio := exec.Command("fio", "--name=m", "--filename="+dev, "--rw=randrw", "--bs=16k", "--size=64m", "--numjobs=2",
		"--offset_increment=64m", "--ioengine=psync", "--runtime=6", "--time_based")
	var fioOut strings.Builder
	fio.Stdout, fio.Stderr = &fioOut, &fioOut
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	c1, _, ct1 := scrapeNS(t, c.net.cli, cliAddr, false)
	s1, _, st1 := scrapeNS(t, c.net.srv, srvAddr, false)
	time.Sleep(2 * time.Second)
	c2, cg2, ct2 := scrapeNS(t, c.net.cli, cliAddr, false)
	s2, sg2, st2 := scrapeNS(t, c.net.srv, srvAddr, true)
	if err := fio.Wait(); err != nil {
		t.Fatalf("fio: %v\n%s", err, fioOut.String())
	}
	for who, body := range map[string]string{"client 1": ct1, "client 2": ct2, "server 1": st1} {
		checkPromtool(t, who, body)
	}
	if !strings.HasSuffix(st2, "# EOF\n") {
		t.Errorf("server OpenMetrics scrape without # EOF")
	}
	// The counters moved between the two scrapes during fio, on both paths and both sides.
	for _, dir := range []string{"read", "write"} {
		for _, p := range []string{c.p1, c.p2} {
			d := "direction=" + dir
			if a, b := sumOf(c1, "rtrs_client_path_requests_total", d, "path="+p), sumOf(c2, "rtrs_client_path_requests_total", d, "path="+p); b <= a {
				t.Errorf("client %s %ss did not move: %v then %v", p, dir, a, b)
			}
			if a, b := sumOf(c1, "rtrs_client_path_bytes_total", d, "path="+p), sumOf(c2, "rtrs_client_path_bytes_total", d, "path="+p); b <= a {
				t.Errorf("client %s %s bytes did not move: %v then %v", p, dir, a, b)
			}
		}
		if a, b := sumOf(s1, "rtrs_server_path_requests_total", "direction="+dir), sumOf(s2, "rtrs_server_path_requests_total", "direction="+dir); b <= a {
			t.Errorf("server %ss did not move: %v then %v", dir, a, b)
		}
		if a, b := sumOf(s1, "rtrs_rnbd_server_requests_total", "op="+dir), sumOf(s2, "rtrs_rnbd_server_requests_total", "op="+dir); b <= a {
			t.Errorf("RNBD server %ss did not move: %v then %v", dir, a, b)
		}
	}
	if a, b := c1["rtrs_client_path_request_latency_seconds{direction=write,path="+c.p1+",session=e2e}_count"],
		c2["rtrs_client_path_request_latency_seconds{direction=write,path="+c.p1+",session=e2e}_count"]; b <= a {
		t.Errorf("latency histogram did not move: %v then %v\n%s", a, b, ct2)
	}
	if sumOf(cg2, "rtrs_client_path_state", "state=connected") != 2 || sumOf(cg2, "rtrs_client_sessions") != 1 ||
		sumOf(cg2, "rtrs_rnbd_client_devices", "state=open") != 1 || sumOf(cg2, "rtrs_client_path_heartbeat_rtt_seconds") <= 0 {
		t.Errorf("client gauges:\n%s", ct2)
	}
	if sumOf(sg2, "rtrs_server_sessions") != 1 || sumOf(sg2, "rtrs_server_paths", "session=e2e") != 2 ||
		sumOf(sg2, "rtrs_rnbd_server_device_open", "device=disk", "access_mode=rw") != 1 {
		t.Errorf("server gauges:\n%s", st2)
	}

	// reset_all in both trees: the sysfs stats go to zero, the metrics do not go back.
	before, _, _ := scrapeNS(t, c.net.cli, cliAddr, true)
	sbefore, _, _ := scrapeNS(t, c.net.srv, srvAddr, false)
	for _, p := range []string{c.p1, c.p2} {
		mustBash(t, "echo 1 > "+c.pathFile(p, "stats/reset_all"))
		if got := cat(c.pathFile(p, "stats/rdma")); got != "0 0 0 0 0 0\n" {
			t.Errorf("client %s stats/rdma after reset_all: %q", p, got)
		}
		if got := cat(c.pathFile(p, "stats/rdma_lat")); !strings.HasPrefix(got, "1 ms: 0 0\n2 ms: 0 0\n") {
			t.Errorf("client %s stats/rdma_lat after reset_all:\n%s", p, got)
		}
		sp := filepath.Join(c.srvMnt, "e2e", "paths", p)
		mustBash(t, "echo 1 > "+sp+"/stats/reset_all")
		if got := cat(sp + "/stats/rdma"); got != "0 0 0 0\n" {
			t.Errorf("server %s stats/rdma after reset_all: %q", p, got)
		}
	}
	after, _, ctext := scrapeNS(t, c.net.cli, cliAddr, false)
	safter, _, stext := scrapeNS(t, c.net.srv, srvAddr, true)
	checkPromtool(t, "client after reset_all", ctext)
	for who, pair := range map[string][2]map[string]float64{"client": {before, after}, "server": {sbefore, safter}} {
		if len(pair[0]) == 0 {
			t.Fatalf("%s: no counters", who)
		}
		for k, v := range pair[0] {
			if nv, ok := pair[1][k]; !ok {
				t.Errorf("%s: %s gone after reset_all", who, k)
			} else if nv < v {
				t.Errorf("%s: %s went back from %v to %v after reset_all", who, k, v, nv)
			}
		}
	}
	if sumOf(after, "rtrs_client_path_requests_total") == 0 || sumOf(safter, "rtrs_server_path_requests_total") == 0 {
		t.Errorf("metrics zeroed by reset_all:\n%s\n%s", ctext, stext)
	}
}
