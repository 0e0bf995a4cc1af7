package soft

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/sockread"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// acceptOne accepts one connection on a fresh listener, with a QP of testQD, and returns the
// server end and the listener's address.
func acceptOne(t *testing.T, p *Provider) (<-chan *end, netip.AddrPort) {
	t.Helper()
	ln, err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0"), 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	out := make(chan *end, 1)
	go func() {
		ctx := ctxT(t, 10*time.Second)
		req, err := ln.Accept(ctx)
		if err != nil {
			close(out)
			return
		}
		e := &end{id: req.ID, dev: req.ID.Device()}
		e.pd, _ = e.dev.AllocPD()
		e.cq, _ = e.dev.CreateCQ(4 * testQD)
		if e.qp, err = req.ID.CreateQP(e.pd, qpAttr(e.cq)); err != nil || req.ID.Accept(ctx, rdma.ConnParam{RNRRetryCount: 7}) != nil {
			close(out)
			return
		}
		t.Cleanup(func() { _ = e.id.Destroy(); _ = e.cq.Destroy() })
		out <- e
	}()
	return out, ln.Addr()
}

// rawConnect connects to a soft listener with hand-made CM frames, as a hostile peer would.
func rawConnect(t *testing.T, to netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(to))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := writeCM(c, fConnReq, []byte("x")); err != nil {
		t.Fatal(err)
	}
	h, _, err := readCM(sockread.New(c, hdrLen+rdma.MaxPrivateData))
	if err != nil || h.op != fConnAcc {
		t.Fatalf("answer %v: %v", h.op, err)
	}
	if err := writeCM(c, fConnRTU, nil); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Time{})
	return c
}

// A peer that sends zero-length READ requests and never reads its socket gets its QP failed
// once it holds more READ responses than the responder resources, instead of making the
// responder queue responses without bound.
func TestReadFloodBounded(t *testing.T) {
	p := New(Options{})
	srv, addr := acceptOne(t, p)
	c := rawConnect(t, addr)
	_ = c.SetReadBuffer(4096)
	s := <-srv
	if s == nil {
		t.Fatal("server did not accept")
	}
	sq := s.qp.(*qp)
	// A healthy pair on the same provider moves verified data all through the flood.
	healthy := verifiedTraffic(t, p)
	var b [hdrLen]byte
	batch := make([]byte, 0, 512*hdrLen)
	sent := 0
	_ = c.SetWriteDeadline(time.Now().Add(20 * time.Second))
	var werr error
	for seq := uint64(1); werr == nil && seq < 20_000_000; {
		batch = batch[:0]
		for range 512 {
			(&frameHdr{op: fReadReq, seq: seq}).encode(b[:])
			batch = append(batch, b[:]...)
			seq++
		}
		_, werr = c.Write(batch)
		sent += 512
		if n := sq.w.rsp.Load(); n > maxRdAtomic {
			t.Fatalf("%d READ responses queued, responder resources are %d", n, maxRdAtomic)
		}
	}
	// The responder failed the QP: the disconnect is reported, and the frames it
	// would have queued were never made.
	ev := s.expectEvent(t, rdma.EventDisconnected)
	if ev.Err == nil {
		t.Fatal("the flood ended as an orderly disconnect")
	}
	if n := sq.w.rsp.Load(); n > maxRdAtomic {
		t.Fatalf("%d READ responses queued after the failure", n)
	}
	t.Logf("flood of %d READ requests ended by the responder: %v", sent, ev.Err)
	if n, err := healthy(); err != nil || n == 0 {
		t.Fatalf("the healthy pair beside the flood: %d rounds, %v", n, err)
	}
}

