package soft

import (
	"bytes"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// The data path, the access checks, RNR, disconnects and the CM's outcomes that every
// provider shares are in the conformance suite (TestConformance, pkg/rdma/rdmatest). The
// tests here are of what only the soft provider does.

const (
	lw  = rdma.AccessLocalWrite
	rw  = rdma.AccessLocalWrite | rdma.AccessRemoteWrite
	rr  = rdma.AccessRemoteRead
	all = rw | rr
)

// TestSoftDevice: a connection over loopback runs on the device soft_lo, port 1, which the
// provider lists for interface lo.
func TestSoftDevice(t *testing.T) {
	leakcheck.Check(t)
	p := New(Options{})
	pr := newPair(t, p)
	if pr.cli.dev.Name() != "soft_lo" || pr.srv.dev.Name() != "soft_lo" {
		t.Fatalf("devices %q %q, want soft_lo", pr.cli.dev.Name(), pr.srv.dev.Name())
	}
	if pr.cli.id.Port() != 1 || pr.cli.dev.Query().PhysPortCnt != 1 {
		t.Fatalf("port %d of %d", pr.cli.id.Port(), pr.cli.dev.Query().PhysPortCnt)
	}
	devs, err := p.Devices()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, d := range devs {
		found = found || d == rdma.DeviceInfo{Name: "soft_lo", Interface: "lo"}
	}
	if !found {
		t.Fatalf("devices %v lack soft_lo on lo", devs)
	}
	for _, name := range []string{"mlx5_0", "soft_", "soft_no-such-interface"} {
		if _, err := p.OpenDevice(name); !errors.Is(err, syscall.ENODEV) {
			t.Errorf("OpenDevice(%q): %v, want ENODEV", name, err)
		}
	}
}

// TestSyncLocalOps: the soft provider executes LOCAL_INV and REG_MR when they are posted
// (DeviceAttr.SyncLocalOps), unsignaled ones too, maps any memory (MapRegisteredOnly is
// false) at the iova asked for, and keeps the key a fast-reg region is registered under.
func TestSyncLocalOps(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	a := pr.cli.dev.Query()
	if !a.SyncLocalOps || a.MapRegisteredOnly {
		t.Fatalf("attributes %+v: want SyncLocalOps, not MapRegisteredOnly", a)
	}
	fr, err := pr.cli.pd.AllocFastRegMR(8192, rdma.FastRegRemoteInv)
	if err != nil {
		t.Fatal(err)
	}
	if err := fr.Map(make([]byte, 8192), 0x5000000); err != nil {
		t.Fatal(err)
	}
	key := rdma.IncKey(fr.RKey())
	pr.cli.post(t, rdma.SendWR{Opcode: rdma.OpRegMR, MR: fr, Key: key, Access: rw})
	if !fr.Valid() || fr.RKey() != key || fr.LKey() != key || fr.Addr() != 0x5000000 || fr.Access() != rw {
		t.Fatalf("right after REG_MR: valid %v key %#x/%#x addr %#x access %v", fr.Valid(), fr.RKey(), fr.LKey(), fr.Addr(), fr.Access())
	}
	pr.cli.post(t, rdma.SendWR{Opcode: rdma.OpLocalInv, InvRKey: key})
	if fr.Valid() {
		t.Fatal("valid right after LOCAL_INV")
	}
	pr.cli.noCompletion(t)
}

// TestUnsignaledSlotsComeBack: more unsignaled requests than the send queue holds, and no
// signaled one: the peer's acknowledgements free their slots (the soft provider asks for one
// when half the queue awaits it), where an HCA needs a signaled completion to be polled.
func TestUnsignaledSlotsComeBack(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	src := pr.cli.reg(t, 4096, lw)
	dst := pr.srv.reg(t, 4096, rw)
	for i := 0; i < 3*testQD; i++ {
		pr.cli.postRetry(t, rdma.SendWR{ID: uint64(i), Opcode: rdma.OpRDMAWrite,
			SGList: []rdma.SGE{rdma.SGEOf(src, 0, 4096)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	}
	pr.cli.noCompletion(t)
}

// TestMRValidation covers what the soft provider allows beyond verbs: registering Go memory,
// LOCAL_INV of a registered region (which keeps its memory: only fast-reg regions map), and a
// fresh key byte when a key index is reused.
func TestMRValidation(t *testing.T) {
	p := New(Options{})
	dev, err := p.OpenDevice("soft_lo")
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	m, err := pd.RegMR(make([]byte, 8), lw)
	if err != nil {
		t.Fatalf("RegMR of Go memory: %v", err)
	}
	if !invalidateKey(dev, pd, m.LKey()) {
		t.Fatal("LOCAL_INV refused")
	}
	if m.Valid() {
		t.Fatal("valid after LOCAL_INV")
	}
	if err := m.Map(make([]byte, 8), 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("map of a registered MR: %v", err)
	}
	if err := m.Dereg(); err != nil {
		t.Fatal(err)
	}
	m2, _ := pd.RegMR(make([]byte, 8), lw)
	if m2.LKey() == m.LKey() {
		t.Fatalf("key %#x reused after dereg", m2.LKey())
	}
}

// invalidateKey runs what a LOCAL_INV work request does.
func invalidateKey(dev rdma.Device, p rdma.PD, key uint32) bool {
	ok, placers := dev.(*device).invalidate(p.(*pd), nil, key)
	fence(placers)
	return ok
}

// TestLargeWriteLeavesDuringBurst: a large RDMA WRITE that a completion handler posts while
// the reader runs its burst's handlers leaves at once, not when the handlers return, so a
// server answering a burst of large READs sends each answer as it is made. Before
// flushLarge it waited for the handler, which here waits for the peer to see it: the
// handler gave up after 5 s and the test failed.
func TestLargeWriteLeavesDuringBurst(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	const n = 2 * handOff
	src := pr.srv.reg(t, n, lw)
	fill(src.Bytes(), 7)
	dst := pr.cli.reg(t, n, rw)
	msg := pr.cli.reg(t, 8, lw)
	pr.srv.recv(t, 1, pr.srv.reg(t, 8, lw), 0, 8)
	pr.cli.recv(t, 2, nil, 0, 0)
	seen := make(chan struct{})
	result := make(chan error, 1)
	var once sync.Once
	pr.srv.cq.SetHandler(func() {
		var wc [4]rdma.WC
		for pr.srv.cq.Poll(wc[:]) > 0 {
			once.Do(func() {
				_, err := pr.srv.qp.PostSend([]rdma.SendWR{{ID: 3, Opcode: rdma.OpRDMAWriteWithImm,
					SGList: []rdma.SGE{rdma.SGEOf(src, 0, n)}, RemoteAddr: dst.Addr(), RKey: dst.RKey(), Imm: 9}})
				if err == nil {
					select {
					case <-seen:
					case <-time.After(5 * time.Second):
						err = errors.New("the WRITE did not leave while the handler ran")
					}
				}
				result <- err
			})
		}
	})
	pr.cli.post(t, rdma.SendWR{ID: 4, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}})
	wc := pr.cli.expect(t, 2, rdma.WCRecvRDMAWithImm, rdma.WCSuccess)
	close(seen)
	if err := <-result; err != nil {
		t.Fatal(err)
	}
	if wc.Imm != 9 || !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatalf("immediate %d, data equal %v", wc.Imm, bytes.Equal(dst.Bytes(), src.Bytes()))
	}
}
