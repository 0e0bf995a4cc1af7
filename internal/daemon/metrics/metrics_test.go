package metrics

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"

	"github.com/rtrs-go/rtrs/internal/daemon/metrics/metricstest"
	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func TestMain(m *testing.M) { testutil.Main(m) }

type pair struct {
	srv  *transport.Server
	rs   *rnbd.Server
	c    *rnbd.Client
	dev  *rnbd.Device
	cURL string // the client's /metrics
	sURL string // the server's
}

// newPair starts an RNBD server and a client that maps one device over two paths, and a
// metrics listener for each.
func newPair(t *testing.T) *pair {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "disk"), make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	prov := soft.New(soft.Options{})
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	o := transport.DefaultServerOptions()
	o.Provider, o.Handler, o.Timings, o.QueueDepth = prov, rs, transport.Timings(testutil.FastTimings()), 64
	o.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	srv, err := transport.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: prov, ConPerPath: 2,
		MaxReconnectAttempts: -1, Policy: transport.MinInflight, Timings: transport.Timings(testutil.FastTimings())}, ReconnectTimeout: 5 * time.Second})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c.Close(ctx)
		_ = srv.Close()
		rs.Close()
	})
	var paths []transport.PathAddrs
	for _, s := range []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"} {
		src, dst, err := transport.ParsePathAddrs(s)
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, transport.PathAddrs{Src: src, Dst: dst})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dev, err := c.Map(ctx, rnbd.MapOptions{SessName: "sess1", Paths: paths, Port: srv.Addr().Port(), DevicePath: "disk", AccessMode: rnbd.AccessRW})
	if err != nil {
		t.Fatal(err)
	}
	p := &pair{srv: srv, rs: rs, c: c, dev: dev}
	p.cURL = listen(t, NewClient(c))
	p.sURL = listen(t, NewServer(srv, rs))
	return p
}

