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
	for i := range 100 {
		l.Warn(L, "per-address cap", fmt.Sprintf("10.0.0.%d:1", i), "too many")
	}
	l.Warn(L, "session cap", "10.0.0.9:1", "too many sessions")
	if n := strings.Count(buf.String(), "\n"); n != 2 {
		t.Fatalf("%d lines for two causes:\n%s", n, buf.String())
	}
	time.Sleep(60 * time.Millisecond)
	buf.Reset()
	l.Warn(L, "per-address cap", "10.0.0.200:1", "too many")
	if out := buf.String(); !strings.Contains(out, `"refused_since_last_report":99`) || !strings.Contains(out, `"peer":"10.0.0.200:1"`) {
		t.Fatalf("report after the interval: %q", out)
	}
}
