package soft

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/internal/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// TestRemoteAccessViolations: every way a peer can name memory it was not granted ends in a
// remote access error at the requester, the QP in error on both sides, the other outstanding
// requests flushed on both sides, a disconnect event on both, and the memory untouched.
func TestRemoteAccessViolations(t *testing.T) {
	type target struct {
		rkey uint32
		addr uint64
	}
	for _, tc := range []struct {
		name   string
		op     rdma.Opcode
		access rdma.Access
		prep   func(t *testing.T, pr *pair, m rdma.MR) target
	}{
		{"write after LOCAL_INV", rdma.OpRDMAWrite, rw, func(t *testing.T, pr *pair, m rdma.MR) target {
			tg := target{m.RKey(), m.Addr()}
			pr.srv.post(t, rdma.SendWR{ID: 99, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: m.RKey()})
			pr.srv.expect(t, 99, rdma.WCLocalInv, rdma.WCSuccess)
			return tg
		}},
		{"read after LOCAL_INV", rdma.OpRDMARead, all, func(t *testing.T, pr *pair, m rdma.MR) target {
			tg := target{m.RKey(), m.Addr()}
			pr.srv.post(t, rdma.SendWR{ID: 99, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: m.RKey()})
			pr.srv.expect(t, 99, rdma.WCLocalInv, rdma.WCSuccess)
			return tg
		}},
		{"write with the key before re-registration", rdma.OpRDMAWrite, rw, func(t *testing.T, pr *pair, m rdma.MR) target {
			old := target{m.RKey(), m.Addr()}
			pr.srv.post(t, rdma.SendWR{ID: 98, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: m.RKey()})
			pr.srv.expect(t, 98, rdma.WCLocalInv, rdma.WCSuccess)
			pr.srv.post(t, rdma.SendWR{ID: 99, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: m, Key: rdma.IncKey(m.RKey()), Access: rw})
			pr.srv.expect(t, 99, rdma.WCRegMR, rdma.WCSuccess)
			if !m.Valid() || m.RKey() == old.rkey || m.RKey()>>8 != old.rkey>>8 {
				t.Fatalf("re-registered key %#x from %#x", m.RKey(), old.rkey)
			}
			// The new key works...
			src := pr.cli.reg(t, 16, lw)
			pr.cli.post(t, rdma.SendWR{ID: 50, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
				SGList: []rdma.SGE{rdma.SGEOf(src, 0, 16)}, RemoteAddr: m.Addr(), RKey: m.RKey()})
			pr.cli.expect(t, 50, rdma.WCRDMAWrite, rdma.WCSuccess)
			pr.sync(t)
			clear(m.Bytes())
			// ...and the old one does not.
			return old
		}},
		{"write past the end", rdma.OpRDMAWrite, rw, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey(), m.Addr() + uint64(m.Len()) - 8}
		}},
		{"write before the start", rdma.OpRDMAWrite, rw, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey(), m.Addr() - 8}
		}},
		{"read past the end", rdma.OpRDMARead, all, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey(), m.Addr() + uint64(m.Len()) - 8}
		}},
		{"write without REMOTE_WRITE", rdma.OpRDMAWrite, lw | rr, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey(), m.Addr()}
		}},
		{"read without REMOTE_READ", rdma.OpRDMARead, rw, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey(), m.Addr()}
		}},
		{"unknown key", rdma.OpRDMAWrite, rw, func(_ *testing.T, _ *pair, m rdma.MR) target {
			return target{m.RKey() + 0x10000, m.Addr()}
		}},
		{"deregistered region", rdma.OpRDMAWrite, rw, func(t *testing.T, _ *pair, m rdma.MR) target {
			tg := target{m.RKey(), m.Addr()}
			if err := m.Dereg(); err != nil {
				t.Fatal(err)
			}
			return tg
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakcheck.Check(t)
			pr := newPair(t, New(Options{}))
			victim := pr.srv.reg(t, 4096, tc.access)
			secret := bytes.Repeat([]byte{0x5a}, 4096)
			copy(victim.Bytes(), secret)
			tg := tc.prep(t, pr, victim)
			if tc.name == "write with the key before re-registration" {
				copy(victim.Bytes(), secret)
			}
			local := pr.cli.reg(t, 4096, lw)
			fill(local.Bytes(), 1)
			// Outstanding work on both sides that the failure must flush.
			pr.srv.recv(t, 11, nil, 0, 0)
			pr.cli.recv(t, 12, nil, 0, 0)
			pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: tc.op, Flags: rdma.SendSignaled,
				SGList: []rdma.SGE{rdma.SGEOf(local, 0, 16)}, RemoteAddr: tg.addr, RKey: tg.rkey})
			pr.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 8)}})
			// Send and receive queues share the CQ; their relative order is not defined.
			pr.cli.expectSet(t, map[uint64]rdma.WCStatus{1: rdma.WCRemAccessErr, 2: rdma.WCFlushErr, 12: rdma.WCFlushErr})
			pr.srv.expectSet(t, map[uint64]rdma.WCStatus{11: rdma.WCFlushErr})
			pr.cli.expectEvent(t, rdma.EventDisconnected)
			pr.srv.expectEvent(t, rdma.EventDisconnected)
			if pr.cli.qp.State() != rdma.QPSErr || pr.srv.qp.State() != rdma.QPSErr {
				t.Fatalf("states %v %v", pr.cli.qp.State(), pr.srv.qp.State())
			}
			if tc.name != "deregistered region" && !bytes.Equal(victim.Bytes(), secret) {
				t.Fatal("the victim region changed")
			}
			if tc.op == rdma.OpRDMARead && bytes.Contains(local.Bytes(), []byte{0x5a, 0x5a}) {
				t.Fatal("refused read leaked data")
			}
			// Posting to a dead QP flushes.
			pr.cli.post(t, rdma.SendWR{ID: 3, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 8)}})
			pr.cli.expect(t, 3, rdma.WCSend, rdma.WCFlushErr)
		})
	}
}

