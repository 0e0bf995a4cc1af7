package transport

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
)

// DefaultPort is RNBD's RTRS_PORT; RTRS itself has none.
const DefaultPort = 1234

// Addr is an RTRS address: an IP address ("ip:") or an InfiniBand GID ("gid:"). The soft
// provider reaches a GID through the IPv6 address it spells, as RoCE v2 does.
type Addr struct {
	IP  netip.Addr
	GID bool
}

// ErrAddr marks an address string that does not parse.
var ErrAddr = errors.New("rtrs: bad address")

// ParseAddr parses "ip:<ipv4|ipv6[%scope]>" or "gid:<gid>" (rtrs_str_to_sockaddr). A string
// without either prefix is EPROTONOSUPPORT, as in the kernel.
func ParseAddr(s string) (Addr, error) {
	switch {
	case strings.HasPrefix(s, "ip:"):
		a, err := netip.ParseAddr(s[3:])
		if err != nil {
			return Addr{}, fmt.Errorf("%w %q: %v", ErrAddr, s, err)
		}
		return Addr{IP: a}, nil
	case strings.HasPrefix(s, "gid:"):
		a, err := netip.ParseAddr(s[4:])
		if err != nil || !a.Is6() || a.Zone() != "" {
			return Addr{}, fmt.Errorf("%w %q: not a GID", ErrAddr, s)
		}
		return Addr{IP: a, GID: true}, nil
	}
	return Addr{}, fmt.Errorf("%w %q: %w (want ip: or gid:)", ErrAddr, s, syscall.EPROTONOSUPPORT)
}

// ParsePathAddrs parses "[src(,|@)]dst" (rtrs_addr_to_sockaddr): the separator is the first
// ',' or, if there is none, the first '@'. src is invalid when absent.
func ParsePathAddrs(s string) (src, dst Addr, err error) {
	i := strings.IndexByte(s, ',')
	if i < 0 {
		i = strings.IndexByte(s, '@')
	}
	if i >= 0 {
		if src, err = ParseAddr(s[:i]); err != nil {
			return Addr{}, Addr{}, err
		}
		s = s[i+1:]
	}
	if dst, err = ParseAddr(s); err != nil {
		return Addr{}, Addr{}, err
	}
	if src.IP.IsValid() && src.IP.Unmap().Is4() != dst.IP.Unmap().Is4() {
		return Addr{}, Addr{}, fmt.Errorf("%w: source %v and destination %v differ in family", ErrAddr, src, dst)
	}
	return src, dst, nil
}

// String formats the address as the kernel's sysfs does: "ip:" with dotted quad or
// compressed IPv6 (no scope, no port), "gid:" with the full 8-group form.
func (a Addr) String() string {
	if !a.IP.IsValid() {
		return "<invalid address family>"
	}
	if a.GID {
		b := a.IP.As16()
		var sb strings.Builder
		sb.WriteString("gid:")
		for i := 0; i < 16; i += 2 {
			if i > 0 {
				sb.WriteByte(':')
			}
			fmt.Fprintf(&sb, "%02x%02x", b[i], b[i+1])
		}
		return sb.String()
	}
	return "ip:" + a.IP.WithZone("").String()
}

// PathName is the directory name of a path: "<src>@<dst>".
func PathName(src, dst Addr) string { return src.String() + "@" + dst.String() }

// addrOf turns a connection endpoint into an RTRS address.
func addrOf(ap netip.AddrPort) Addr { return Addr{IP: ap.Addr().Unmap()} }