func listen(t *testing.T, c prometheus.Collector) string {
	t.Helper()
	reg, err := NewRegistry(c)
	if err != nil {
		t.Fatal(err)
	}
	l, err := Listen("127.0.0.1:0", reg, log.L.WithField("test", t.Name()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return "http://" + l.Addr().String() + "/metrics"
}

func (p *pair) io(t *testing.T, n int) {
	t.Helper()
	buf := make([]byte, 4096)
	for i := range n {
		if _, err := p.dev.WriteAt(buf, int64(i%256)*4096); err != nil {
			t.Fatal(err)
		}
		if _, err := p.dev.ReadAt(buf, int64(i%256)*4096); err != nil {
			t.Fatal(err)
		}
	}
}

// families is a scrape parsed by expfmt, by family name.
type families map[string]*dto.MetricFamily

// scrape fetches url asking for OpenMetrics or the text format and parses the answer with
// expfmt's parser of the format the server said it sent.
func scrape(t *testing.T, url string, openMetrics bool) (families, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	want := expfmt.TypeTextPlain
	if openMetrics {
		req.Header.Set("Accept", "application/openmetrics-text;version=1.0.0")
		want = expfmt.TypeOpenMetrics
	}
	rsp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer rsp.Body.Close()
	body, err := io.ReadAll(rsp.Body)
	if err != nil || rsp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %v %v\n%s", url, rsp.Status, err, body)
	}
	format := expfmt.ResponseFormat(rsp.Header)
	if format.FormatType() != want {
		t.Fatalf("asked for OpenMetrics %v, got %q", openMetrics, rsp.Header.Get("Content-Type"))
	}
	if openMetrics && !strings.HasSuffix(string(body), "# EOF\n") {
		t.Fatalf("OpenMetrics without # EOF:\n%s", body)
	}
	fam, err := metricstest.Parse(string(body), format)
	if err != nil {
		t.Fatalf("parse %s (%s): %v\n%s", url, format, err, body)
	}
	return families(fam), string(body)
}

func has(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := want[l.GetName()]; ok {
			if v != l.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(want)
}

// sum adds the samples of family name whose labels include want (counters, gauges, and
// histograms' counts).
func (f families) sum(t *testing.T, name string, want map[string]string) float64 {
	t.Helper()
	mf := f[name]
	if mf == nil {
		t.Fatalf("no %s", name)
	}
	v := 0.0
	for _, m := range mf.GetMetric() {
		if !has(m, want) {
			continue
		}
		switch {
		case m.Counter != nil:
			v += m.Counter.GetValue()
		case m.Gauge != nil:
			v += m.Gauge.GetValue()
		case m.Histogram != nil:
			v += float64(m.Histogram.GetSampleCount())
		}
	}
	return v
}

// counters are every counter sample and histogram count, sum and bucket of a scrape.
func (f families) counters() map[string]float64 { return metricstest.Families(f).Counters() }

// TestScrape: both daemons' metrics parse as text and as OpenMetrics, move with IO, agree
// with the sysfs counters, and do not go back when reset_all resets those.
func TestScrape(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t)
	before, _ := scrape(t, p.cURL, false)
	p.io(t, 100)
	c1, text := scrape(t, p.cURL, false)
	s1, stext := scrape(t, p.sURL, false)
	promtool(t, "client", text)
	promtool(t, "server", stext)
	sess := map[string]string{"session": "sess1"}
	w := map[string]string{"session": "sess1", "direction": "write"}
	r := map[string]string{"session": "sess1", "direction": "read"}
	if got := c1.sum(t, "rtrs_client_path_requests_total", w) - before.sum(t, "rtrs_client_path_requests_total", w); got != 100 {
		t.Errorf("client writes moved by %v, want 100", got)
	}
	if got := c1.sum(t, "rtrs_client_path_requests_total", r) - before.sum(t, "rtrs_client_path_requests_total", r); got != 100 {
		t.Errorf("client reads moved by %v, want 100", got)
	}
	if n, h := c1.sum(t, "rtrs_client_path_requests_total", r), c1.sum(t, "rtrs_client_path_request_latency_seconds", r); n != h {
		t.Errorf("read latency histogram counts %v of %v reads", h, n)
	}
	if b := c1.sum(t, "rtrs_client_path_bytes_total", w); b < 100*4096 {
		t.Errorf("client write bytes %v", b)
	}
	if got := c1.sum(t, "rtrs_client_path_state", map[string]string{"state": "connected"}); got != 2 {
		t.Errorf("%v paths connected, want 2\n%s", got, text)
	}
	if c1.sum(t, "rtrs_client_sessions", nil) != 1 || c1.sum(t, "rtrs_rnbd_client_devices", map[string]string{"state": "open"}) != 1 ||
		c1.sum(t, "rtrs_rnbd_client_device_info", map[string]string{"session": "sess1", "device": "disk", "access_mode": "rw"}) != 1 ||
		c1.sum(t, "rtrs_rnbd_client_device_size_bytes", sess) != 4<<20 {
		t.Errorf("sessions or devices:\n%s", text)
	}
	if c1.sum(t, "rtrs_client_requests_failed_total", sess) != 0 || c1.sum(t, "rtrs_client_path_errors_total", sess) != 0 {
		t.Errorf("errors without a failure:\n%s", text)
	}
	if c1.sum(t, "rtrs_client_staged_requests_total", sess) != 0 {
		t.Errorf("requests staged over soft, which maps any memory:\n%s", text)
	}
	if s1.sum(t, "rtrs_server_path_requests_total", w) < 100 || s1.sum(t, "rtrs_server_path_requests_total", r) < 100 ||
		s1.sum(t, "rtrs_rnbd_server_requests_total", map[string]string{"op": "write"}) != 100 || s1.sum(t, "rtrs_server_sessions", nil) != 1 ||
		s1.sum(t, "rtrs_server_paths", sess) != 2 || s1.sum(t, "rtrs_rnbd_server_device_open", map[string]string{"device": "disk"}) != 1 {
		t.Errorf("server metrics after IO")
	}
	// The histogram's buckets: the sub-millisecond ones are there.
	for _, m := range c1["rtrs_client_path_request_latency_seconds"].GetMetric() {
		if bs := m.GetHistogram().GetBucket(); len(bs) < stats.LatFine || bs[0].GetUpperBound() != 3.90625e-06 || bs[8].GetUpperBound() != 0.001 {
			t.Fatalf("buckets %v", bs)
		}
	}
	// The sysfs view agrees, then reset_all zeroes it.
	var sysfsW uint64
	for _, cp := range p.c.Session("sess1").Paths() {
		sysfsW += cp.Stats.WriteCnt.Value()
	}
	if float64(sysfsW) != c1.sum(t, "rtrs_client_path_requests_total", w) {
		t.Errorf("stats/rdma writes %d, metric %v", sysfsW, c1.sum(t, "rtrs_client_path_requests_total", w))
	}
	for _, cp := range p.c.Session("sess1").Paths() {
		cp.Stats.ResetAll()
		if got := cp.Stats.RDMA(); got != "0 0 0 0 0 0\n" {
			t.Fatalf("stats/rdma after reset_all %q", got)
		}
	}
	for _, ss := range p.srv.Sessions() {
		for _, sp := range ss.ListedPaths() {
			sp.Stats.ResetAll()
		}
	}
	c2, _ := scrape(t, p.cURL, true)
	s2, _ := scrape(t, p.sURL, true)
	for name, pair := range map[string][2]families{"client": {c1, c2}, "server": {s1, s2}} {
		old, cur := pair[0].counters(), pair[1].counters()
		if len(old) == 0 {
			t.Fatalf("%s: no counters", name)
		}
		for k, v := range old {
			if nv, ok := cur[k]; !ok {
				t.Errorf("%s: %s gone after reset_all", name, k)
			} else if nv < v {
				t.Errorf("%s: %s went back from %v to %v after reset_all", name, k, v, nv)
			}
		}
	}
	// OpenMetrics and text say the same.
	if c2.sum(t, "rtrs_client_path_requests_total", w) != c1.sum(t, "rtrs_client_path_requests_total", w) {
		t.Errorf("OpenMetrics writes %v, text %v", c2.sum(t, "rtrs_client_path_requests_total", w), c1.sum(t, "rtrs_client_path_requests_total", w))
	}
}

// promtool runs `promtool check metrics` (Prometheus's own linter and parser) on a scrape, in
// a subtest of its own: without promtool that subtest fails when RTRS_REQUIRE_TOOLS is set
// (scripts/test.sh installs it) and is skipped, with the reason, otherwise; the caller's other
// checks run either way.
func promtool(t *testing.T, name, text string) {
	t.Helper()
	t.Run("promtool "+name, func(t *testing.T) {
		if _, err := exec.LookPath("promtool"); err != nil {
			if os.Getenv("RTRS_REQUIRE_TOOLS") != "" {
				t.Fatalf("promtool not installed (RTRS_REQUIRE_TOOLS is set): %v", err)
			}
			t.Skipf("promtool not installed, the scrape is not linted: %v", err)
		}
		cmd := exec.Command("promtool", "check", "metrics")
		cmd.Stdin = strings.NewReader(text)
		if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
			t.Errorf("promtool check metrics: %v\n%s", err, out)
		}
	})
}

