package control

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"syscall"

	"github.com/rtrs-go/rtrs/internal/lib/names"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/stats"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// rnbdMaxPaths is how many path= tokens map_device takes; the next is ENOMEM (RNBD's limit).
const rnbdMaxPaths = 6

// OpenSession is an open_session line (ctl/open_session, and a declaration of the client's
// config file): a session without a device.
type OpenSession struct {
	SessName string
	Paths    []transport.PathAddrs
	// Port is the server's port, shared by every path of the session.
	Port uint16
	// Policy and MaxReconnectAttempts are nil when the line does not set them.
	Policy               *transport.Policy
	MaxReconnectAttempts *int
}

// ParseOpenSession reads open_session's tokens: sessname= (required), path= (1..),
// dest_port= (applies to the path= tokens after it, as in map_device; all paths of a session
// share one port), mpath_policy= (or mp_policy=), max_reconnect_attempts= (-1..9999).
// Every refusal wraps EINVAL, but too many paths, which is ENOMEM as in the kernel.
func ParseOpenSession(v string) (OpenSession, error) {
	var o OpenSession
	pp := newPathParser()
	err := eachToken(v, func(tok, k, val string) (err error) {
		switch k {
		case "sessname":
			o.SessName = val
		case "path":
			err = pp.path(val, transport.MaxPathsNum)
		case "dest_port":
			err = pp.destPort(val)
		case "mpath_policy", "mp_policy":
			var p transport.Policy
			if p, err = ParsePolicy(val); err == nil {
				o.Policy = &p
			}
		case "max_reconnect_attempts":
			var n int
			if n, err = ParseMaxReconnectAttempts(val); err == nil {
				o.MaxReconnectAttempts = &n
			}
		default:
			err = fmt.Errorf("unknown token %q: %w", tok, syscall.EINVAL)
		}
		return err
	})
	if err != nil {
		return o, err
	}
	if err := CheckSessName(o.SessName); err != nil {
		return o, err
	}
	if o.Paths, o.Port = pp.result(); len(o.Paths) == 0 {
		return o, fmt.Errorf("no path=: %w", syscall.EINVAL)
	}
	return o, nil
}

// String is the line's tokens as ParseOpenSession reads them back.
func (o OpenSession) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "sessname=%s", o.SessName)
	writePaths(&b, o.Paths, o.Port)
	if o.Policy != nil {
		fmt.Fprintf(&b, " mpath_policy=%s", *o.Policy)
	}
	if o.MaxReconnectAttempts != nil {
		fmt.Fprintf(&b, " max_reconnect_attempts=%d", *o.MaxReconnectAttempts)
	}
	return b.String()
}

// MapOptions is the session part of the line, as rnbd.Client.OpenSession takes it.
func (o OpenSession) MapOptions() rnbd.MapOptions {
	return rnbd.MapOptions{SessName: o.SessName, Paths: o.Paths, Port: o.Port}
}

// MapRequest is a map_device line: the kernel's tokens and ours, nbd= and ublk=.
type MapRequest struct {
	rnbd.MapOptions
	Attach Attach // nbd=: /dev/nbdX
	Ublk   Attach // ublk=: /dev/ublkbX
}

// ParseMapRequest reads map_device's tokens as RNBD does: sessname= and device_path= are
// required (≤ 255 bytes); path= up to 6 times (a 7th is ENOMEM); dest_port= applies to the
// path= tokens after it; access_mode= ro, rw (default) or migration; nr_poll_queues= is
// accepted and has no effect here; and ours, nbd=<auto|none|index> and
// ublk=<auto|none|index>, each at most once (without it, Attach or Ublk is AttachDefault).
// An unknown token or a missing one is EINVAL.
func ParseMapRequest(v string) (MapRequest, error) { return parseMap(v, true) }

// ParseMapDevice reads map_device's tokens as the kernel's RNBD client takes them: those of
// ParseMapRequest but nbd= and ublk=.
func ParseMapDevice(v string) (rnbd.MapOptions, error) {
	r, err := parseMap(v, false)
	return r.MapOptions, err
}

