package soft

import (
	"net/netip"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma/rdmatest"
)

// TestConformance runs the provider conformance suite (pkg/rdma/rdmatest) over loopback.
func TestConformance(t *testing.T) {
	rdmatest.Run(t, rdmatest.Env{
		Provider:        New(Options{}),
		ServerAddr:      netip.MustParseAddr("127.0.0.1"),
		ClientAddr:      netip.MustParseAddr("127.0.0.1"),
		AltClientAddr:   netip.MustParseAddr("127.0.0.2"),
		LeakCheck:       leakcheck.Check,
		ExactQueueSizes: true,
	})
}
