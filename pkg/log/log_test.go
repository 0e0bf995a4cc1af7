package log

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestGCarriesLogger(t *testing.T) {
	var buf bytes.Buffer
	if _, err := Setup(Options{Level: "debug", JSON: true, NoTime: true, Out: &buf}); err != nil {
		t.Fatal(err)
	}
	if G(context.Background()) != L {
		t.Fatal("G without logger must return L")
	}
	e := L.WithField("path", "ip:1.2.3.4@ip:5.6.7.8")
	ctx := WithLogger(context.Background(), e)
	G(ctx).Info("hello")
	out := buf.String()
	if !strings.Contains(out, `"path":"ip:1.2.3.4@ip:5.6.7.8"`) || !strings.Contains(out, `"msg":"hello"`) {
		t.Fatalf("unexpected log line %q", out)
	}
	if strings.Contains(out, `"time"`) {
		t.Fatalf("NoTime not honoured: %q", out)
	}
	if _, err := Setup(Options{Level: "loud"}); err == nil {
		t.Fatal("bad level accepted")
	}
}

func TestLimiterOncePerCause(t *testing.T) {
	var buf bytes.Buffer
	if _, err := Setup(Options{JSON: true, NoTime: true, Out: &buf}); err != nil {
		t.Fatal(err)
	}
	l := Limiter{Every: 50 * time.Millisecond}
	// One host, from port after port, and an IPv6 /64 from address after address: a line
	// each per cause.
	for i := range 100 {
		l.Warn(L, "per-address cap", fmt.Sprintf("10.0.0.1:%d", 1000+i), "too many")
		l.Warn(L, "per-address cap", fmt.Sprintf("[2001:db8::%x]:1", i), "too many")
	}
	l.Warn(L, "session cap", "10.0.0.1:1", "too many sessions")
	if n := strings.Count(buf.String(), "\n"); n != 3 {
		t.Fatalf("%d lines for two hosts and two causes:\n%s", n, buf.String())
	}
	time.Sleep(60 * time.Millisecond)
	buf.Reset()
	l.Warn(L, "per-address cap", "10.0.0.1:2000", "too many")
	if out := buf.String(); !strings.Contains(out, `"refused_since_last_report":99`) || !strings.Contains(out, `"peer":"10.0.0.1:2000"`) {
		t.Fatalf("report after the interval: %q", out)
	}
}

// TestLimiterOtherHosts: a host refused again and again does not hide another host's refusal
// for the same cause; past limiterHosts hosts the rest share one line per cause, so that
// the limiter's memory stays bounded whatever the peers.
func TestLimiterOtherHosts(t *testing.T) {
	var buf bytes.Buffer
	if _, err := Setup(Options{JSON: true, NoTime: true, Out: &buf}); err != nil {
		t.Fatal(err)
	}
	l := Limiter{Every: time.Hour}
	for range 10 {
		l.Warn(L, "not allowed", "10.0.0.2:1", "not in the allowlist")
	}
	l.Warn(L, "not allowed", "10.0.0.3:1", "not in the allowlist")
	if out := buf.String(); strings.Count(out, "\n") != 2 || !strings.Contains(out, "10.0.0.3") {
		t.Fatalf("the second host's refusal hidden:\n%s", out)
	}
	buf.Reset()
	for i := range 4 * limiterHosts {
		l.Warn(L, "not allowed", fmt.Sprintf("10.1.%d.%d", i/256, i%256), "not in the allowlist")
	}
	l.mu.Lock()
	kept := len(l.causes)
	l.mu.Unlock()
	if n := strings.Count(buf.String(), "\n"); n > limiterHosts || kept > limiterHosts+1 {
		t.Fatalf("%d hosts: %d lines, %d kept; want at most %d and %d", 4*limiterHosts, n, kept, limiterHosts, limiterHosts+1)
	}
}

// TestLimiterTableRecovers: hosts whose interval is over make room for new ones, each of which
// then gets its own line again, and what the forgotten ones had left to report is logged as
// they go: a peer with many addresses fills the table only for one interval.
func TestLimiterTableRecovers(t *testing.T) {
	var buf bytes.Buffer
	if _, err := Setup(Options{JSON: true, NoTime: true, Out: &buf}); err != nil {
		t.Fatal(err)
	}
	l := Limiter{Every: 50 * time.Millisecond}
	for i := range limiterHosts {
		for range 2 {
			l.Warn(L, "not allowed", fmt.Sprintf("10.2.%d.%d", i/256, i%256), "x")
		}
	}
	time.Sleep(60 * time.Millisecond)
	buf.Reset()
	l.Warn(L, "not allowed", "10.3.0.1", "x")
	l.Warn(L, "not allowed", "10.3.0.2", "x")
	out := buf.String()
	if !strings.Contains(out, `"peer":"10.3.0.1"`) || !strings.Contains(out, `"peer":"10.3.0.2"`) || strings.Count(out, `"refused_since_last_report":1`) != limiterHosts {
		t.Fatalf("after the interval: new hosts logged %v %v, forgotten hosts' counts %d of %d", strings.Contains(out, `"peer":"10.3.0.1"`), strings.Contains(out, `"peer":"10.3.0.2"`), strings.Count(out, `"refused_since_last_report":1`), limiterHosts)
	}
}
