package log

import (
	"bytes"
	"context"
	"strings"
	"testing"
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
