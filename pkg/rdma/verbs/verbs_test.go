//go:build verbs

package verbs

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/rdmatest"
	"golang.org/x/sys/unix"
)

// The tests run on the RDMA device RTRS_VERBS_DEV with the local addresses RTRS_VERBS_ADDR1
// and RTRS_VERBS_ADDR2 on its interface (scripts/vmtest.sh verbs: rxe0 in the VM). Without
// them there is nothing to test on: they are skipped, and the VM suite sets them.
type testEnv struct {
	prov         rdma.Provider
	dev          string
	addr1, addr2 netip.Addr
}

func setup(t *testing.T) testEnv {
	t.Helper()
	dev := os.Getenv("RTRS_VERBS_DEV")
	if dev == "" {
		t.Skip("no RDMA device named in RTRS_VERBS_DEV: these run in scripts/vmtest.sh verbs")
	}
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	return testEnv{prov: p, dev: dev, addr1: netip.MustParseAddr(os.Getenv("RTRS_VERBS_ADDR1")),
		addr2: netip.MustParseAddr(os.Getenv("RTRS_VERBS_ADDR2"))}
}

// TestConformance runs the provider conformance suite, the one the soft provider runs too,
// from the second address to the first.
func TestConformance(t *testing.T) {
	e := setup(t)
	rdmatest.Run(t, rdmatest.Env{Provider: e.prov, ServerAddr: e.addr1, ClientAddr: e.addr2,
		AltClientAddr: e.addr1, LeakCheck: leakcheck.Check, LocalErrorsFlush: rxeAfter61(t), DisconnectReordersReceives: rxeAfter61(t)})
}

// rxeAfter61 says whether the running kernel's rxe is one reworked after 6.1 (6.12 and 7.2
// seen), whose QP state and task changes the conformance suite allows for: it completes a
// request that failed a local check as flushed (6.1's reports the request's own error; the
// requester moves the QP to the error state and the completer flushes the whole send queue,
// the failed request included; docs/rdma-api.md), and its responder, racing a move to error,
// may place a SEND in the receive after one it flushed.
func rxeAfter61(t *testing.T) bool {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	rel := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(rel, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("kernel release %q: %v", rel, err)
	}
	return major > 6 || major == 6 && minor > 1
}

// TestDevice: the device, its limits, its active port and GIDs come from rdma-core, and the
// interface behind it holds the test addresses.
func TestDevice(t *testing.T) {
	e := setup(t)
	infos, err := e.prov.Devices()
	if err != nil {
		t.Fatal(err)
	}
	var ifname string
	for _, i := range infos {
		if i.Name == e.dev {
			ifname = i.Interface
		}
	}
	if ifname == "" {
		t.Fatalf("devices %+v: no %s with an interface", infos, e.dev)
	}
	d, err := e.prov.OpenDevice(e.dev)
	if err != nil {
		t.Fatal(err)
	}
	a := d.Query()
	if a.MaxQPWR < 1024 || a.MaxSGE < 2 || a.MaxCQE < 1024 || a.SyncLocalOps || !a.MapRegisteredOnly || a.MaxMsgSize == 0 {
		t.Fatalf("device attributes %+v", a)
	}
	pa, err := d.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	if pa.State != rdma.PortActive || pa.LinkLayer != "Ethernet" || pa.MTU < 1024 {
		t.Fatalf("port %+v", pa)
	}
	// RoCE GIDs are the interface's addresses (IPv4 ones mapped).
	found := 0
	for _, g := range pa.GIDs {
		if g.Unmap() == e.addr1 || g.Unmap() == e.addr2 {
			found++
		}
	}
	if found < 2 {
		t.Fatalf("GIDs %v lack %v and %v", pa.GIDs, e.addr1, e.addr2)
	}
	if _, err := d.QueryPort(0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("port 0: %v", err)
	}
	if _, err := e.prov.OpenDevice("nosuch0"); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("unknown device: %v", err)
	}
}

