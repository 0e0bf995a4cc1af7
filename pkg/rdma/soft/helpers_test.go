package soft

import (
	"context"
	"errors"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// end is one side of a connection under test.
type end struct {
	id  rdma.ConnID
	pd  rdma.PD
	cq  rdma.CQ
	qp  rdma.QP
	dev rdma.Device
}

// pair is a connected client/server pair.
type pair struct {
	cli, srv     end
	cliData      []byte // private data the server saw
	srvData      []byte // private data the client saw
	cliRNR       uint8
	srvRNR       uint8
	listener     rdma.Listener
	beforeAccept func(*end) // server side, after its QP exists
	beforeConn   func(*end) // client side, after its QP exists
}

const testQD = 64

func qpAttr(c rdma.CQ) rdma.QPInitAttr {
	return rdma.QPInitAttr{SendCQ: c, RecvCQ: c, MaxSendWR: testQD, MaxRecvWR: testQD, MaxSendSGE: 4, MaxRecvSGE: 4}
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// connect builds a connected pair over loopback from src to dst (dst port 0: a fresh listener).
func connect(t testing.TB, p *Provider, pr *pair, src, dst string) *pair {
	t.Helper()
	ctx := ctxT(t, 10*time.Second)
	ln, err := p.Listen(netip.MustParseAddrPort(dst), 8)
	if err != nil {
		t.Fatal(err)
	}
	pr.listener = ln
	t.Cleanup(func() { _ = ln.Close() })
	type res struct{ err error }
	done := make(chan res, 1)
	go func() {
		req, err := ln.Accept(ctx)
		if err != nil {
			done <- res{err}
			return
		}
		e := &pr.srv
		e.id = req.ID
		pr.cliData = req.PrivateData
		e.dev = req.ID.Device()
		if e.pd, err = e.dev.AllocPD(); err == nil {
			if e.cq, err = e.dev.CreateCQ(4 * testQD); err == nil {
				e.qp, err = req.ID.CreateQP(e.pd, qpAttr(e.cq))
			}
		}
		if err != nil {
			done <- res{err}
			return
		}
		if pr.beforeAccept != nil {
			pr.beforeAccept(e)
		}
		done <- res{req.ID.Accept(ctx, rdma.ConnParam{PrivateData: []byte("server-hello"), RNRRetryCount: pr.srvRNR})}
	}()
	var s netip.Addr
	if src != "" {
		s = netip.MustParseAddr(src)
	}
	to := ln.Addr()
	if to.Addr().IsUnspecified() {
		to = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), to.Port())
	}
	id, err := p.ResolveAddr(ctx, s, to)
	if err != nil {
		t.Fatal(err)
	}
	e := &pr.cli
	e.id, e.dev = id, id.Device()
	if e.pd, err = e.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if e.cq, err = e.dev.CreateCQ(4 * testQD); err != nil {
		t.Fatal(err)
	}
	if e.qp, err = id.CreateQP(e.pd, qpAttr(e.cq)); err != nil {
		t.Fatal(err)
	}
	if pr.beforeConn != nil {
		pr.beforeConn(e)
	}
	pr.srvData, err = id.Connect(ctx, rdma.ConnParam{PrivateData: []byte("client-hello"), RNRRetryCount: pr.cliRNR})
	if err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() {
		_ = pr.cli.id.Destroy()
		_ = pr.srv.id.Destroy()
		_ = pr.cli.cq.Destroy()
		_ = pr.srv.cq.Destroy()
	})
	return pr
}

// newPair connects two QPs over 127.0.0.1.
func newPair(t testing.TB, p *Provider) *pair {
	return connect(t, p, &pair{cliRNR: 7, srvRNR: 7}, "", "127.0.0.1:0")
}