func parseMap(v string, withAttach bool) (MapRequest, error) {
	r := MapRequest{MapOptions: rnbd.MapOptions{AccessMode: rnbd.AccessRW}, Attach: AttachDefault, Ublk: AttachDefault}
	pp := newPathParser()
	err := eachToken(v, func(tok, k, val string) (err error) {
		switch k {
		case "nbd", "ublk":
			at := &r.Attach
			if k == "ublk" {
				at = &r.Ublk
			}
			switch {
			case !withAttach:
				err = fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
			case *at != AttachDefault:
				err = fmt.Errorf("%s= twice: %w", k, syscall.EINVAL)
			default:
				if *at, err = ParseAttach(val); err != nil {
					err = fmt.Errorf("%s=%w", k, err)
				}
			}
		case "sessname":
			if len(val) > names.Max {
				err = fmt.Errorf("sessname too long: %w", syscall.EINVAL)
			}
			r.SessName = val
		case "device_path":
			if len(val) > names.Max {
				err = fmt.Errorf("device_path too long: %w", syscall.EINVAL)
			}
			r.DevicePath = val
		case "path":
			err = pp.path(val, rnbdMaxPaths)
		case "dest_port":
			err = pp.destPort(val)
		case "access_mode":
			r.AccessMode, err = rnbd.ParseAccessMode(val)
		case "nr_poll_queues":
			// The kernel's range: -1 (one per CPU) to nr_cpu_ids.
			if n, aerr := parseMatchInt(val); aerr != nil || n < -1 || n > stats.PossibleCPUs() {
				err = fmt.Errorf("nr_poll_queues %q: -1 to %d: %w", val, stats.PossibleCPUs(), syscall.EINVAL)
			}
		default:
			err = fmt.Errorf("unknown token %q: %w", tok, syscall.EINVAL)
		}
		return err
	})
	if err != nil {
		return r, err
	}
	if r.SessName == "" || r.DevicePath == "" {
		return r, fmt.Errorf("sessname= and device_path= are required: %w", syscall.EINVAL)
	}
	if err := CheckSessName(r.SessName); err != nil {
		return r, err
	}
	if err := names.DevicePath(r.DevicePath); err != nil {
		return r, fmt.Errorf("device_path: %w", err)
	}
	r.Paths, r.Port = pp.result()
	return r, nil
}

// String is the line's tokens as ParseMapRequest reads them back.
func (r MapRequest) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "sessname=%s device_path=%s", r.SessName, r.DevicePath)
	writePaths(&b, r.Paths, r.Port)
	fmt.Fprintf(&b, " access_mode=%v", r.AccessMode)
	if r.Attach != AttachDefault {
		fmt.Fprintf(&b, " nbd=%v", r.Attach)
	}
	if r.Ublk != AttachDefault {
		fmt.Fprintf(&b, " ublk=%v", r.Ublk)
	}
	return b.String()
}

// UnmapRequest is an unmap_device line. DevicePath is the mapped path or the device's file
// name in the device view (DeviceFileName). Force unmaps a device that is open, as the
// kernel's "force" does; without it (the kernel's "normal") an open device is EBUSY.
type UnmapRequest struct {
	SessName, DevicePath string
	Force                bool
}