// verifiedTraffic starts a pair on p that writes patterns and reads them back, checking each,
// until the returned function is called; that stops it and reports the rounds done and the
// first error.
func verifiedTraffic(t *testing.T, p *Provider) func() (int, error) {
	t.Helper()
	pr := newPair(t, p)
	remote := pr.srv.reg(t, 64<<10, rdma.AccessLocalWrite|rdma.AccessRemoteWrite|rdma.AccessRemoteRead)
	out := pr.cli.reg(t, 64<<10, rdma.AccessLocalWrite)
	back := pr.cli.reg(t, 64<<10, rdma.AccessLocalWrite)
	stop := make(chan struct{})
	type result struct {
		n   int
		err error
	}
	res := make(chan result, 1)
	go func() {
		var wc [4]rdma.WC
		ctx := context.Background()
		next := func() (rdma.WC, error) {
			for {
				if pr.cli.cq.Poll(wc[:1]) == 1 {
					return wc[0], nil
				}
				wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				err := pr.cli.cq.Wait(wctx)
				cancel()
				if err != nil {
					return rdma.WC{}, err
				}
			}
		}
		for n := 0; ; n++ {
			select {
			case <-stop:
				res <- result{n, nil}
				return
			default:
			}
			fill(out.Bytes(), byte(n))
			wrs := []rdma.SendWR{
				{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(out, 0, 64<<10)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()},
				{ID: 2, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(back, 0, 64<<10)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()},
			}
			if _, err := pr.cli.qp.PostSend(wrs); err != nil {
				res <- result{n, err}
				return
			}
			for range 2 {
				w, err := next()
				if err == nil && w.Status != rdma.WCSuccess {
					err = fmt.Errorf("completion %d: %v", w.ID, w.Status)
				}
				if err != nil {
					res <- result{n, err}
					return
				}
			}
			if !bytes.Equal(back.Bytes(), out.Bytes()) {
				res <- result{n, fmt.Errorf("round %d: read back other data", n)}
				return
			}
		}
	}()
	return func() (int, error) {
		close(stop)
		r := <-res
		return r.n, r.err
	}
}

// A requester keeps at most its READ depth on the wire; what is posted behind waits in order
// and every request completes.
func TestInitiatorDepth(t *testing.T) {
	p := New(Options{})
	pr := connect(t, p, &pair{cliRNR: 7, srvRNR: 7, beforeConn: func(e *end) { e.qp.(*qp).rdDepth = 4 }}, "", "127.0.0.1:0")
	const n = 24
	remote := pr.srv.reg(t, n*256, rdma.AccessLocalWrite|rdma.AccessRemoteRead|rdma.AccessRemoteWrite)
	fill(remote.Bytes(), 3)
	local := pr.cli.reg(t, n*256, rdma.AccessLocalWrite)
	src := pr.cli.reg(t, 64, rdma.AccessLocalWrite)
	fill(src.Bytes(), 9)
	var wrs []rdma.SendWR
	for i := range n {
		wrs = append(wrs, rdma.SendWR{ID: uint64(i), Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
			SGList: []rdma.SGE{rdma.SGEOf(local, i*256, 128)}, RemoteAddr: remote.Addr() + uint64(i*256), RKey: remote.RKey()})
		// A WRITE behind each READ waits with it and completes after it.
		wrs = append(wrs, rdma.SendWR{ID: uint64(100 + i), Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
			SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}, RemoteAddr: remote.Addr() + uint64(i*256+128), RKey: remote.RKey()})
	}
	cq := pr.cli.qp.(*qp)
	if _, err := pr.cli.qp.PostSend(wrs); err != nil {
		t.Fatal(err)
	}
	cq.mu.Lock()
	held, out := len(cq.held), cq.rdOut
	cq.mu.Unlock()
	if out > 4 {
		t.Fatalf("%d READs on the wire, depth 4", out)
	}
	if held == 0 {
		t.Log("every request went out before the post returned (responses were fast)")
	}
	for i := range wrs {
		want := wrs[i]
		op := rdma.WCRDMARead
		if want.Opcode == rdma.OpRDMAWrite {
			op = rdma.WCRDMAWrite
		}
		pr.cli.expect(t, want.ID, op, rdma.WCSuccess)
	}
	for i := range n {
		if !bytes.Equal(local.Bytes()[i*256:i*256+128], remote.Bytes()[i*256:i*256+128]) {
			t.Fatalf("read %d placed the wrong data", i)
		}
		if !bytes.Equal(remote.Bytes()[i*256+128:i*256+192], src.Bytes()) {
			t.Fatalf("write %d did not land", i)
		}
	}
}

