package rdmatest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// testManyQPs runs 16 connections at once, each moving its own data with WRITE_WITH_IMM, READ
// and SEND through its own regions, and checks every byte.
func testManyQPs(t *testing.T, env *Env) {
	const n, size = 16, 64 << 10
	type job struct {
		c                    *conn
		src, back, mem, rbuf rdma.MR
		seed                 byte
	}
	jobs := make([]job, n)
	for i := range jobs {
		c := connect(t, env, env.opts())
		jobs[i] = job{c: c, src: c.cli.alloc(t, size, lw), back: c.cli.mapped(t, size, lw),
			mem: c.srv.alloc(t, size, rw|rr), rbuf: c.srv.mapped(t, size, lw), seed: byte(i * 13)}
	}
	errs := make(chan error, n)
	for i := range jobs {
		j := &jobs[i]
		go func() { errs <- exercise(j.c, j.src, j.back, j.mem, j.rbuf, j.seed) }()
	}
	var failed []error
	for i := range n {
		if err := <-errs; err != nil {
			failed = append(failed, fmt.Errorf("connection %d: %w", i, err))
		}
	}
	if len(failed) > 0 {
		t.Fatal(errors.Join(failed...))
	}
}

// exercise does 50 rounds on c: the client writes a fresh pattern of a varying size with
// WRITE_WITH_IMM, reads it back with an RDMA_READ and SENDs it, all in one post with only the
// SEND signaled; the server checks the write and the SEND as each receive completes, the
// client the read once the SEND completes.
func exercise(c *conn, src, back, mem, rbuf rdma.MR, seed byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitTimeout)
	defer cancel()
	next := func(s *side) (rdma.WC, error) {
		var wc [1]rdma.WC
		for s.cq.Poll(wc[:]) == 0 {
			if err := s.cq.Wait(ctx); err != nil {
				return wc[0], fmt.Errorf("%s: waiting for a completion: %w", s.name, err)
			}
		}
		if wc[0].Status != rdma.WCSuccess {
			return wc[0], fmt.Errorf("%s: completion %s", s.name, fmtWC(wc[0]))
		}
		return wc[0], nil
	}
	n := src.Len()
	for round := range 50 {
		sz := 1 + (round*4099)%n
		fill(src.Bytes()[:sz], seed+byte(round))
		if _, err := c.srv.qp.PostRecv([]rdma.RecvWR{{ID: 1}, {ID: 2, SGList: []rdma.SGE{rdma.SGEOf(rbuf, 0, n)}}}); err != nil {
			return err
		}
		if _, err := c.cli.qp.PostSend([]rdma.SendWR{
			{ID: 1, Opcode: rdma.OpRDMAWriteWithImm, Imm: uint32(round) << 8, SGList: []rdma.SGE{rdma.SGEOf(src, 0, sz)}, RemoteAddr: mem.Addr(), RKey: mem.RKey()},
			{ID: 2, Opcode: rdma.OpRDMARead, SGList: []rdma.SGE{rdma.SGEOf(back, 0, sz)}, RemoteAddr: mem.Addr(), RKey: mem.RKey()},
			{ID: 3, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, sz)}},
		}); err != nil {
			return err
		}
		wc, err := next(c.srv)
		if err != nil {
			return err
		}
		if wc.ID != 1 || wc.Opcode != rdma.WCRecvRDMAWithImm || wc.Imm != uint32(round)<<8 || int(wc.ByteLen) != sz {
			return fmt.Errorf("round %d: WRITE_WITH_IMM's receive %s", round, fmtWC(wc))
		}
		if !bytes.Equal(mem.Bytes()[:sz], src.Bytes()[:sz]) {
			return fmt.Errorf("round %d: written data differs", round)
		}
		if wc, err = next(c.srv); err != nil {
			return err
		}
		if wc.ID != 2 || wc.Opcode != rdma.WCRecv || int(wc.ByteLen) != sz {
			return fmt.Errorf("round %d: SEND's receive %s", round, fmtWC(wc))
		}
		if !bytes.Equal(rbuf.Bytes()[:sz], src.Bytes()[:sz]) {
			return fmt.Errorf("round %d: sent data differs", round)
		}
		if wc, err = next(c.cli); err != nil {
			return err
		}
		if wc.ID != 3 || wc.Opcode != rdma.WCSend {
			return fmt.Errorf("round %d: client completion %s, want the SEND's alone", round, fmtWC(wc))
		}
		if !bytes.Equal(back.Bytes()[:sz], src.Bytes()[:sz]) {
			return fmt.Errorf("round %d: read-back data differs", round)
		}
	}
	return nil
}

