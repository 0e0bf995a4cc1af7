package transport

import (
	"errors"
	"net/netip"
	"syscall"
	"testing"
)

func TestParsePathAddrs(t *testing.T) {
	for _, c := range []struct{ in, src, dst string }{
		{"ip:10.0.0.2", "<invalid address family>", "ip:10.0.0.2"},
		{"ip:10.0.0.1@ip:10.0.0.2", "ip:10.0.0.1", "ip:10.0.0.2"},
		{"ip:10.0.0.1,ip:10.0.0.2", "ip:10.0.0.1", "ip:10.0.0.2"},
		{"ip:fe80::1%lo,ip:fe80::2", "ip:fe80::1", "ip:fe80::2"},
		{"ip:2001:db8:0:0:0:0:0:1", "<invalid address family>", "ip:2001:db8::1"},
		{"ip:::ffff:10.1.2.3", "<invalid address family>", "ip:::ffff:10.1.2.3"},
		{"gid:fe80::2:c903:10:a61", "<invalid address family>", "gid:fe80:0000:0000:0000:0002:c903:0010:0a61"},
	} {
		src, dst, err := ParsePathAddrs(c.in)
		if err != nil || src.String() != c.src || dst.String() != c.dst {
			t.Errorf("%q: %v %v %v", c.in, src, dst, err)
		}
	}
	for _, in := range []string{"", "10.0.0.1", "ip:", "ip:10.0.0.1@", "ip:1.2.3.4@ip:::1", "gid:10.0.0.1", "ip:10.0.0.300", "tcp:1.2.3.4", "ip:1.2.3.4@ip:5.6.7.8@ip:9.9.9.9"} {
		if _, _, err := ParsePathAddrs(in); !errors.Is(err, ErrAddr) {
			t.Errorf("%q accepted", in)
		}
	}
	if _, err := ParseAddr("10.0.0.1"); !errors.Is(err, syscall.EPROTONOSUPPORT) {
		t.Errorf("missing prefix: %v", err)
	}
	src, dst, _ := ParsePathAddrs("ip:127.0.0.2@ip:127.0.0.1")
	if PathName(src, dst) != "ip:127.0.0.2@ip:127.0.0.1" {
		t.Fatal(PathName(src, dst))
	}
}

// TestOnHost: a path's client is on this host when its address is a loopback one or the
// server's own, however it is written.
func TestOnHost(t *testing.T) {
	ip := func(s string) Addr { return Addr{IP: netip.MustParseAddr(s)} }
	for _, c := range []struct {
		src, dst Addr
		want     bool
	}{
		{ip("127.0.0.1"), ip("127.0.0.1"), true},
		{ip("127.0.0.2"), ip("10.0.0.1"), true},
		{ip("::1"), ip("::1"), true},
		{ip("::ffff:127.0.0.1"), ip("127.0.0.1"), true},
		{ip("10.0.0.1"), ip("10.0.0.1"), true},
		{ip("::ffff:10.0.0.1"), ip("10.0.0.1"), true},
		{ip("10.0.0.1"), ip("10.0.0.2"), false},
		{ip("fe80::1"), ip("fe80::2"), false},
		{ip("fe80::1%eth0"), ip("fe80::1%eth0"), true},
		// Another address of this host is not recognised (PeerOnHost's doc).
		{ip("10.0.0.2"), ip("10.0.0.1"), false},
		{Addr{}, Addr{}, false},
	} {
		if got := onHost(c.src, c.dst); got != c.want {
			t.Errorf("onHost(%v, %v) = %v, want %v", c.src.IP, c.dst.IP, got, c.want)
		}
	}
}