// ParseUnmapRequest reads unmap_device's tokens: sessname= and device_path=, both required,
// and the kernel's words "normal" (the default) or "force", at most one.
func ParseUnmapRequest(v string) (UnmapRequest, error) {
	var u UnmapRequest
	var rest []string
	mode := ""
	for _, tok := range strings.Fields(v) {
		if tok != "normal" && tok != "force" {
			rest = append(rest, tok)
			continue
		}
		if mode != "" {
			return u, fmt.Errorf("%q after %q: one of normal or force: %w", tok, mode, syscall.EINVAL)
		}
		mode, u.Force = tok, tok == "force"
	}
	err := eachToken(strings.Join(rest, " "), func(tok, k, val string) error {
		switch k {
		case "sessname":
			u.SessName = val
		case "device_path":
			u.DevicePath = val
		default:
			return fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
		return nil
	})
	if err != nil {
		return u, err
	}
	if u.SessName == "" || u.DevicePath == "" {
		return u, fmt.Errorf("sessname= and device_path= are required: %w", syscall.EINVAL)
	}
	if err := CheckSessName(u.SessName); err != nil {
		return u, err
	}
	if err := names.DevicePath(u.DevicePath); err != nil {
		return u, fmt.Errorf("device_path: %w", err)
	}
	return u, nil
}

// String is the line's tokens as ParseUnmapRequest reads them back.
func (u UnmapRequest) String() string {
	s := fmt.Sprintf("sessname=%s device_path=%s", u.SessName, u.DevicePath)
	if u.Force {
		s += " force"
	}
	return s
}

// CheckSessName checks a session name written to a control file: the kernel's rules
// (names.Session), and not "ctl", our control directory beside the sessions.
func CheckSessName(name string) error {
	if err := names.Session(name); err != nil {
		return fmt.Errorf("sessname: %w", err)
	}
	if name == "ctl" {
		return fmt.Errorf("sessname %q is the control directory's: %w", name, syscall.EINVAL)
	}
	return nil
}

// ParseAddPath reads add_path: [<source addr>@]<destination addr>, up to the first newline.
func ParseAddPath(v string) (transport.PathAddrs, error) {
	if i := strings.IndexByte(v, '\n'); i >= 0 {
		v = v[:i]
	}
	src, dst, err := transport.ParsePathAddrs(v)
	if err != nil {
		return transport.PathAddrs{}, fmt.Errorf("%v: %w", err, syscall.EINVAL) // every parse error is EINVAL
	}
	return transport.PathAddrs{Src: src, Dst: dst}, nil
}

// FormatPath is a path as add_path and path= take it: the source only where one was given,
// and an IPv6 scope kept (the trees show addresses without it, as the kernel's sysfs does;
// a config written back without it would name another path).
func FormatPath(pa transport.PathAddrs) string {
	if pa.Src.IP.IsValid() {
		return formatAddr(pa.Src) + "@" + formatAddr(pa.Dst)
	}
	return formatAddr(pa.Dst)
}

func formatAddr(a transport.Addr) string {
	if z := a.IP.Zone(); z != "" && !a.GID {
		return a.String() + "%" + z
	}
	return a.String()
}

// ParsePolicy reads mpath_policy as the kernel does: 0, 1 or 2; or, in any case, a value
// that begins with round-robin, min-inflight or min-latency, or is rr, mi or ml.
func ParsePolicy(v string) (transport.Policy, error) {
	if n, err := parseKInt(v); err == nil {
		if n >= 0 && n <= 2 {
			return transport.Policy(n), nil
		}
		return 0, fmt.Errorf("policy %d: %w", n, syscall.EINVAL)
	}
	l := strings.ToLower(v)
	switch {
	case strings.HasPrefix(l, "round-robin"), l == "rr":
		return transport.RoundRobin, nil
	case strings.HasPrefix(l, "min-inflight"), l == "mi":
		return transport.MinInflight, nil
	case strings.HasPrefix(l, "min-latency"), l == "ml":
		return transport.MinLatency, nil
	}
	return 0, fmt.Errorf("policy %q: %w", v, syscall.EINVAL)
}

// ParseMaxReconnectAttempts reads max_reconnect_attempts: -1 (for ever) .. 9999.
func ParseMaxReconnectAttempts(v string) (int, error) {
	n, err := parseKInt(v)
	if err != nil {
		return 0, err
	}
	if n < -1 || n > 9999 {
		return 0, fmt.Errorf("max_reconnect_attempts %d not in -1..9999: %w", n, syscall.EINVAL)
	}
	return n, nil
}

// ParseOne accepts exactly "1", what the action files (disconnect, reconnect, remove_path,
// force_close, the stats' resets) take (sysfs_streq(x, "1")); anything else is EINVAL.
func ParseOne(v string) error {
	if v != "1" {
		return fmt.Errorf("%q: write 1: %w", v, syscall.EINVAL)
	}
	return nil
}

// eachToken calls f with each whitespace-separated key=value token of v, up to the first
// error; a token without '=' is EINVAL.
func eachToken(v string, f func(tok, k, val string) error) error {
	for _, tok := range strings.Fields(v) {
		k, val, ok := strings.Cut(tok, "=")
		if !ok {
			return fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
		if err := f(tok, k, val); err != nil {
			return err
		}
	}
	return nil
}

// parseKInt is kstrtoint base 10: an optional sign, digits, nothing else; ERANGE when it
// does not fit.
func parseKInt(v string) (int, error) {
	n, err := strconv.ParseInt(v, 10, 32)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return 0, fmt.Errorf("%q: %w", v, syscall.ERANGE)
		}
		return 0, fmt.Errorf("%q: %w", v, syscall.EINVAL)
	}
	return int(n), nil
}