// testCompletionHandler drives a ping-pong entirely from completion handlers (CQ.SetHandler):
// the server's handler echoes every message, the client's sends the next one, both posting
// from inside the handler; the calls for one CQ never overlap.
func testCompletionHandler(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	const rounds = 2000
	sbuf, cbuf := c.srv.alloc(t, 64, lw), c.cli.alloc(t, 64, lw)
	var overlaps, calls atomic.Int32
	var failure atomic.Pointer[string]
	fail := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		failure.CompareAndSwap(nil, &msg)
	}
	handler := func(s *side, onRecv func(rdma.WC)) func() {
		var wc [8]rdma.WC
		var inside atomic.Int32
		return func() {
			calls.Add(1)
			if inside.Add(1) > 1 {
				overlaps.Add(1)
			}
			defer inside.Add(-1)
			for n := s.cq.Poll(wc[:]); n > 0; n = s.cq.Poll(wc[:]) {
				for _, w := range wc[:n] {
					if w.Status != rdma.WCSuccess {
						fail("%s: completion %s", s.name, fmtWC(w))
						return
					}
					if w.Opcode == rdma.WCRecv {
						onRecv(w)
					}
				}
			}
		}
	}
	// Each side posts the receive for the next message before the send that asks for it, so
	// no message waits for a receive (an RNR wait costs up to 655 ms on an HCA). The sends
	// are signaled: on an HCA, a send queue slot comes back with a polled completion.
	post := func(s *side, buf rdma.MR, imm uint32) {
		if _, err := s.qp.PostRecv([]rdma.RecvWR{{SGList: []rdma.SGE{rdma.SGEOf(buf, 0, 64)}}}); err != nil {
			fail("%s: PostRecv: %v", s.name, err)
		}
		if _, err := s.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, Imm: imm, SGList: []rdma.SGE{rdma.SGEOf(buf, 0, 64)}}}); err != nil {
			fail("%s: PostSend: %v", s.name, err)
		}
	}
	c.srv.recv(t, 0, rdma.SGEOf(sbuf, 0, 64))
	c.srv.cq.SetHandler(handler(c.srv, func(w rdma.WC) { post(c.srv, sbuf, w.Imm) }))
	done := make(chan struct{})
	var next atomic.Uint32
	c.cli.cq.SetHandler(handler(c.cli, func(w rdma.WC) {
		if w.Imm != next.Load() {
			fail("echo %d, want %d", w.Imm, next.Load())
		}
		if next.Add(1) == rounds {
			close(done)
			return
		}
		post(c.cli, cbuf, next.Load())
	}))
	post(c.cli, cbuf, 0)
	select {
	case <-done:
	case <-time.After(2 * waitTimeout):
		t.Errorf("ping-pong stuck after %d of %d rounds", next.Load(), rounds)
	}
	c.srv.cq.SetHandler(nil)
	c.cli.cq.SetHandler(nil)
	if msg := failure.Load(); msg != nil {
		t.Fatal(*msg)
	}
	if overlaps.Load() != 0 {
		t.Fatalf("handler calls for one CQ overlapped %d times", overlaps.Load())
	}
	if calls.Load() < 2 {
		t.Fatalf("handlers called %d times", calls.Load())
	}
}