// A remote access error reaches the requester as such even when the refused WRITE's payload
// and more requests behind it are still unread in the responder's socket.
func TestTerminateBehindPayload(t *testing.T) {
	for round := range 5 {
		p := New(Options{})
		pr := newPair(t, p)
		local := pr.cli.reg(t, 1<<20, rdma.AccessLocalWrite)
		ro := pr.srv.reg(t, 1<<20, rdma.AccessLocalWrite|rdma.AccessRemoteRead)
		var wrs []rdma.SendWR
		wrs = append(wrs, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
			SGList: []rdma.SGE{rdma.SGEOf(local, 0, 1<<20)}, RemoteAddr: ro.Addr(), RKey: ro.RKey()})
		for i := range 8 {
			wrs = append(wrs, rdma.SendWR{ID: uint64(2 + i), Opcode: rdma.OpRDMAWrite,
				SGList: []rdma.SGE{rdma.SGEOf(local, 0, 1<<20)}, RemoteAddr: ro.Addr(), RKey: ro.RKey()})
		}
		if _, err := pr.cli.qp.PostSend(wrs); err != nil {
			t.Fatal(err)
		}
		wc := pr.cli.wait(t)
		if wc.ID != 1 || wc.Status != rdma.WCRemAccessErr {
			t.Fatalf("round %d: first completion id %d %v, want id 1 remote access error", round, wc.ID, wc.Status)
		}
	}
}

// SEND_WITH_INV invalidates only a region the peer was granted: a fast-reg region open to
// remote invalidation, registered with remote access on the QP the request comes in on.
func TestRemoteInvalidateNeedsGrant(t *testing.T) {
	cases := []struct {
		name string
		prep func(t *testing.T, e *end) uint32
	}{
		{"registered region", func(t *testing.T, e *end) uint32 {
			return e.reg(t, 4096, rdma.AccessLocalWrite|rdma.AccessRemoteWrite).RKey()
		}},
		{"fast-reg without remote invalidation", func(t *testing.T, e *end) uint32 {
			return fastReg(t, e, 0, rdma.AccessLocalWrite|rdma.AccessRemoteWrite)
		}},
		{"fast-reg with local access only", func(t *testing.T, e *end) uint32 {
			return fastReg(t, e, rdma.FastRegRemoteInv, rdma.AccessLocalWrite)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pr := newPair(t, New(Options{}))
			key := tc.prep(t, &pr.srv)
			buf := pr.srv.reg(t, 64, rdma.AccessLocalWrite)
			pr.srv.recv(t, 7, buf, 0, 64)
			local := pr.cli.reg(t, 64, rdma.AccessLocalWrite)
			pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: key,
				SGList: []rdma.SGE{rdma.SGEOf(local, 0, 8)}})
			pr.cli.expect(t, 1, rdma.WCSend, rdma.WCRemInvReqErr)
			m := pr.srv.dev.(*device).lookup(key)
			if m == nil || m.st.Load()&stValid == 0 {
				t.Fatal("the refused invalidation invalidated the region")
			}
		})
	}
}

// fastReg allocates a fast-reg region with flags and registers it with access on e's QP.
func fastReg(t *testing.T, e *end, flags rdma.FastRegFlags, access rdma.Access) uint32 {
	t.Helper()
	backing := e.reg(t, 4096, rdma.AccessLocalWrite)
	m, err := e.pd.AllocFastRegMR(4096, flags)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Map(backing.Bytes(), backing.Addr()); err != nil {
		t.Fatal(err)
	}
	key := rdma.IncKey(m.RKey())
	e.post(t, rdma.SendWR{ID: 99, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: m, Key: key, Access: access})
	e.expect(t, 99, rdma.WCRegMR, rdma.WCSuccess)
	return key
}

