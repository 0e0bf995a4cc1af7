package rnbd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// logHook records every log line, to see which refusals were logged.
type logHook struct {
	mu  sync.Mutex
	msg []string
}

func (h *logHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h *logHook) Fire(e *logrus.Entry) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, _ := e.String()
	h.msg = append(h.msg, e.Level.String()+": "+s)
	return nil
}
func (h *logHook) warns() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, m := range h.msg {
		if strings.HasPrefix(m, "warning") && strings.Contains(m, "refused") {
			out = append(out, m)
		}
	}
	return out
}

// TestMalformedRequestsLogged: requests the server refuses as malformed are logged as
// refusals (docs/security.md) and counted: an unknown op or flag, a header too short to
// carry a type. Each on a session of its own, whose refusals the limiter has not seen.
func TestMalformedRequestsLogged(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	ctx := context.Background()
	io := func(rw uint32) func(id uint32) []byte {
		return func(id uint32) []byte {
			u := make([]byte, IOSize)
			MsgIO{DeviceID: id, RW: rw, BiSize: 512}.Put(u)
			return u
		}
	}
	for i, tc := range []struct {
		name string
		usr  func(id uint32) []byte
		dir  transport.Dir
		data []byte
		want syscall.Errno
	}{
		{"unknown flag bit", io(uint32(OpRead) | 1<<20), transport.Read, make([]byte, 512), syscall.EOPNOTSUPP},
		{"unknown op", io(77), transport.Read, make([]byte, 512), syscall.EOPNOTSUPP},
		{"2-byte header", func(uint32) []byte { return []byte{9, 0} }, transport.Write, nil, syscall.EBADMSG},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprintf("malformed%d", i)
			d := mustMap(t, e, c, name, "disk", AccessRO)
			h := &logHook{}
			logrus.StandardLogger().AddHook(h)
			defer logrus.StandardLogger().ReplaceHooks(logrus.LevelHooks{})
			before := e.server().Stats.Errors.Value()
			if err := c.Session(name).Do(ctx, tc.dir, tc.usr(d.ID()), tc.data); !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			testutil.WaitFor(t, 5*time.Second, "the refusal logged and counted", func() bool {
				return len(h.warns()) > 0 && e.server().Stats.Errors.Value() > before
			})
		})
	}
}

// TestStatelessSessionRefusalsLimited: a session that never sent SESS_INFO nor opened a
// device has no state at the server; its refused requests and OPENs are logged at most once
// per cause and interval all the same, not once each.
func TestStatelessSessionRefusalsLimited(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	src, dst, _ := transport.ParsePathAddrs("ip:127.0.0.1@ip:127.0.0.1")
	o := transport.ClientOptions{Provider: e.prov, SessName: "flood", Paths: []transport.PathAddrs{{Src: src, Dst: dst}},
		Port: e.port, ConPerPath: 2, MaxReconnectAttempts: 0}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := transport.Open(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	h := &logHook{}
	logrus.StandardLogger().AddHook(h)
	defer logrus.StandardLogger().ReplaceHooks(logrus.LevelHooks{})
	const n = 500
	for i := range n {
		u := make([]byte, IOSize)
		MsgIO{DeviceID: uint32(i), RW: uint32(OpRead), BiSize: 512}.Put(u)
		if err := s.Do(ctx, transport.Read, u, make([]byte, 512)); !errors.Is(err, syscall.ENODEV) {
			t.Fatalf("io %d: %v", i, err)
		}
	}
	// OPENs refused (no such export) before the session has any device.
	for range 100 {
		if _, err := rawOpen(s, "nope", AccessRO); err == nil {
			t.Fatal("opened")
		}
	}
	warnings := func() int {
		h.mu.Lock()
		defer h.mu.Unlock()
		n := 0
		for _, m := range h.msg {
			if strings.HasPrefix(m, "warning") {
				n++
			}
		}
		return n
	}
	// Each cause is logged (the unknown device's and the refused OPEN's), and no more.
	testutil.WaitFor(t, 5*time.Second, "both causes logged", func() bool { return warnings() >= 2 })
	time.Sleep(100 * time.Millisecond)
	if warns := warnings(); warns > 10 {
		t.Errorf("%d refused requests from one session logged %d warning lines (want once per cause and interval)", n+100, warns)
	}
}

// TestExportErrorLogged: IO an export fails with EIO (a file truncated under its mapping) is
// logged at the server, once a minute per session: the client sees only the errno.
func TestExportErrorLogged(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "shrunk", "disk", AccessRW)
	if err := os.Truncate(filepath.Join(e.dir, "disk"), 64<<10); err != nil {
		t.Fatal(err)
	}
	h := &logHook{}
	logrus.StandardLogger().AddHook(h)
	defer logrus.StandardLogger().ReplaceHooks(logrus.LevelHooks{})
	for range 5 {
		if _, err := d.ReadAt(make([]byte, 4096), 512<<10); !errors.Is(err, syscall.EIO) {
			t.Fatalf("a read past the export's new end: %v, want EIO", err)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msg {
		if strings.HasPrefix(m, "warning") && strings.Contains(m, "IO failed with EIO") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("%d warnings for 5 reads the export failed; want 1:\n%s", n, strings.Join(h.msg, "\n"))
	}
}

// TestSessionDevicesBounded: a session holds at most maxSessDevices devices open; an OPEN
// past it is refused with EMFILE and logged, and one is allowed again once a device closes.
func TestSessionDevicesBounded(t *testing.T) {
	leakcheck.Check(t)
	defer func(n int) { maxSessDevices = n }(maxSessDevices)
	maxSessDevices = 2
	e := newTestEnv(t)
	for _, n := range []string{"a", "b", "c"} {
		e.file(t, n, 64<<10)
	}
	c := e.client(t, time.Second)
	da := mustMap(t, e, c, "many", "a", AccessRO)
	mustMap(t, e, c, "many", "b", AccessRO)
	if _, err := e.mapDev(t, c, "many", "c", AccessRO); !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("a third device: %v, want EMFILE", err)
	}
	if got := e.server().OpenRefused()[syscall.EMFILE]; got != 1 {
		t.Fatalf("OPENs refused with EMFILE: %d, want 1", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := da.Unmap(ctx); err != nil {
		t.Fatal(err)
	}
	mustMap(t, e, c, "many", "c", AccessRO)
}
