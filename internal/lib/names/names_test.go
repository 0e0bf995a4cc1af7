package names

import (
	"errors"
	"strings"
	"syscall"
	"testing"
)

// Each rule refuses with EINVAL and accepts what it should.
func TestRules(t *testing.T) {
	long := func(n int) string { return strings.Repeat("x", n) }
	text := []string{"disk#x", "a b", "tab\tx", "nl\n", "\x7f", "bad\xffutf8", "nbsp\u00a0x"}
	for _, c := range []struct {
		rule      string
		check     func(string) error
		good, bad []string
	}{
		{"Text", Text, []string{"disk", "vol-1_a", "Ω", "a/b.c", ""}, text},
		{"Component", Component, []string{"disk", "ip:10.0.0.1@ip:10.0.0.2", "a.b", "dev!sda", long(255)},
			append([]string{"", ".", "..", "a/b", long(256)}, text...)},
		{"Session", Session, []string{"disk", "vol-1_a", "Ω", "ctl", long(254)},
			append([]string{"", "a.b", "a/b", ".", long(255)}, text...)},
		{"DevicePath", DevicePath, []string{"/dev/sda", "disk.img", "a/../b", long(254)},
			append([]string{"", long(255)}, text...)},
	} {
		for _, g := range c.good {
			if err := c.check(g); err != nil {
				t.Errorf("%s(%q): %v", c.rule, g, err)
			}
		}
		for _, b := range c.bad {
			if err := c.check(b); !errors.Is(err, syscall.EINVAL) {
				t.Errorf("%s(%q): %v, want EINVAL", c.rule, b, err)
			}
		}
	}
}
