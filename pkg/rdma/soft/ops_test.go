package soft

import (
	"bytes"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/internal/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

const (
	lw  = rdma.AccessLocalWrite
	rw  = rdma.AccessLocalWrite | rdma.AccessRemoteWrite
	rr  = rdma.AccessRemoteRead
	all = rw | rr
)

func TestConnectPrivateDataAndDevice(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	if string(pr.cliData) != "client-hello" || string(pr.srvData) != "server-hello" {
		t.Fatalf("private data: server saw %q, client saw %q", pr.cliData, pr.srvData)
	}
	if pr.cli.dev.Name() != "soft_lo" || pr.srv.dev.Name() != "soft_lo" {
		t.Fatalf("devices %q %q, want soft_lo", pr.cli.dev.Name(), pr.srv.dev.Name())
	}
	if pr.cli.id.Port() != 1 {
		t.Fatalf("port %d", pr.cli.id.Port())
	}
	if pr.cli.qp.State() != rdma.QPSRTS || pr.srv.qp.State() != rdma.QPSRTS {
		t.Fatalf("states %v %v", pr.cli.qp.State(), pr.srv.qp.State())
	}
	if pr.cli.id.LocalAddr() != pr.srv.id.RemoteAddr() || pr.srv.id.LocalAddr() != pr.cli.id.RemoteAddr() {
		t.Fatalf("addresses: client %v->%v, server %v<-%v", pr.cli.id.LocalAddr(), pr.cli.id.RemoteAddr(), pr.srv.id.LocalAddr(), pr.srv.id.RemoteAddr())
	}
	pa, err := pr.cli.dev.QueryPort(1)
	if err != nil || pa.State != rdma.PortActive {
		t.Fatalf("port 1: %+v %v", pa, err)
	}
	if _, err := pr.cli.dev.QueryPort(2); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("port 2: %v", err)
	}
}

func TestSendAndSendWithImm(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	src := pr.cli.reg(t, 8192, lw)
	dst := pr.srv.reg(t, 8192, lw)
	fill(src.Bytes(), 3)
	// Two SGEs on each side, split differently: scatter must follow the receive's list.
	if _, err := pr.srv.qp.PostRecv([]rdma.RecvWR{{ID: 7, SGList: []rdma.SGE{rdma.SGEOf(dst, 0, 100), rdma.SGEOf(dst, 1000, 5000)}}}); err != nil {
		t.Fatal(err)
	}
	pr.srv.recv(t, 8, dst, 6000, 100)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(src, 0, 3000), rdma.SGEOf(src, 4000, 10)}})
	pr.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, Imm: 0xdeadbeef,
		SGList: []rdma.SGE{rdma.SGEOf(src, 100, 64)}})
	wc := pr.srv.expect(t, 7, rdma.WCRecv, rdma.WCSuccess)
	if wc.ByteLen != 3010 || wc.Flags != 0 {
		t.Fatalf("recv %+v", wc)
	}
	want := append(append([]byte{}, src.Bytes()[:3000]...), src.Bytes()[4000:4010]...)
	got := append(append([]byte{}, dst.Bytes()[:100]...), dst.Bytes()[1000:1000+2910]...)
	if !bytes.Equal(got, want) {
		t.Fatal("SEND payload not scattered as posted")
	}
	wc = pr.srv.expect(t, 8, rdma.WCRecv, rdma.WCSuccess)
	if wc.ByteLen != 64 || wc.Flags&rdma.WCWithImm == 0 || wc.Imm != 0xdeadbeef {
		t.Fatalf("recv with imm %+v", wc)
	}
	if !bytes.Equal(dst.Bytes()[6000:6064], src.Bytes()[100:164]) {
		t.Fatal("SEND_WITH_IMM payload")
	}
	pr.cli.expect(t, 1, rdma.WCSend, rdma.WCSuccess)
	pr.cli.expect(t, 2, rdma.WCSend, rdma.WCSuccess)
}