// TestMemory: only memory outside the Go heap registers; fast registration maps only into a
// registered region; file regions are refused with EINVAL.
func TestMemory(t *testing.T) {
	e := setup(t)
	d, _ := e.prov.OpenDevice(e.dev)
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := pd.Dealloc(); err != nil {
			t.Error(err)
		}
	}()
	if _, err := pd.RegMR(make([]byte, 4096), rdma.AccessLocalWrite); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Go heap memory registered: %v", err)
	}
	mem, err := rdma.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer rdma.Free(mem)
	mr, err := pd.RegMR(mem, rdma.AccessLocalWrite|rdma.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	if mr.Addr() == 0 || mr.Len() != len(mem) || !mr.Valid() || mr.LKey() == 0 {
		t.Fatalf("MR addr %#x len %d valid %v", mr.Addr(), mr.Len(), mr.Valid())
	}
	ro, err := pd.AllocMR(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, flags := range []rdma.FastRegFlags{0, rdma.FastRegRemoteInv} {
		fr, err := pd.AllocFastRegMR(64<<10, flags)
		if err != nil {
			t.Fatal(err)
		}
		if err := fr.Map(make([]byte, 4096), 0); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("mapped Go heap memory: %v", err)
		}
		if err := fr.Map(ro.Bytes(), 0); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("mapped a region without local write: %v", err)
		}
		if err := fr.Map(mem[4096:4096+128<<10], 0); !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("mapped more than the window's size: %v", err)
		}
		if err := fr.Map(mem[4096:8192], 0x1000); err != nil {
			t.Fatal(err)
		}
		if fr.Addr() != mr.Addr()+4096 || fr.Valid() {
			t.Fatalf("window at %#x (region at %#x), valid %v", fr.Addr(), mr.Addr(), fr.Valid())
		}
		if err := fr.Dereg(); err != nil {
			t.Fatal(err)
		}
	}
	// A window maps over a caller's region that begins where it maps and is no longer than
	// its maximum (a ublk tag's buffer): bound over it as it is, which is neither
	// deregistered when the window moves on nor when the window goes. A longer region, even
	// one that begins there, is not: the key would reach past the window's maximum. Its own
	// region is kept while the caller's serves.
	tag, err := pd.RegMR(mem[64<<10:128<<10], rdma.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	long, err := pd.RegMR(mem[128<<10:256<<10], rdma.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	fr, err := pd.AllocFastRegMR(64<<10, rdma.FastRegRemoteInv)
	if err != nil {
		t.Fatal(err)
	}
	w := asMR(fr)
	if err := fr.Map(mem[64<<10:68<<10], 0); err != nil {
		t.Fatal(err)
	}
	if w.base != asMR(tag) || w.own != nil || fr.Addr() != tag.Addr() {
		t.Fatalf("a window mapped at the start of a 64 KiB region of its size is bound over %p (own %p), not the region %p", w.base, w.own, tag)
	}
	if err := fr.Map(mem[128<<10:132<<10], 0); err != nil {
		t.Fatal(err)
	}
	own := w.own
	if w.base == asMR(long) || own == nil || w.base != own || len(own.buf) != 64<<10 {
		t.Fatalf("a window mapped at the start of a 128 KiB region is bound over %p, not a 64 KiB region of its own (%p)", w.base, own)
	}
	if err := fr.Map(mem[64<<10:72<<10], 0); err != nil || w.base != asMR(tag) || w.own != own {
		t.Fatalf("mapped back at the tag region: %v, bound over %p, own region %p (was %p)", err, w.base, w.own, own)
	}
	if err := fr.Map(mem[128<<10:136<<10], 0); err != nil || w.base != own {
		t.Fatalf("mapped again where its own region is: %v, bound over %p, not that region %p", err, w.base, own)
	}
	if err := fr.Dereg(); err != nil {
		t.Fatal(err)
	}
	if !own.dereg || !tag.Valid() || !long.Valid() {
		t.Fatalf("after the window went: its own region deregistered %v, the caller's valid %v and %v", own.dereg, tag.Valid(), long.Valid())
	}
	for _, m := range []rdma.MR{tag, long} {
		if err := m.Dereg(); err != nil {
			t.Fatalf("a caller's region, after the window bound over it went: %v", err)
		}
	}
	f, err := os.CreateTemp(t.TempDir(), "file")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := pd.RegFileMR(f, 0, 4096, 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("file region: %v", err)
	}
	if err := ro.Dereg(); err != nil {
		t.Fatal(err)
	}
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	if err := mr.Dereg(); !errors.Is(err, rdma.ErrClosed) {
		t.Fatalf("second dereg: %v", err)
	}
}

// asMR is the provider's region behind m.
func asMR(m rdma.MR) *mr { return m.(*mr) }

// TestDataPathCalls: each poll is one call into C, a busy poll too however often it spins, and
// a destroyed CQ's calls stay in the count.
func TestDataPathCalls(t *testing.T) {
	e := setup(t)
	cc, ok := e.prov.(rdma.CallCounter)
	if !ok {
		t.Fatal("the verbs provider does not count its calls into C")
	}
	d, err := e.prov.OpenDevice(e.dev)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	c, err := d.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	n0 := cc.DataPathCalls()
	var wc [4]rdma.WC
	if c.Poll(wc[:]) != 0 {
		t.Fatal("a new CQ has a completion")
	}
	if got := cc.DataPathCalls() - n0; got != 1 {
		t.Fatalf("one poll counted as %d calls", got)
	}
	if c.(rdma.BusyPoller).PollBusy(wc[:], 100) != 0 {
		t.Fatal("a new CQ has a completion")
	}
	if got := cc.DataPathCalls() - n0; got != 2 {
		t.Fatalf("a poll and a busy poll of 100 spins counted as %d calls", got)
	}
	dev := d.(*device)
	counted := func() int {
		dev.mu.Lock()
		defer dev.mu.Unlock()
		return len(dev.counted)
	}
	before := counted()
	if err := c.Destroy(); err != nil {
		t.Fatal(err)
	}
	if got := cc.DataPathCalls() - n0; got != 2 {
		t.Fatalf("after the CQ's destruction the count moved by %d, not 2", got)
	}
	if after := counted(); after != before-1 {
		t.Fatalf("the device counts the calls of %d objects after a CQ's destruction, %d before", after, before)
	}
}