// Silent connections (TCP only, no connection request) hold at most the per-address bound of
// a listener's pending slots and only for the handshake timeout; a client from another
// address connects meanwhile, and one from the same address after they are dropped.
func TestSilentConnectionsBounded(t *testing.T) {
	// The timeout leaves room for the checks below on a loaded machine (at 700 ms, a run
	// beside a VM saw silent connections dropped before they were counted).
	const handshake = 3 * time.Second
	p := New(Options{MaxPending: 16, MaxPendingPerAddr: 8, HandshakeTimeout: handshake})
	ln, err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0"), 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	healthy := verifiedTraffic(t, p)
	var silent []*net.TCPConn
	for range 40 {
		c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(ln.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		silent = append(silent, c)
	}
	held := func() int {
		n := 0
		for _, c := range silent {
			_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
			var b [1]byte
			if _, err := c.Read(b[:]); err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					n++
				}
			}
		}
		return n
	}
	// Connections the listener has not reached yet wait in the kernel's backlog and look
	// held too: counted again until the listener has turned the excess away.
	deadline := time.Now().Add(handshake / 2)
	for n := held(); n != 8; n = held() {
		if time.Now().After(deadline) {
			t.Fatalf("%d silent connections held, the bound per address is 8", n)
		}
	}
	// Another address gets a slot while they are held.
	ctx := ctxT(t, 10*time.Second)
	acc := make(chan error, 1)
	go func() {
		req, err := ln.Accept(ctx)
		if err == nil {
			err = req.ID.Reject([]byte("no"))
		}
		acc <- err
	}()
	id, err := p.ResolveAddr(ctx, netip.MustParseAddr("127.0.0.2"), ln.Addr())
	if err != nil {
		t.Fatal(err)
	}
	e := end{id: id, dev: id.Device()}
	e.pd, _ = e.dev.AllocPD()
	e.cq, _ = e.dev.CreateCQ(4 * testQD)
	if e.qp, err = id.CreateQP(e.pd, qpAttr(e.cq)); err != nil {
		t.Fatal(err)
	}
	var rej *rdma.RejectError
	if _, err := id.Connect(ctx, rdma.ConnParam{}); !errors.As(err, &rej) {
		t.Fatalf("connect from another address: %v, want the listener's reject", err)
	}
	if err := <-acc; err != nil {
		t.Fatal(err)
	}
	_ = id.Destroy()
	// After the handshake timeout every silent connection is gone and the slots are back.
	time.Sleep(handshake)
	if n := held(); n != 0 {
		t.Fatalf("%d silent connections still held after the handshake timeout", n)
	}
	l := ln.(*listener)
	l.mu.Lock()
	pending := l.pending
	l.mu.Unlock()
	if pending != 0 {
		t.Fatalf("%d pending slots taken with no connection left", pending)
	}
	if n, err := healthy(); err != nil || n == 0 {
		t.Fatalf("the healthy pair beside the silent connections: %d rounds, %v", n, err)
	}
}

// The per-address bounds count an IPv6 peer by its /64.
func TestAddrGroup(t *testing.T) {
	a, b := netip.MustParseAddr("2001:db8:1:2::1"), netip.MustParseAddr("2001:db8:1:2:ffff::9")
	if rdma.AddrGroup(a) != rdma.AddrGroup(b) {
		t.Fatal("two addresses of one /64 counted apart")
	}
	if rdma.AddrGroup(a) == rdma.AddrGroup(netip.MustParseAddr("2001:db8:1:3::1")) {
		t.Fatal("two /64s counted together")
	}
	if g := rdma.AddrGroup(netip.MustParseAddr("::ffff:10.0.0.1")); g != netip.MustParseAddr("10.0.0.1") {
		t.Fatalf("an IPv4-mapped address counted as %v", g)
	}
}

// startPlacing sends, as the raw peer c, an RDMA WRITE of n bytes under key at addr with only
// its first `first` bytes, and waits until s's reader is placing it.
func startPlacing(t *testing.T, c net.Conn, s *end, key uint32, addr uint64, n, first int) {
	t.Helper()
	var hb [hdrLen]byte
	(&frameHdr{op: fWrite, seq: 1, len: uint32(n), rkey: key, addr: addr}).encode(hb[:])
	if _, err := c.Write(append(hb[:], bytes.Repeat([]byte{0xaa}, first)...)); err != nil {
		t.Fatal(err)
	}
	sq := s.qp.(*qp)
	deadline := time.Now().Add(10 * time.Second)
	for sq.placingWrite.TryLock() { // not placing yet
		sq.placingWrite.Unlock()
		if time.Now().After(deadline) {
			t.Fatal("the write's placement never began")
		}
		time.Sleep(time.Millisecond)
	}
}