func TestRDMAWriteAndWriteWithImm(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	src := pr.cli.reg(t, 1<<20, lw)
	dst := pr.srv.reg(t, 1<<20, rw)
	fill(src.Bytes(), 9)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(src, 0, 512<<10)}, RemoteAddr: dst.Addr() + 4096, RKey: dst.RKey()})
	pr.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
	pr.srv.noCompletion(t) // a plain RDMA_WRITE consumes no receive
	pr.sync(t)
	if !bytes.Equal(dst.Bytes()[4096:4096+512<<10], src.Bytes()[:512<<10]) {
		t.Fatal("RDMA_WRITE data")
	}
	// WRITE_WITH_IMM consumes a receive without SGEs.
	pr.srv.recv(t, 5, nil, 0, 0)
	pr.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWriteWithImm, Flags: rdma.SendSignaled, Imm: 0x12345678,
		SGList: []rdma.SGE{rdma.SGEOf(src, 100, 1000)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	wc := pr.srv.expect(t, 5, rdma.WCRecvRDMAWithImm, rdma.WCSuccess)
	if wc.Imm != 0x12345678 || wc.Flags&rdma.WCWithImm == 0 || wc.ByteLen != 1000 {
		t.Fatalf("write-with-imm completion %+v", wc)
	}
	if !bytes.Equal(dst.Bytes()[:1000], src.Bytes()[100:1100]) {
		t.Fatal("RDMA_WRITE_WITH_IMM data")
	}
	// Zero-length WRITE_WITH_IMM (the RTRS heartbeat shape).
	pr.srv.recv(t, 6, nil, 0, 0)
	pr.cli.post(t, rdma.SendWR{ID: 3, Opcode: rdma.OpRDMAWriteWithImm, Imm: 0x80000000, RKey: dst.RKey(), RemoteAddr: dst.Addr()})
	if wc := pr.srv.expect(t, 6, rdma.WCRecvRDMAWithImm, rdma.WCSuccess); wc.Imm != 0x80000000 || wc.ByteLen != 0 {
		t.Fatalf("heartbeat completion %+v", wc)
	}
}

func TestRDMARead(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	remote := pr.srv.reg(t, 256<<10, rr)
	fill(remote.Bytes(), 77)
	local := pr.cli.reg(t, 256<<10, lw)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList:     []rdma.SGE{rdma.SGEOf(local, 0, 1000), rdma.SGEOf(local, 2000, 127<<10)},
		RemoteAddr: remote.Addr() + 50, RKey: remote.RKey()})
	wc := pr.cli.expect(t, 1, rdma.WCRDMARead, rdma.WCSuccess)
	if wc.ByteLen != 1000+127<<10 {
		t.Fatalf("read length %d", wc.ByteLen)
	}
	r := remote.Bytes()[50:]
	if !bytes.Equal(local.Bytes()[:1000], r[:1000]) || !bytes.Equal(local.Bytes()[2000:2000+127<<10], r[1000:1000+127<<10]) {
		t.Fatal("RDMA_READ data")
	}
	// One-sided: nothing at the responder.
	pr.srv.noCompletion(t)
	// A read into memory without LOCAL_WRITE is a local protection error.
	ro := pr.cli.reg(t, 4096, 0)
	pr.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(ro, 0, 4096)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()})
	pr.cli.expect(t, 2, rdma.WCRDMARead, rdma.WCLocProtErr)
	if pr.cli.qp.State() != rdma.QPSErr {
		t.Fatal("QP not in error after a local protection error")
	}
}