// reg registers n bytes with access.
func (e *end) reg(t testing.TB, n int, access rdma.Access) rdma.MR {
	t.Helper()
	m, err := e.pd.AllocMR(n, access)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// post posts one send request.
func (e *end) post(t testing.TB, wr rdma.SendWR) {
	t.Helper()
	if _, err := e.qp.PostSend([]rdma.SendWR{wr}); err != nil {
		t.Fatal(err)
	}
}

// postRetry posts one send request, retrying while the send queue is full.
func (e *end) postRetry(t testing.TB, wr rdma.SendWR) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := e.qp.PostSend([]rdma.SendWR{wr})
		if err == nil {
			return
		}
		if !errors.Is(err, syscall.ENOMEM) || time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
}

// recv posts one receive into m[off:off+n] (n = 0: no SGE).
func (e *end) recv(t testing.TB, id uint64, m rdma.MR, off, n int) {
	t.Helper()
	wr := rdma.RecvWR{ID: id}
	if n > 0 {
		wr.SGList = []rdma.SGE{rdma.SGEOf(m, off, n)}
	}
	if _, err := e.qp.PostRecv([]rdma.RecvWR{wr}); err != nil {
		t.Fatal(err)
	}
}

// wait returns the next completion, failing the test after 5 s.
func (e *end) wait(t testing.TB) rdma.WC {
	t.Helper()
	ctx := ctxT(t, 5*time.Second)
	var wc [1]rdma.WC
	for {
		if e.cq.Poll(wc[:]) == 1 {
			return wc[0]
		}
		if err := e.cq.Wait(ctx); err != nil {
			t.Fatalf("waiting for a completion: %v", err)
		}
	}
}

// expect waits for a completion and checks id, opcode and status.
func (e *end) expect(t testing.TB, id uint64, op rdma.WCOpcode, st rdma.WCStatus) rdma.WC {
	t.Helper()
	wc := e.wait(t)
	if wc.ID != id || wc.Opcode != op || wc.Status != st {
		t.Fatalf("completion id %d %v %v, want id %d %v %v", wc.ID, wc.Opcode, wc.Status, id, op, st)
	}
	return wc
}

// expectSet waits for completions with exactly these ids and statuses, in any order.
func (e *end) expectSet(t testing.TB, want map[uint64]rdma.WCStatus) {
	t.Helper()
	for range len(want) {
		wc := e.wait(t)
		st, ok := want[wc.ID]
		if !ok || st != wc.Status {
			t.Fatalf("completion id %d %v %v; want one of %v", wc.ID, wc.Opcode, wc.Status, want)
		}
		delete(want, wc.ID)
	}
}

// expectEvent waits for a CM event.
func (e *end) expectEvent(t testing.TB, typ rdma.CMEventType) rdma.CMEvent {
	t.Helper()
	select {
	case ev := <-e.id.Events():
		if ev.Type != typ {
			t.Fatalf("event %v, want %v", ev.Type, typ)
		}
		return ev
	case <-time.After(5 * time.Second):
		t.Fatalf("no %v event", typ)
	}
	return rdma.CMEvent{}
}

// noCompletion checks that the CQ stays empty for a moment.
func (e *end) noCompletion(t testing.TB) {
	t.Helper()
	time.Sleep(50 * time.Millisecond)
	var wc [1]rdma.WC
	if e.cq.Poll(wc[:]) != 0 {
		t.Fatalf("unexpected completion %+v", wc[0])
	}
}

// sync makes everything the client posted so far visible to the server's goroutine: a
// zero-length WRITE_WITH_IMM executes after earlier requests, and its receive completion on the
// server's own CQ orders the server's reads after their data placement (a responder learns of
// one-sided data this way, never from the requester's completion).
func (pr *pair) sync(t testing.TB) {
	t.Helper()
	pr.srv.recv(t, 0xfeed, nil, 0, 0)
	pr.cli.post(t, rdma.SendWR{ID: 0xfeed, Opcode: rdma.OpRDMAWriteWithImm, Imm: 1})
	pr.srv.expect(t, 0xfeed, rdma.WCRecvRDMAWithImm, rdma.WCSuccess)
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7)
	}
}