// parseMatchInt reads a number as the kernel's option parser reads %d (match_int, base 0):
// an optional '-', then 0x and hex digits, a leading 0 and octal digits, or decimal digits,
// the whole value and within an int32; anything else is EINVAL. dest_port=0x4d2 is 1234 and
// dest_port=01234 is 668 there too.
func parseMatchInt(v string) (int, error) {
	s, neg := strings.CutPrefix(v, "-")
	base := 10
	switch {
	case len(s) > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') && strings.ContainsRune("0123456789abcdefABCDEF", rune(s[2])):
		base, s = 16, s[2:]
	case strings.HasPrefix(s, "0"):
		base = 8
	}
	n, err := strconv.ParseUint(s, base, 32)
	if err != nil || !neg && n > math.MaxInt32 || neg && n > -math.MinInt32 {
		return 0, fmt.Errorf("%q: %w", v, syscall.EINVAL)
	}
	if neg {
		return -int(n), nil
	}
	return int(n), nil
}

// pathParser collects path= tokens with the dest_port= in force (transport.DefaultPort
// before the first); paths of one session share their port.
type pathParser struct {
	paths   []transport.PathAddrs
	port    uint16 // the paths' port
	pending uint16 // the dest_port= in force
}

func newPathParser() pathParser { return pathParser{pending: transport.DefaultPort} }

// result is the paths and their port; without paths, the dest_port= in force.
func (pp *pathParser) result() ([]transport.PathAddrs, uint16) {
	if len(pp.paths) == 0 {
		return nil, pp.pending
	}
	return pp.paths, pp.port
}

func (pp *pathParser) destPort(val string) error {
	n, err := parseMatchInt(val)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("dest_port %q: 1 to 65535: %w", val, syscall.EINVAL)
	}
	pp.pending = uint16(n)
	return nil
}

func (pp *pathParser) path(val string, max int) error {
	if len(pp.paths) >= max {
		return fmt.Errorf("more than %d paths: %w", max, syscall.ENOMEM)
	}
	src, dst, err := transport.ParsePathAddrs(val)
	if err != nil {
		// An address without ip: or gid: is the kernel's EPROTONOSUPPORT; the rest EINVAL.
		if errors.Is(err, syscall.EPROTONOSUPPORT) {
			return fmt.Errorf("path %q: %w", val, err)
		}
		return fmt.Errorf("path %q: %w", val, syscall.EINVAL)
	}
	port := pp.pending
	if len(pp.paths) > 0 && pp.port != port {
		return fmt.Errorf("paths on ports %d and %d: one session has one port: %w", pp.port, port, syscall.EINVAL)
	}
	pp.port = port
	pp.paths = append(pp.paths, transport.PathAddrs{Src: src, Dst: dst})
	return nil
}

// writePaths writes dest_port= (where it is not the default) and the path= tokens.
func writePaths(b *strings.Builder, paths []transport.PathAddrs, port uint16) {
	if port != transport.DefaultPort {
		fmt.Fprintf(b, " dest_port=%d", port)
	}
	for _, pa := range paths {
		b.WriteString(" path=" + FormatPath(pa))
	}
}