func TestSendWithInvalidate(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	target, err := pr.srv.pd.AllocFastRegMR(4096, rdma.FastRegRemoteInv)
	if err != nil {
		t.Fatal(err)
	}
	mem := pr.srv.reg(t, 4096, lw)
	if err := target.Map(mem.Bytes(), mem.Addr()); err != nil {
		t.Fatal(err)
	}
	pr.srv.post(t, rdma.SendWR{ID: 9, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: target, Key: rdma.IncKey(target.RKey()), Access: rw})
	pr.srv.expect(t, 9, rdma.WCRegMR, rdma.WCSuccess)
	msg := pr.cli.reg(t, 64, lw)
	buf := pr.srv.reg(t, 64, lw)
	pr.srv.recv(t, 1, buf, 0, 64)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: target.RKey(),
		SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}})
	wc := pr.srv.expect(t, 1, rdma.WCRecv, rdma.WCSuccess)
	if wc.Flags&rdma.WCWithInv == 0 || wc.InvRKey != target.RKey() {
		t.Fatalf("completion %+v does not report the invalidation", wc)
	}
	if target.Valid() {
		t.Fatal("MR still valid after SEND_WITH_INV")
	}
	pr.cli.expect(t, 1, rdma.WCSend, rdma.WCSuccess)
	// The invalidated key no longer grants access.
	pr.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}, RemoteAddr: target.Addr(), RKey: target.RKey()})
	pr.cli.expect(t, 2, rdma.WCRDMAWrite, rdma.WCRemAccessErr)
}

// TestSendWithInvalidateRefused: a peer may not invalidate a registered region (nor a
// fast-reg region not allocated for it): a remote invalid request, and the region stays.
func TestSendWithInvalidateRefused(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	target := pr.srv.reg(t, 4096, rw)
	msg := pr.cli.reg(t, 64, lw)
	buf := pr.srv.reg(t, 64, lw)
	pr.srv.recv(t, 1, buf, 0, 64)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: target.RKey(),
		SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}})
	pr.cli.expect(t, 1, rdma.WCSend, rdma.WCRemInvReqErr)
	if !target.Valid() {
		t.Fatal("a registered region was invalidated by its peer")
	}
}

// TestUnsignaledAndLocalOps checks completion order on the send queue: unsignaled requests
// complete silently, local operations complete in order behind them, and the peer's acks keep
// the queue moving without any signaled wire request.
func TestUnsignaledAndLocalOps(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	src := pr.cli.reg(t, 4096, lw)
	dst := pr.srv.reg(t, 4096, rw)
	fr, err := pr.cli.pd.AllocFastRegMR(8192, rdma.FastRegRemoteInv)
	if err != nil {
		t.Fatal(err)
	}
	// More unsignaled writes than the send queue holds: slots must come back through acks.
	for i := 0; i < 3*testQD; i++ {
		pr.cli.postRetry(t, rdma.SendWR{ID: uint64(i), Opcode: rdma.OpRDMAWrite,
			SGList: []rdma.SGE{rdma.SGEOf(src, 0, 4096)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	}
	// REG_MR of a fast-reg MR over new memory, then LOCAL_INV of it, both signaled.
	mem := make([]byte, 8192)
	if err := fr.Map(mem, 0x5000000); err != nil {
		t.Fatal(err)
	}
	key := rdma.IncKey(fr.LKey())
	pr.cli.postRetry(t, rdma.SendWR{ID: 1000, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: fr, Key: key, Access: rw})
	pr.cli.expect(t, 1000, rdma.WCRegMR, rdma.WCSuccess)
	if !fr.Valid() || fr.RKey() != key || fr.Addr() != 0x5000000 {
		t.Fatalf("after REG_MR: valid %v key %#x addr %#x", fr.Valid(), fr.RKey(), fr.Addr())
	}
	pr.cli.post(t, rdma.SendWR{ID: 1001, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: key})
	pr.cli.expect(t, 1001, rdma.WCLocalInv, rdma.WCSuccess)
	if fr.Valid() {
		t.Fatal("MR valid after LOCAL_INV")
	}
	pr.cli.noCompletion(t)
}

func TestQueueLimitsAndBadRequests(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	src := pr.cli.reg(t, 64, lw)
	wrs := make([]rdma.SendWR, testQD+1)
	for i := range wrs {
		// Sends with no receive posted: they stay outstanding (RNR, wait for ever).
		wrs[i] = rdma.SendWR{ID: uint64(i), Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}}
	}
	bad, err := pr.cli.qp.PostSend(wrs)
	if !errors.Is(err, syscall.ENOMEM) || bad != testQD {
		t.Fatalf("overfull send queue: bad %d err %v", bad, err)
	}
	recvs := make([]rdma.RecvWR, testQD+1)
	if bad, err := pr.srv.qp.PostRecv(recvs[:0]); err != nil || bad != 0 {
		t.Fatal(bad, err)
	}
	if _, err := pr.cli.qp.PostSend([]rdma.SendWR{{Opcode: rdma.Opcode(99)}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("unknown opcode: %v", err)
	}
	if _, err := pr.cli.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpSend, SGList: make([]rdma.SGE, 5)}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("too many SGEs: %v", err)
	}
	if _, err := pr.cli.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpRegMR}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("REG_MR without MR: %v", err)
	}
}