// TestPathDown: a path whose server side closes counts an error with its cause and a
// reconnect, and the state moves.
func TestPathDown(t *testing.T) {
	p := newPair(t)
	p.io(t, 10)
	for _, ss := range p.srv.Sessions() {
		ss.ListedPaths()[0].Close()
		break
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		f, text := scrape(t, p.cURL, false)
		errs := f.sum(t, "rtrs_client_path_errors_total", nil)
		ok := f.sum(t, "rtrs_client_path_reconnects_total", map[string]string{"result": "ok"})
		if errs >= 1 && ok >= 1 && f.sum(t, "rtrs_client_path_state", map[string]string{"state": "connected"}) == 2 {
			if f.sum(t, "rtrs_client_path_errors_total", map[string]string{"cause": "other"}) != 0 {
				t.Errorf("a cause not classified:\n%s", text)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no error and reconnect counted:\n%s", text)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.io(t, 10) // and it still works
}

// TestRefusals: a connection the server rejects is counted by errno and cause.
func TestRefusals(t *testing.T) {
	p := newPair(t)
	prov := soft.New(soft.Options{})
	_, err := transport.Open(context.Background(), transport.ClientOptions{Provider: prov, SessName: "x", Port: p.srv.Addr().Port(),
		Paths: []transport.PathAddrs{{Dst: transport.Addr{IP: netip.MustParseAddr("127.0.0.1")}}}, ConPerPath: 300, Timings: transport.Timings(testutil.FastTimings())})
	if err == nil {
		t.Fatal("300 connections per path accepted")
	}
	f, text := scrape(t, p.sURL, false)
	if f.sum(t, "rtrs_server_connections_rejected_total", map[string]string{"errno": "ECONNRESET"}) < 1 ||
		f.sum(t, "rtrs_server_refusals_total", map[string]string{"cause": "connections_per_path"}) < 1 {
		t.Fatalf("refusal not counted:\n%s", text)
	}
	// A map_device of an export that is not there: the OPEN's refusal by its errno.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := p.c.Map(ctx, rnbd.MapOptions{SessName: "sess1", DevicePath: "missing", AccessMode: rnbd.AccessRO}); err == nil {
		t.Fatal("map of a missing export succeeded")
	}
	f, text = scrape(t, p.sURL, false)
	if f.sum(t, "rtrs_rnbd_server_open_refusals_total", map[string]string{"errno": "ENOENT"}) != 1 {
		t.Fatalf("OPEN refusal not counted:\n%s", text)
	}
}

// TestDuplicateLabels: a second metric with the same labels is left out, not an error that
// fails the scrape.
func TestDuplicateLabels(t *testing.T) {
	ch := make(chan prometheus.Metric, 4)
	e := newEmitter(ch)
	d := prometheus.NewDesc("x_total", "x", []string{"path"}, nil)
	e.counter(d, 1, "a")
	e.counter(d, 2, "a")
	e.counter(d, 3, "b")
	if len(ch) != 2 {
		t.Fatalf("%d metrics sent, want 2", len(ch))
	}
}

// TestListenerTimeouts: a connection that never finishes its request header is closed, and
// Close ends the listener's goroutines.
func TestListenerTimeouts(t *testing.T) {
	leakcheck.Check(t)
	old := readHeaderTimeout
	readHeaderTimeout = 200 * time.Millisecond
	defer func() { readHeaderTimeout = old }()
	reg, _ := NewRegistry()
	l, err := Listen("127.0.0.1:0", reg, log.L.WithField("test", t.Name()))
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = c.Write([]byte("GET /metrics HTTP/1.1\r\nHost: x\r\n")) // and never the end
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	_, err = io.ReadAll(c)
	if err != nil || time.Since(start) > 3*time.Second {
		t.Fatalf("slow header: connection still open after %v (%v)", time.Since(start), err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get("http://" + l.Addr().String() + "/metrics"); err == nil {
		t.Fatal("still serving after Close")
	}
}

// TestCardinalityBounded: clients opening more sessions than -max-sessions allows add no
// series beyond the bound; the refusals are counted under a fixed cause.
func TestCardinalityBounded(t *testing.T) {
	dir := t.TempDir()
	prov := soft.New(soft.Options{})
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	o := transport.DefaultServerOptions()
	o.Provider, o.Handler, o.Timings, o.QueueDepth = prov, rs, transport.Timings(testutil.FastTimings()), 16
	o.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	o.Limits.MaxSessions = 2
	srv, err := transport.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	url := listen(t, NewServer(srv, rs))
	opened := 0
	for i := range 6 {
		s, err := transport.Open(context.Background(), transport.ClientOptions{Provider: prov, SessName: fmt.Sprintf("h%d", i),
			Port: srv.Addr().Port(), Paths: []transport.PathAddrs{{Dst: transport.Addr{IP: netip.MustParseAddr("127.0.0.1")}}},
			ConPerPath: 1, Timings: transport.Timings(testutil.FastTimings())})
		if err == nil {
			opened++
			defer s.Close()
		}
	}
	f, text := scrape(t, url, false)
	if opened != 2 || f.sum(t, "rtrs_server_sessions", nil) != 2 || len(f["rtrs_server_path_requests_total"].GetMetric()) != 2*2 {
		t.Fatalf("%d sessions opened; scrape:\n%s", opened, text)
	}
	if f.sum(t, "rtrs_server_refusals_total", map[string]string{"cause": "sessions"}) != 4 {
		t.Fatalf("refusals:\n%s", text)
	}
}