// testHandlerChange: a handler that is replaced is not called again, the new one takes the
// next completion, and once the handler is removed a completion stays in the queue for Poll;
// the queue is destroyed with a handler installed, and every change returns promptly.
func testHandlerChange(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	sbuf, cbuf := c.srv.alloc(t, 64, lw), c.cli.alloc(t, 64, lw)
	// handler counts its calls and the receives it polls; the receives go to got.
	handler := func(calls *atomic.Int32, got chan<- rdma.WC) func() {
		var wc [4]rdma.WC
		return func() {
			calls.Add(1)
			for n := c.srv.cq.Poll(wc[:]); n > 0; n = c.srv.cq.Poll(wc[:]) {
				for _, w := range wc[:n] {
					if w.Opcode == rdma.WCRecv || w.Status != rdma.WCSuccess {
						got <- w
					}
				}
			}
		}
	}
	send := func(imm uint32) {
		c.srv.recv(t, uint64(imm), rdma.SGEOf(sbuf, 0, 64))
		c.cli.post(t, rdma.SendWR{Opcode: rdma.OpSendWithImm, Imm: imm, SGList: []rdma.SGE{rdma.SGEOf(cbuf, 0, 64)}})
	}
	expect := func(name string, got <-chan rdma.WC, imm uint32) {
		t.Helper()
		select {
		case w := <-got:
			if w.Status != rdma.WCSuccess || w.Imm != imm {
				t.Fatalf("handler %s: completion %s, want a receive of imm %d", name, fmtWC(w), imm)
			}
		case <-time.After(waitTimeout):
			t.Fatalf("handler %s: no completion within %v", name, waitTimeout)
		}
	}
	timed := func(what string, f func()) {
		t.Helper()
		t0 := time.Now()
		f()
		if d := time.Since(t0); d > waitTimeout {
			t.Fatalf("%s took %v", what, d)
		}
	}
	var callsA, callsB atomic.Int32
	gotA, gotB := make(chan rdma.WC, 4), make(chan rdma.WC, 4)
	c.srv.cq.SetHandler(handler(&callsA, gotA))
	send(1)
	expect("A", gotA, 1)
	timed("replacing the handler", func() { c.srv.cq.SetHandler(handler(&callsB, gotB)) })
	a := callsA.Load()
	send(2)
	expect("B", gotB, 2)
	timed("removing the handler", func() { c.srv.cq.SetHandler(nil) })
	b := callsB.Load()
	send(3)
	c.srv.expect(t, 3, rdma.WCRecv, rdma.WCSuccess)
	if callsA.Load() != a || callsB.Load() != b {
		t.Fatalf("handlers called after their removal: A %d → %d, B %d → %d", a, callsA.Load(), b, callsB.Load())
	}
	if len(gotA) != 0 {
		t.Fatalf("handler A took %s after it was replaced", fmtWC(<-gotA))
	}
	// Destroyed with a handler in place, once its QP is gone (an HCA refuses to destroy a
	// CQ a QP uses); the side's cleanup destroys both again, which ends in ErrClosed.
	var callsC atomic.Int32
	c.srv.cq.SetHandler(handler(&callsC, make(chan rdma.WC, 4)))
	if err := c.srv.id.Destroy(); err != nil {
		t.Fatalf("destroying the server's identifier: %v", err)
	}
	timed("destroying a queue with a handler", func() {
		if err := c.srv.cq.Destroy(); err != nil {
			t.Fatalf("Destroy with a handler: %v", err)
		}
	})
}

// testBusyPoll: a provider that spins for completions by itself (rdma.BusyPoller) returns
// none from an empty queue once its spins are spent, and returns a completion that arrives
// while it spins, whole, as Poll would.
func testBusyPoll(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	bp, ok := c.srv.cq.(rdma.BusyPoller)
	if !ok {
		t.Skip("the provider's CQ polls in Go and has no PollBusy")
	}
	var wc [4]rdma.WC
	if n := bp.PollBusy(wc[:], 1000); n != 0 {
		t.Fatalf("PollBusy of an empty queue returned %d completions: %s", n, fmtWC(wc[0]))
	}
	src, buf := c.cli.alloc(t, 64, lw), c.srv.alloc(t, 64, lw)
	copy(src.Bytes(), pattern(64, 7))
	for round := range uint32(100) {
		c.srv.recv(t, uint64(round), rdma.SGEOf(buf, 0, 64))
		c.cli.post(t, rdma.SendWR{ID: uint64(round), Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, Imm: round, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}})
		deadline := time.Now().Add(waitTimeout)
		n := 0
		for n == 0 && time.Now().Before(deadline) {
			n = bp.PollBusy(wc[:], 1<<16)
		}
		if n != 1 {
			t.Fatalf("round %d: PollBusy returned %d completions, want the receive", round, n)
		}
		w := wc[0]
		if w.Status != rdma.WCSuccess || w.Opcode != rdma.WCRecv || w.ID != uint64(round) || w.Imm != round || w.Flags&rdma.WCWithImm == 0 || w.ByteLen != 64 || w.QPNum != c.srv.qp.Num() {
			t.Fatalf("round %d: PollBusy returned %s", round, fmtWC(w))
		}
		if !bytes.Equal(buf.Bytes(), src.Bytes()) {
			t.Fatalf("round %d: received data differs", round)
		}
		c.cli.expect(t, uint64(round), rdma.WCSend, rdma.WCSuccess)
	}
}