// TestLocalProtection checks SGEs against the poster's own memory: a wrong lkey, memory of
// another PD, out of bounds.
func TestLocalProtection(t *testing.T) {
	for _, tc := range []struct {
		name string
		sge  func(pr *pair, m rdma.MR) rdma.SGE
	}{
		{"bad lkey", func(_ *pair, m rdma.MR) rdma.SGE { return rdma.SGE{Addr: m.Addr(), Length: 8, LKey: m.LKey() ^ 0x100} }},
		{"stale lkey", func(_ *pair, m rdma.MR) rdma.SGE { return rdma.SGE{Addr: m.Addr(), Length: 8, LKey: m.LKey() + 1} }},
		{"other PD", func(pr *pair, _ rdma.MR) rdma.SGE {
			other := pr.srv.reg(t, 64, lw)
			return rdma.SGEOf(other, 0, 8)
		}},
		{"past the end", func(_ *pair, m rdma.MR) rdma.SGE { return rdma.SGEOf(m, 60, 8) }},
		{"before the start", func(_ *pair, m rdma.MR) rdma.SGE { return rdma.SGE{Addr: m.Addr() - 1, Length: 8, LKey: m.LKey()} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakcheck.Check(t)
			pr := newPair(t, New(Options{}))
			m := pr.cli.reg(t, 64, lw)
			dst := pr.srv.reg(t, 64, rw)
			pr.srv.recv(t, 1, dst, 0, 64)
			pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSend, SGList: []rdma.SGE{tc.sge(pr, m)}})
			pr.cli.expect(t, 1, rdma.WCSend, rdma.WCLocProtErr)
			// The QP is dead; the peer's receive is flushed when the connection goes.
			pr.srv.expect(t, 1, rdma.WCRecv, rdma.WCFlushErr)
			pr.cli.expectEvent(t, rdma.EventDisconnected)
			pr.srv.expectEvent(t, rdma.EventDisconnected)
		})
	}
}

func TestMRValidation(t *testing.T) {
	p := New(Options{})
	dev, err := p.OpenDevice("soft_lo")
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	if _, err := pd.RegMR(nil, lw); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("empty MR: %v", err)
	}
	if _, err := pd.RegMR(make([]byte, 8), rdma.AccessRemoteWrite); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("remote write without local write: %v", err)
	}
	if _, err := pd.RegMR(make([]byte, 8), 1<<7); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("unknown access bit: %v", err)
	}
	fr, err := pd.AllocFastRegMR(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := fr.Map(make([]byte, 8192), 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("map over max length: %v", err)
	}
	m, _ := pd.RegMR(make([]byte, 8), lw)
	if err := m.Map(make([]byte, 8), 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("map of a valid MR: %v", err)
	}
	// Invalidated, a registered MR still keeps its memory: only fast-reg MRs map memory.
	if !invalidateKey(dev, pd, m.LKey()) {
		t.Fatal("LOCAL_INV refused")
	}
	if m.Valid() {
		t.Fatal("valid after LOCAL_INV")
	}
	if err := m.Map(make([]byte, 8), 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("map of a registered MR: %v", err)
	}
	if fr.Valid() {
		t.Fatal("a new fast-reg MR is valid before its REG_MR")
	}
	if err := m.Dereg(); err != nil {
		t.Fatal(err)
	}
	if err := m.Dereg(); !errors.Is(err, rdma.ErrClosed) {
		t.Fatalf("double dereg: %v", err)
	}
	// A reused key index comes back with a new key byte.
	m2, _ := pd.RegMR(make([]byte, 8), lw)
	if m2.LKey()>>8 == m.LKey()>>8 && m2.LKey() == m.LKey() {
		t.Fatalf("key %#x reused after dereg", m2.LKey())
	}
	if _, err := p.OpenDevice("mlx5_0"); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("foreign device name: %v", err)
	}
	if rdma.IncKey(0x123456ff) != 0x12345600 || rdma.IncKey(0x10) != 0x11 {
		t.Fatal("IncKey")
	}
}

