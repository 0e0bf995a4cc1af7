// Package rdmatest is the provider conformance suite of pkg/rdma: one test source that every
// provider runs (the soft provider on loopback, the verbs provider over an HCA such as
// Soft-RoCE), so that both keep the same contract.
//
// The cases are written to the verbs contract, not to one provider's incidental behaviour:
//
//   - memory comes from PD.AllocMR, or from rdma.Alloc registered with PD.RegMR, never from
//     the Go heap;
//   - LOCAL_INV and REG_MR are signaled and their completion is awaited before a key is used
//     or MR.Valid is read (DeviceAttr.SyncLocalOps may be false);
//   - a fast-reg region is mapped over registered memory with local write, and MR.Addr after
//     Map is the address SGEs and peers name (DeviceAttr.MapRegisteredOnly may be true and
//     the iova may be ignored); REG_MR's key is rdma.IncKey(mr.RKey());
//   - only wr_id, status and qp_num of an error completion are checked (ibv_poll_cq leaves
//     the rest undefined), and ByteLen only where verbs define it;
//   - a QP error produces no CM event by itself: the cases disconnect explicitly and then
//     expect EventDisconnected on both sides;
//   - private data may arrive zero-padded (the CM's REQ and REP carry fixed-size fields), so
//     what arrives must start with what was sent, followed by zeros only;
//   - an unsignaled request's send queue slot may come back only with a later signaled
//     completion, polled: long runs of requests signal some of them;
//   - receives are posted before the requests that consume them, since an RNR NAK costs up to
//     655 ms on a QP that the CM set up (min_rnr_timer 0), except where RNR is under test;
//   - every wait is bounded and fails the test with what it waited for.
//
// A provider's tests run the suite with their environment, as pkg/rdma/soft does:
//
//	func TestConformance(t *testing.T) {
//		rdmatest.Run(t, rdmatest.Env{
//			Provider:      soft.New(soft.Options{}),
//			ServerAddr:    netip.MustParseAddr("127.0.0.1"),
//			ClientAddr:    netip.MustParseAddr("127.0.0.1"),
//			AltClientAddr: netip.MustParseAddr("127.0.0.2"),
//			LeakCheck:     leakcheck.Check,
//		})
//	}
package rdmatest

import (
	"net/netip"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Env is what the suite runs against.
type Env struct {
	// Provider is the provider under test. The suite uses one instance throughout.
	Provider rdma.Provider
	// ServerAddr is the local address the suite listens on (port 0; the listener's Addr
	// gives the port) and the destination the client connects to. It must be specified.
	ServerAddr netip.Addr
	// ClientAddr is the source address the client resolves from; the zero Addr leaves the
	// choice to the route. It may equal ServerAddr (loopback).
	ClientAddr netip.Addr
	// AltClientAddr is optional: a second local source address (127.0.0.2 on loopback) that
	// the SourceAddress case connects from as well, so that a provider which ignores the
	// source is caught even where ClientAddr equals ServerAddr.
	AltClientAddr netip.Addr
	// LeakCheck, if set, is called at the start of every case (leakcheck.Check): it may
	// register a cleanup that fails the test if goroutines started by the case outlive it.
	LeakCheck func(testing.TB)
	// ExactQueueSizes says the provider sizes its queues exactly as asked: posting past
	// QPInitAttr.MaxSendWR or MaxRecvWR fails at exactly that index. An HCA may round the
	// sizes up; then the suite only requires the failure at that index or later.
	ExactQueueSizes bool
	// LocalErrorsFlush says the provider may complete a request that fails a local check as
	// flushed (WCFlushErr) instead of with the error, and may have executed an RDMA_WRITE posted
	// behind an RDMA_READ whose local protection error it finds only when the response
	// arrives, as Linux 7.x's rxe does (an HCA may too). The QP must still fail.
	LocalErrorsFlush bool
	// DisconnectReordersReceives says the provider may, when its QP moves to error while a
	// SEND is being received, flush the receive at the head of the queue and place the SEND
	// in the next one, as rxe after 6.1 did once in the VM (6.12). Otherwise the SEND can
	// only land in the first receive.
	DisconnectReordersReceives bool
}

// testCase is one conformance case.
type testCase struct {
	name string
	run  func(*testing.T, *Env)
}

// cases are the conformance cases, in the order Run runs them.
var cases = []testCase{
	{"Connect", testConnect},
	{"SourceAddress", testSourceAddress},
	{"Reject", testReject},
	{"ConnectFailures", testConnectFailures},
	{"MRValidation", testMRValidation},
	{"Send", testSend},
	{"RDMAWrite", testRDMAWrite},
	{"RDMARead", testRDMARead},
	{"UnsignaledAndOrder", testUnsignaledAndOrder},
	{"QueueLimits", testQueueLimits},
	{"FastReg", testFastReg},
	{"SendWithInv", testSendWithInv},
	{"SendWithInvRefused", testSendWithInvRefused},
	{"AccessViolations", testAccessViolations},
	{"LocalProtection", testLocalProtection},
	{"ReceiveTooSmall", testReceiveTooSmall},
	{"RNR", testRNR},
	{"Disconnect", testDisconnect},
	{"ManyQPs", testManyQPs},
	{"CompletionHandler", testCompletionHandler},
	{"HandlerChange", testHandlerChange},
	{"BusyPoll", testBusyPoll},
}

// Run runs every conformance case against env, each as a subtest of t (run one with
// -run 'TestX/AccessViolations/write_after_LOCAL_INV'). The cases run one after another.
func Run(t *testing.T, env Env) {
	t.Helper()
	if env.Provider == nil {
		t.Fatal("rdmatest: Env.Provider is nil")
	}
	if !env.ServerAddr.IsValid() || env.ServerAddr.IsUnspecified() {
		t.Fatalf("rdmatest: Env.ServerAddr %v: a specified address is needed", env.ServerAddr)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			env.begin(t)
			c.run(t, &env)
		})
	}
}

// begin starts a case (or a subtest of one): the leak check, if any.
func (e *Env) begin(t testing.TB) {
	if e.LeakCheck != nil {
		e.LeakCheck(t)
	}
}
