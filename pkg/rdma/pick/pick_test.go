package pick

import (
	"errors"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma/verbs"
)

func TestOpen(t *testing.T) {
	p, why, err := Open("soft")
	if err != nil || p.Name() != "soft" || why == "" {
		t.Fatalf("soft: %v %q %v", p, why, err)
	}
	if _, _, err := Open("rxe"); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("unknown name: %v", err)
	}
	if vp, err := verbs.New(); err == nil {
		// An RDMA device (the VM suite): auto takes it for any address, and not for an
		// address no RDMA interface has.
		p, why, err = Open("auto")
		if err != nil || p.Name() != "verbs" || !strings.HasPrefix(why, "verbs: ") {
			t.Fatalf("auto with %v: %v %q %v", vp, p, why, err)
		}
		p, why, err = Open("auto", netip.MustParseAddr("127.0.0.1"))
		if err != nil || p.Name() != "soft" || !strings.Contains(why, "no RDMA device with an active port serves") {
			t.Fatalf("auto for loopback: %v %q %v", p, why, err)
		}
		return
	}
	// No RDMA device: auto falls back to soft and says why; verbs asked for fails.
	p, why, err = Open("auto", netip.MustParseAddr("127.0.0.1"))
	if err != nil || p.Name() != "soft" || !strings.HasPrefix(why, "soft: ") {
		t.Fatalf("auto: %v %q %v", p, why, err)
	}
	if !verbs.Built && !strings.Contains(why, "built without verbs") {
		t.Fatalf("auto without verbs says %q", why)
	}
	if _, _, err := Open("verbs"); err == nil {
		t.Fatal("verbs opened without an RDMA device")
	}
}
