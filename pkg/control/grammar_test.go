package control

import (
	"errors"
	"math"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Lines as operators write them, in every form the grammar takes, and lines it refuses with
// the errno the kernel would give.
var (
	openLines = []string{
		"sessname=s1 path=ip:10.0.0.1",
		"sessname=s1 path=ip:10.0.0.2@ip:10.0.0.1 path=ip:10.0.0.3@ip:10.0.0.1",
		"sessname=s1 dest_port=1234 path=ip:10.0.0.1 path=ip:fe80::1%eth0",
		"sessname=s1 path=gid:fe80::2@gid:fe80::1 mp_policy=rr max_reconnect_attempts=-1",
		"sessname=s1 path=ip:10.0.0.1 mpath_policy=1 max_reconnect_attempts=9999",
		"sessname=s1 path=ip:10.0.0.1 mpath_policy=min-latency dest_port=99",
		"  sessname=Ω   path=ip:10.0.0.1\n",
	}
	mapLines = []string{
		"sessname=s1 device_path=/dev/sda",
		"sessname=s1 device_path=disk.img access_mode=ro nbd=auto",
		"sessname=s1 device_path=a/b dest_port=7 path=ip:10.0.0.1 path=ip:10.0.0.2 access_mode=migration",
		"sessname=s1 device_path=x nr_poll_queues=1 nbd=none",
		"sessname=s1 device_path=x nbd=0",
		"sessname=s1 device_path=x dest_port=1 nbd=1048575",
		"sessname=s1 device_path=x ublk=auto",
		"sessname=s1 device_path=x ublk=7 nbd=none",
		"sessname=s1 device_path=x nbd=auto ublk=none",
	}
	unmapLines = []string{"sessname=s1 device_path=/dev/sda", "device_path=dev!sda sessname=s1",
		"sessname=s1 device_path=x force", "normal sessname=s1 device_path=x"}
)

// Every line that parses formats to a line that parses to the same value, and that line is
// a fixed point: the parser and the formatter (the config write-back's) agree on every token.
func TestRoundTrip(t *testing.T) {
	for _, l := range openLines {
		roundTrip(t, l, ParseOpenSession, OpenSession.String)
	}
	for _, l := range mapLines {
		roundTrip(t, l, ParseMapRequest, MapRequest.String)
	}
	for _, l := range unmapLines {
		roundTrip(t, l, ParseUnmapRequest, UnmapRequest.String)
	}
	for _, v := range []string{"auto", "none", "0", "7", "1048575"} {
		roundTrip(t, v, ParseAttach, Attach.String)
	}
	for _, v := range []string{"0", "1", "2", "RR", "mi", "Min-Latency", "round-robin (RR: 0)"} {
		roundTrip(t, v, ParsePolicy, transport.Policy.String)
	}
	for _, v := range []string{"ip:10.0.0.1", "ip:10.0.0.2@ip:10.0.0.1", "gid:fe80::1", "ip:0.0.0.0@ip:10.0.0.1"} {
		roundTrip(t, v, ParseAddPath, FormatPath)
	}
}

func roundTrip[T any](t *testing.T, line string, parse func(string) (T, error), format func(T) string) {
	t.Helper()
	v, err := parse(line)
	if err != nil {
		t.Errorf("%q: %v", line, err)
		return
	}
	out := format(v)
	w, err := parse(out)
	if err != nil {
		t.Errorf("%q formats to %q, which is refused: %v", line, out, err)
		return
	}
	if !reflect.DeepEqual(v, w) {
		t.Errorf("%q formats to %q, which reads back as %+v, not %+v", line, out, w, v)
	}
	if again := format(w); again != out {
		t.Errorf("%q: formats to %q, then to %q", line, out, again)
	}
}

// FuzzRoundTrip: whatever line parses survives format and parse unchanged.
func FuzzRoundTrip(f *testing.F) {
	for _, l := range append(append(openLines, mapLines...), unmapLines...) {
		f.Add(l)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if _, err := ParseOpenSession(line); err == nil {
			roundTrip(t, line, ParseOpenSession, OpenSession.String)
		}
		if _, err := ParseMapRequest(line); err == nil {
			roundTrip(t, line, ParseMapRequest, MapRequest.String)
		}
		if _, err := ParseUnmapRequest(line); err == nil {
			roundTrip(t, line, ParseUnmapRequest, UnmapRequest.String)
		}
	})
}

// What the parsers read, token by token.
func TestParse(t *testing.T) {
	o, err := ParseOpenSession("sessname=s1 dest_port=1234 path=ip:10.0.0.2@ip:10.0.0.1 mp_policy=ml max_reconnect_attempts=3")
	if err != nil {
		t.Fatal(err)
	}
	if o.SessName != "s1" || o.Port != 1234 || len(o.Paths) != 1 || o.Paths[0].Src.String() != "ip:10.0.0.2" ||
		o.Policy == nil || *o.Policy != transport.MinLatency || o.MaxReconnectAttempts == nil || *o.MaxReconnectAttempts != 3 {
		t.Errorf("%+v", o)
	}
	if o, err := ParseOpenSession("sessname=s1 path=ip:10.0.0.1"); err != nil || o.Port != transport.DefaultPort || o.Policy != nil || o.MaxReconnectAttempts != nil {
		t.Errorf("defaults: %+v %v", o, err)
	}
	r, err := ParseMapRequest("sessname=s1 device_path=/dev/sda")
	if err != nil || r.AccessMode != rnbd.AccessRW || r.Attach != AttachDefault || r.Port != transport.DefaultPort {
		t.Errorf("map defaults: %+v %v", r, err)
	}
	if r, err := ParseMapRequest("sessname=s1 device_path=x nbd=12 access_mode=ro"); err != nil || r.Attach != 12 || r.AccessMode != rnbd.AccessRO {
		t.Errorf("%+v %v", r, err)
	}
	if _, err := ParseMapDevice("sessname=s1 device_path=x nbd=auto"); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("the kernel's map_device took nbd=: %v", err)
	}
}