// TestRNR: a SEND finding no receive waits for one with rnr retry 7, and fails the requester
// with RNR_RETRY_EXC_ERR after the retries with a finite count.
func TestRNR(t *testing.T) {
	t.Run("wait for ever", func(t *testing.T) {
		leakcheck.Check(t)
		pr := newPair(t, New(Options{RNRTimer: time.Millisecond}))
		src := pr.cli.reg(t, 64, lw)
		dst := pr.srv.reg(t, 64, lw)
		fill(src.Bytes(), 4)
		pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}})
		pr.cli.noCompletion(t)
		pr.srv.noCompletion(t)
		pr.srv.recv(t, 9, dst, 0, 64)
		pr.srv.expect(t, 9, rdma.WCRecv, rdma.WCSuccess)
		pr.cli.expect(t, 1, rdma.WCSend, rdma.WCSuccess)
		if !bytes.Equal(src.Bytes(), dst.Bytes()) {
			t.Fatal("payload after RNR wait")
		}
	})
	t.Run("retry exceeded", func(t *testing.T) {
		leakcheck.Check(t)
		p := New(Options{RNRTimer: 5 * time.Millisecond})
		// The server's accept says how often the client's sends are retried.
		pr := connect(t, p, &pair{cliRNR: 7, srvRNR: 2}, "", "127.0.0.1:0")
		src := pr.cli.reg(t, 64, lw)
		pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}})
		pr.cli.expect(t, 1, rdma.WCSend, rdma.WCRNRRetryExcErr)
		pr.cli.expectEvent(t, rdma.EventDisconnected)
		pr.srv.expectEvent(t, rdma.EventDisconnected)
	})
}