// TestCompletionHandler drives a ping-pong entirely from completion handlers: the server's
// handler echoes every message, the client's sends the next one, both posting from inside the
// handler; the calls for one queue never overlap.
func TestCompletionHandler(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	const rounds = 2000
	sbuf, cbuf := pr.srv.reg(t, 64, lw), pr.cli.reg(t, 64, lw)
	var overlaps atomic.Int32
	handler := func(e end, buf rdma.MR, onRecv func(rdma.WC)) func() {
		var wc [8]rdma.WC
		var inside atomic.Int32 // per queue
		return func() {
			if inside.Add(1) > 1 {
				overlaps.Add(1)
			}
			defer inside.Add(-1)
			for n := e.cq.Poll(wc[:]); n > 0; n = e.cq.Poll(wc[:]) {
				for _, w := range wc[:n] {
					if w.Status != rdma.WCSuccess {
						t.Errorf("completion %+v", w)
						return
					}
					if w.Opcode == rdma.WCRecv {
						onRecv(w)
					}
				}
			}
		}
	}
	post := func(e end, buf rdma.MR, imm uint32) {
		if _, err := e.qp.PostRecv([]rdma.RecvWR{{SGList: []rdma.SGE{rdma.SGEOf(buf, 0, 64)}}}); err != nil {
			t.Error(err)
		}
		if _, err := e.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpSendWithImm, Imm: imm, SGList: []rdma.SGE{rdma.SGEOf(buf, 0, 64)}}}); err != nil {
			t.Error(err)
		}
	}
	pr.srv.recv(t, 0, sbuf, 0, 64)
	pr.srv.cq.SetHandler(handler(pr.srv, sbuf, func(w rdma.WC) { post(pr.srv, sbuf, w.Imm) }))
	done := make(chan uint32, 1)
	next := uint32(0)
	pr.cli.cq.SetHandler(handler(pr.cli, cbuf, func(w rdma.WC) {
		if w.Imm != next {
			t.Errorf("echo %d, want %d", w.Imm, next)
		}
		if next++; next == rounds {
			done <- next
			return
		}
		if _, err := pr.cli.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpSendWithImm, Imm: next, SGList: []rdma.SGE{rdma.SGEOf(cbuf, 0, 64)}}}); err != nil {
			t.Error(err)
		}
		if _, err := pr.cli.qp.PostRecv([]rdma.RecvWR{{SGList: []rdma.SGE{rdma.SGEOf(cbuf, 0, 64)}}}); err != nil {
			t.Error(err)
		}
	}))
	post(pr.cli, cbuf, 0)
	select {
	case n := <-done:
		if n != rounds {
			t.Fatalf("%d rounds", n)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("stuck after %d rounds", next)
	}
	if overlaps.Load() != 0 {
		t.Fatalf("handler calls overlapped %d times", overlaps.Load())
	}
	pr.srv.cq.SetHandler(nil)
	pr.cli.cq.SetHandler(nil)
}

// invalidateKey runs what a LOCAL_INV work request does.
func invalidateKey(dev rdma.Device, p rdma.PD, key uint32) bool {
	return dev.(*device).invalidate(p.(*pd), key, false)
}