// restLandsNowhere sends, as the raw peer c, the rest (n bytes) of a write startPlacing began,
// and fails the test if any of it lands in mem.
func restLandsNowhere(t *testing.T, c net.Conn, mem []byte, n int, when string) {
	t.Helper()
	before := bytes.Clone(mem)
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(bytes.Repeat([]byte{0xbb}, n))
	time.Sleep(200 * time.Millisecond)
	if !bytes.Equal(mem, before) {
		t.Fatal("the write went on landing in memory " + when)
	}
}

// TestToErrorFencesRemoteWrite: once ToError has returned, a peer's RDMA WRITE no longer
// lands in local memory, even one whose payload was being placed when it was called (as on a
// real QP moved to error). RTRS fails a dead connection's requests over to another path
// right after ToError, and the memory they are answered in must not be written by the dead
// one meanwhile. ToError also returns while the peer holds back the rest of that payload.
func TestToErrorFencesRemoteWrite(t *testing.T) {
	p := New(Options{})
	srv, addr := acceptOne(t, p)
	c := rawConnect(t, addr)
	s := <-srv
	if s == nil {
		t.Fatal("server did not accept")
	}
	const n = 64 << 10
	mr := s.reg(t, n, rdma.AccessLocalWrite|rdma.AccessRemoteWrite)
	startPlacing(t, c, s, mr.RKey(), mr.Addr(), n, 4096)
	returned := make(chan struct{})
	go func() { s.qp.ToError(); close(returned) }()
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("ToError waited for the peer to send the rest of the write")
	}
	// The rest of the payload, as a dead path's server might still send it.
	restLandsNowhere(t, c, mr.Bytes(), n-4096, "after ToError returned")
}

// TestLocalInvFencesRemoteWrite: once a LOCAL_INV's post has returned, a peer's RDMA WRITE
// under the key it invalidated no longer lands, even one whose payload was being placed when
// it was posted: an RTRS client hands a READ's buffer back right after, and a server that
// answered and then trickled a write into it wrote into memory that was someone else's (or
// unmapped: a crash). The QP is moved to error, as the write is the peer's fault.
func TestLocalInvFencesRemoteWrite(t *testing.T) {
	p := New(Options{})
	srv, addr := acceptOne(t, p)
	c := rawConnect(t, addr)
	s := <-srv
	if s == nil {
		t.Fatal("server did not accept")
	}
	const n = 4096
	backing := s.reg(t, n, rdma.AccessLocalWrite)
	m, err := s.pd.AllocFastRegMR(n, rdma.FastRegRemoteInv)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Map(backing.Bytes(), backing.Addr()); err != nil {
		t.Fatal(err)
	}
	key := rdma.IncKey(m.RKey())
	s.post(t, rdma.SendWR{ID: 99, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: m, Key: key, Access: rdma.AccessLocalWrite | rdma.AccessRemoteWrite})
	s.expect(t, 99, rdma.WCRegMR, rdma.WCSuccess)
	startPlacing(t, c, s, key, backing.Addr(), n, 1024)
	returned := make(chan error, 1)
	go func() {
		_, err := s.qp.PostSend([]rdma.SendWR{{ID: 7, Opcode: rdma.OpLocalInv, InvRKey: key}})
		returned <- err
	}()
	select {
	case err := <-returned:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("LOCAL_INV waited for the peer to send the rest of the write")
	}
	restLandsNowhere(t, c, backing.Bytes(), n-1024, "after its key was invalidated")
	if st := s.qp.State(); st != rdma.QPSErr {
		t.Fatalf("QP %v after a write cut by an invalidation, want error", st)
	}
}