// TestDisconnectFlushes: an orderly disconnect from either side flushes every outstanding
// request on both sides and reports DISCONNECTED on both.
func TestDisconnectFlushes(t *testing.T) {
	for _, side := range []string{"client", "server"} {
		t.Run(side, func(t *testing.T) {
			leakcheck.Check(t)
			pr := newPair(t, New(Options{}))
			src := pr.cli.reg(t, 64, lw)
			rbuf := pr.srv.reg(t, 64, lw)
			for i := uint64(0); i < 5; i++ {
				pr.cli.recv(t, 100+i, nil, 0, 0)
				pr.srv.recv(t, 200+i, rbuf, 0, 64)
			}
			// A SEND in flight while the disconnect happens.
			pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}})
			e := pr.cli
			if side == "server" {
				e = pr.srv
			}
			if err := e.id.Disconnect(); err != nil {
				t.Fatal(err)
			}
			// Every request completes once. The SEND may have been delivered (receive 200
			// succeeds) and still be flushed at the requester, whose ack the disconnect beat,
			// as on IB; but a successful SEND implies its receive succeeded.
			got := map[uint64]rdma.WCStatus{}
			deadline := time.Now().Add(5 * time.Second)
			for len(got) < 11 && time.Now().Before(deadline) {
				var wc [16]rdma.WC
				for _, c := range []rdma.CQ{pr.cli.cq, pr.srv.cq} {
					n := c.Poll(wc[:])
					for _, w := range wc[:n] {
						if _, dup := got[w.ID]; dup {
							t.Fatalf("request %d completed twice", w.ID)
						}
						got[w.ID] = w.Status
					}
				}
				time.Sleep(5 * time.Millisecond)
			}
			if len(got) != 11 {
				t.Fatalf("%d of 11 requests completed: %v", len(got), got)
			}
			for id, st := range got {
				ok := st == rdma.WCFlushErr || (st == rdma.WCSuccess && (id == 1 || id == 200))
				if !ok {
					t.Fatalf("request %d completed %v", id, st)
				}
			}
			if got[1] == rdma.WCSuccess && got[200] != rdma.WCSuccess {
				t.Fatalf("send %v but its receive %v", got[1], got[200])
			}
			pr.cli.expectEvent(t, rdma.EventDisconnected)
			pr.srv.expectEvent(t, rdma.EventDisconnected)
			// Posting after the disconnect flushes at once.
			pr.srv.recv(t, 300, nil, 0, 0)
			pr.srv.expect(t, 300, rdma.WCRecv, rdma.WCFlushErr)
		})
	}
}

// TestPeerDies: a connection that dies under the QP (process gone: the socket closes without a
// DISCONNECT) flushes everything and reports DISCONNECTED with the cause.
func TestPeerDies(t *testing.T) {
	leakcheck.Check(t)
	pr := newPair(t, New(Options{}))
	remote := pr.srv.reg(t, 1<<20, rr)
	local := pr.cli.reg(t, 1<<20, lw)
	pr.cli.recv(t, 5, nil, 0, 0)
	// Abruptly close the server's socket, as a killed process would.
	pr.srv.qp.(*qp).conn.Close()
	for i := uint64(0); i < 4; i++ {
		_, _ = pr.cli.qp.PostSend([]rdma.SendWR{{ID: i, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
			SGList: []rdma.SGE{rdma.SGEOf(local, 0, 1<<20)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()}})
	}
	seen := map[uint64]bool{}
	for len(seen) < 5 {
		wc := pr.cli.wait(t)
		if wc.Status != rdma.WCFlushErr {
			t.Fatalf("completion %+v after the peer died", wc)
		}
		seen[wc.ID] = true
	}
	ev := pr.cli.expectEvent(t, rdma.EventDisconnected)
	if ev.Err == nil {
		t.Fatal("no cause on a failed connection")
	}
}

// TestManyQPsInParallel runs 16 connections at once, each moving its own data both ways with
// every data opcode, and checks every byte.
func TestManyQPsInParallel(t *testing.T) {
	leakcheck.Check(t)
	p := New(Options{})
	const n = 16
	pairs := make([]*pair, n)
	for i := range pairs {
		pairs[i] = newPair(t, p)
	}
	errs := make(chan error, n)
	for i, pr := range pairs {
		go func() { errs <- exercise(pr, byte(i)) }()
	}
	for range pairs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// exercise writes, reads back, and sends through one pair, 50 rounds.
func exercise(pr *pair, seed byte) error {
	cli, srv := pr.cli, pr.srv
	src, _ := cli.pd.AllocMR(64<<10, lw)
	back, _ := cli.pd.AllocMR(64<<10, lw)
	mem, _ := srv.pd.AllocMR(64<<10, all)
	rbuf, _ := srv.pd.AllocMR(64<<10, lw)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	next := func(e end) (rdma.WC, error) {
		var wc [1]rdma.WC
		for e.cq.Poll(wc[:]) == 0 {
			if err := e.cq.Wait(ctx); err != nil {
				return wc[0], err
			}
		}
		if wc[0].Status != rdma.WCSuccess {
			return wc[0], errors.New(wc[0].Status.String())
		}
		return wc[0], nil
	}
	for round := 0; round < 50; round++ {
		sz := 1 + (round*4099)%(64<<10)
		fill(src.Bytes()[:sz], seed+byte(round))
		if _, err := srv.qp.PostRecv([]rdma.RecvWR{{ID: 1}, {ID: 2, SGList: []rdma.SGE{rdma.SGEOf(rbuf, 0, 64<<10)}}}); err != nil {
			return err
		}
		if _, err := cli.qp.PostSend([]rdma.SendWR{
			{ID: 1, Opcode: rdma.OpRDMAWriteWithImm, Imm: uint32(round), SGList: []rdma.SGE{rdma.SGEOf(src, 0, sz)}, RemoteAddr: mem.Addr(), RKey: mem.RKey()},
			{ID: 2, Opcode: rdma.OpRDMARead, SGList: []rdma.SGE{rdma.SGEOf(back, 0, sz)}, RemoteAddr: mem.Addr(), RKey: mem.RKey()},
			{ID: 3, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, sz)}},
		}); err != nil {
			return err
		}
		if wc, err := next(srv); err != nil || wc.ID != 1 || wc.Imm != uint32(round) {
			return errors.Join(err, errors.New("write-with-imm completion"))
		}
		if !bytes.Equal(mem.Bytes()[:sz], src.Bytes()[:sz]) {
			return errors.New("written data differs")
		}
		if wc, err := next(srv); err != nil || wc.ID != 2 || int(wc.ByteLen) != sz {
			return errors.Join(err, errors.New("send completion"))
		}
		if !bytes.Equal(rbuf.Bytes()[:sz], src.Bytes()[:sz]) {
			return errors.New("sent data differs")
		}
		if wc, err := next(cli); err != nil || wc.ID != 3 {
			var ev rdma.CMEvent
			select {
			case ev = <-cli.id.Events():
			case ev = <-srv.id.Events():
			case <-time.After(time.Second):
			}
			return errors.Join(err, fmt.Errorf("client completion %+v, event %v %v", wc, ev.Type, ev.Err))
		}
		if !bytes.Equal(back.Bytes()[:sz], src.Bytes()[:sz]) {
			return errors.New("read-back data differs")
		}
	}
	return nil
}