// Refusals, each with its errno; none of them half-parses into a value that is used.
func TestRefused(t *testing.T) {
	sevenPaths := "sessname=s1 device_path=x" + strings.Repeat(" path=ip:10.0.0.1", 7)
	for _, c := range []struct {
		parse func(string) error
		line  string
		want  syscall.Errno
	}{
		{openErr, "", syscall.EINVAL},
		{openErr, "sessname=s1", syscall.EINVAL},
		{openErr, "path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=s1 path=10.0.0.1", syscall.EPROTONOSUPPORT}, // no ip: or gid:, as the kernel's map_device
		{mapErr, "sessname=s1 device_path=x path=10.0.0.1", syscall.EPROTONOSUPPORT},
		{openErr, "sessname=a.b path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=ctl path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=a#b path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=" + strings.Repeat("x", 255) + " path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 dest_port=7 path=ip:10.0.0.2", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 dest_port=65536", syscall.EINVAL},
		{openErr, "sessname=s1 dest_port=0 path=ip:10.0.0.1", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 mpath_policy=3", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 mpath_policy=fastest", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 max_reconnect_attempts=10000", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 max_reconnect_attempts=99999999999", syscall.ERANGE},
		{openErr, "sessname=s1 path=ip:10.0.0.1 bogus=1", syscall.EINVAL},
		{openErr, "sessname=s1 path=ip:10.0.0.1 naked", syscall.EINVAL},
		{mapErr, "sessname=s1", syscall.EINVAL},
		{mapErr, "device_path=x", syscall.EINVAL},
		{mapErr, sevenPaths, syscall.ENOMEM},
		{mapErr, "sessname=s1 device_path=x access_mode=rx", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nr_poll_queues=many", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nr_poll_queues=-2", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nr_poll_queues=" + strconv.Itoa(stats.PossibleCPUs()+1), syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nbd=auto nbd=none", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nbd=01", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=x nbd=1048576", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=a#b", syscall.EINVAL},
		{mapErr, "sessname=s1 device_path=" + strings.Repeat("x", 256), syscall.EINVAL},
		{unmapErr, "sessname=s1", syscall.EINVAL},
		{unmapErr, "sessname=s1 device_path=x extra", syscall.EINVAL},
		{unmapErr, "sessname=s1 device_path=x force force", syscall.EINVAL},
		{unmapErr, "sessname=s1 device_path=x normal force", syscall.EINVAL},
		{unmapErr, "sessname=s1 device_path=x Force", syscall.EINVAL},
		{unmapErr, "force", syscall.EINVAL},
		{addPathErr, "10.0.0.1", syscall.EINVAL},
		{addPathErr, "ip:10.0.0.1@", syscall.EINVAL},
		{func(v string) error { return ParseOne(v) }, "0", syscall.EINVAL},
		{func(v string) error { return ParseOne(v) }, "1 ", syscall.EINVAL},
	} {
		if err := c.parse(c.line); !errors.Is(err, c.want) {
			t.Errorf("%.60q: %v, want %v", c.line, err, c.want)
		}
	}
}

func openErr(v string) error    { _, err := ParseOpenSession(v); return err }
func mapErr(v string) error     { _, err := ParseMapRequest(v); return err }
func unmapErr(v string) error   { _, err := ParseUnmapRequest(v); return err }
func addPathErr(v string) error { _, err := ParseAddPath(v); return err }

// TestParseMatchInt: numbers as the kernel's option parser reads %d (simple_strtol base 0,
// the whole token): hex after 0x, octal after a leading 0, an optional '-' but no '+'.
func TestParseMatchInt(t *testing.T) {
	for v, want := range map[string]int{"1234": 1234, "0x4d2": 1234, "0X4D2": 1234, "01234": 668, "0": 0, "-1": -1, "-0x10": -16, "2147483647": math.MaxInt32, "-2147483648": math.MinInt32} {
		if n, err := parseMatchInt(v); err != nil || n != want {
			t.Errorf("%q: %d, %v; want %d", v, n, err, want)
		}
	}
	for _, v := range []string{"", "-", "+1234", "019234", "08", "0x", "0xg", "12abc", "1_000", "0o17", "0b1", " 1", "2147483648", "-2147483649", "--1"} {
		if n, err := parseMatchInt(v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%q: %d, %v; want EINVAL", v, n, err)
		}
	}
	r, err := ParseMapRequest("sessname=s1 device_path=x dest_port=0x4d3 path=ip:10.0.0.1 nr_poll_queues=00")
	if err != nil || r.Port != 1235 {
		t.Fatalf("dest_port=0x4d3: %+v, %v; want port 1235", r, err)
	}
}