func TestConnectOutcomes(t *testing.T) {
	leakcheck.Check(t)
	p := New(Options{})
	ctx := ctxT(t, 10*time.Second)
	mk := func(dst netip.AddrPort) rdma.ConnID {
		id, err := p.ResolveAddr(ctx, netip.Addr{}, dst)
		if err != nil {
			t.Fatal(err)
		}
		dev := id.Device()
		pd, _ := dev.AllocPD()
		cq, _ := dev.CreateCQ(16)
		t.Cleanup(func() { _ = cq.Destroy() })
		if _, err := id.CreateQP(pd, qpAttr(cq)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = id.Destroy() })
		return id
	}

	// Nothing listening: a reject without private data.
	tmp, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := tmp.Addr().(*net.TCPAddr).AddrPort()
	_ = tmp.Close()
	_, err := mk(closed).Connect(ctx, rdma.ConnParam{})
	if r, ok := rdma.IsReject(err); !ok || !r.NoListener || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect to a closed port: %v", err)
	}

	// A consumer-defined reject carries the rejecting side's private data.
	ln, err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0"), 4)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		req, err := ln.Accept(ctx)
		if err != nil {
			return
		}
		if !bytes.Equal(req.PrivateData, bytes.Repeat([]byte{7}, rdma.MaxPrivateData)) {
			_ = req.ID.Reject([]byte("bad private data"))
			return
		}
		rsp := make([]byte, 56)
		rsp[4], rsp[5] = 0xef, 0xff // -17 (EEXIST) as RTRS's conn_rsp carries it
		_ = req.ID.Reject(rsp)
	}()
	id := mk(ln.Addr())
	_, err = id.Connect(ctx, rdma.ConnParam{PrivateData: bytes.Repeat([]byte{7}, rdma.MaxPrivateData)})
	r, ok := rdma.IsReject(err)
	if !ok || len(r.PrivateData) != 56 || r.PrivateData[4] != 0xef {
		t.Fatalf("reject: %v", err)
	}
	// Too much private data is refused before anything is sent.
	if _, err := mk(ln.Addr()).Connect(ctx, rdma.ConnParam{PrivateData: make([]byte, rdma.MaxPrivateData+1)}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("oversized private data: %v", err)
	}
	// Connect twice on one identifier.
	if _, err := id.Connect(ctx, rdma.ConnParam{}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("second connect: %v", err)
	}

	// A listener that never answers: the connector's deadline ends it.
	silent, _ := p.Listen(netip.MustParseAddrPort("127.0.0.1:0"), 4)
	defer silent.Close()
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := mk(silent.Addr()).Connect(sctx, rdma.ConnParam{}); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("unanswered connect: %v", err)
	}

	// Address resolution: a non-local source, mixed families, no destination.
	if _, err := p.ResolveAddr(ctx, netip.MustParseAddr("192.0.2.1"), netip.MustParseAddrPort("127.0.0.1:1")); !errors.Is(err, syscall.EHOSTUNREACH) {
		t.Fatalf("non-local source: %v", err)
	}
	if _, err := p.ResolveAddr(ctx, netip.MustParseAddr("::1"), netip.MustParseAddrPort("127.0.0.1:1")); !errors.Is(err, syscall.EHOSTUNREACH) {
		t.Fatalf("mixed families: %v", err)
	}
	if _, err := p.ResolveAddr(ctx, netip.Addr{}, netip.AddrPort{}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("no destination: %v", err)
	}
}

// TestSourceAddressAndIPv6: the source address given to ResolveAddr is the one the peer sees,
// and IPv6 works the same.
func TestSourceAddressAndIPv6(t *testing.T) {
	leakcheck.Check(t)
	p := New(Options{})
	pr := connect(t, p, &pair{cliRNR: 7, srvRNR: 7}, "127.0.0.2", "127.0.0.1:0")
	if got := pr.srv.id.RemoteAddr().Addr(); got != netip.MustParseAddr("127.0.0.2") {
		t.Fatalf("server sees the client as %v", got)
	}
	if pr.cli.dev.Name() != "soft_lo" {
		t.Fatalf("127.0.0.2 resolved to %s", pr.cli.dev.Name())
	}
	if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Logf("no IPv6 loopback here (%v); IPv6 part skipped", err)
		return
	} else {
		_ = ln.Close()
	}
	pr6 := connect(t, p, &pair{cliRNR: 7, srvRNR: 7}, "::1", "[::1]:0")
	if got := pr6.srv.id.RemoteAddr().Addr(); got != netip.MustParseAddr("::1") {
		t.Fatalf("server sees the client as %v", got)
	}
	src := pr6.cli.reg(t, 100, lw)
	dst := pr6.srv.reg(t, 100, rw)
	fill(src.Bytes(), 42)
	pr6.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 100)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	pr6.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
	pr6.sync(t)
	if !bytes.Equal(src.Bytes(), dst.Bytes()) {
		t.Fatal("IPv6 write")
	}
	// A dual-stack listener on [::] takes IPv4 connectors too.
	prd := connect(t, p, &pair{cliRNR: 7, srvRNR: 7}, "", "[::]:0")
	_ = prd
}

// TestDestroyDuringAccept destroys the server's identifier while its Accept (and the client's
// Connect) may still be running: whichever comes first, no goroutine of the QP outlives the
// test and the race detector sees the QP started either before Destroy or not at all.
func TestDestroyDuringAccept(t *testing.T) {
	leakcheck.Check(t)
	p := New(Options{})
	ln, err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0"), 16)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for i := range 30 {
		ctx := ctxT(t, 10*time.Second)
		id, err := p.ResolveAddr(ctx, netip.Addr{}, ln.Addr())
		if err != nil {
			t.Fatal(err)
		}
		cpd, _ := id.Device().AllocPD()
		ccq, _ := id.Device().CreateCQ(16)
		if _, err := id.CreateQP(cpd, qpAttr(ccq)); err != nil {
			t.Fatal(err)
		}
		connected := make(chan struct{})
		go func() {
			defer close(connected)
			_, _ = id.Connect(ctx, rdma.ConnParam{})
		}()
		req, err := ln.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		spd, _ := req.ID.Device().AllocPD()
		scq, _ := req.ID.Device().CreateCQ(16)
		if _, err := req.ID.CreateQP(spd, qpAttr(scq)); err != nil {
			t.Fatal(err)
		}
		accepted := make(chan struct{})
		go func() {
			defer close(accepted)
			_ = req.ID.Accept(ctx, rdma.ConnParam{})
		}()
		time.Sleep(time.Duration(i%6) * 100 * time.Microsecond)
		_ = req.ID.Destroy()
		<-accepted
		<-connected
		_ = id.Destroy()
		_ = ccq.Destroy()
		_ = scq.Destroy()
	}
}
