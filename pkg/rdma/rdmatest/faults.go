package rdmatest

import (
	"bytes"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// target is remote memory as a requester names it.
type target struct {
	rkey uint32
	addr uint64
}

// violate makes c's client access tg with op (16 bytes) when tg does not grant it, and checks
// IB RC's outcome: the request completes with a remote access error, the requester's later
// request and its posted receive flush, the responder's QP fails and flushes its receive,
// requests posted afterwards flush on both sides, a disconnect is reported on both sides; and
// victim (the memory tg points into, nil if gone) is untouched, as is the local buffer of a
// refused read.
func violate(t testing.TB, c *conn, op rdma.Opcode, tg target, victim []byte) {
	t.Helper()
	before := bytes.Clone(victim)
	local := c.cli.alloc(t, 64, lw)
	fill(local.Bytes(), 0xa7)
	c.srv.recv(t, 11)
	c.cli.recv(t, 12)
	c.cli.post(t,
		rdma.SendWR{ID: 1, Opcode: op, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 16)}, RemoteAddr: tg.addr, RKey: tg.rkey},
		rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 8)}})
	c.cli.expectSet(t, map[uint64]rdma.WCStatus{1: rdma.WCRemAccessErr, 2: rdma.WCFlushErr, 12: rdma.WCFlushErr})
	c.cli.expectState(t, rdma.QPSErr)
	if !bytes.Equal(victim, before) {
		t.Fatal("a refused access changed the memory it named")
	}
	if !bytes.Equal(local.Bytes(), pattern(64, 0xa7)) {
		t.Fatal("a refused read placed data")
	}
	// The requester tears the connection down, as RTRS does on an error completion; the
	// responder's receives flush then at the latest (rxe moves its QP to error at the NAK but
	// flushes the receive queue only when the responder runs again).
	c.disconnect(t, c.cli)
	c.srv.expect(t, 11, rdma.WCRecv, rdma.WCFlushErr)
	c.srv.expectState(t, rdma.QPSErr)
	// A QP in error takes requests and flushes them.
	c.cli.post(t, rdma.SendWR{ID: 3, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 8)}})
	c.cli.expect(t, 3, rdma.WCSend, rdma.WCFlushErr)
	c.srv.recv(t, 13)
	c.srv.expect(t, 13, rdma.WCRecv, rdma.WCFlushErr)
	if !bytes.Equal(victim, before) {
		t.Fatal("a refused access changed the memory it named")
	}
}

// testAccessViolations: every way a peer can name memory it was not granted, through a
// registered or a fast-reg region, ends as violate checks.
func testAccessViolations(t *testing.T, env *Env) {
	type prep func(t *testing.T, c *conn) (target, []byte)
	// afterLocalInv: a fast-reg region registered with access, then invalidated.
	afterLocalInv := func(flags rdma.FastRegFlags, access rdma.Access) prep {
		return func(t *testing.T, c *conn) (target, []byte) {
			f := c.srv.newFastReg(t, 4096, flags)
			tg := target{c.srv.regMR(t, f, access), f.mr.Addr()}
			c.srv.localInv(t, f)
			return tg, f.backing.Bytes()
		}
	}
	// beforeReRegistration: the key a region had before its LOCAL_INV and a REG_MR under
	// the next key, which works.
	beforeReRegistration := func(flags rdma.FastRegFlags, access rdma.Access) prep {
		return func(t *testing.T, c *conn) (target, []byte) {
			f := c.srv.newFastReg(t, 4096, flags)
			old := target{c.srv.regMR(t, f, access), f.mr.Addr()}
			c.srv.localInv(t, f)
			key := c.srv.regMR(t, f, access)
			if access&rdma.AccessRemoteWrite != 0 {
				c.writeAndCheck(t, 50, key, f.mr.Addr(), f.mem, 81)
			} else {
				c.readAndCheck(t, 50, key, f.mr.Addr(), f.mem)
			}
			return old, f.backing.Bytes()
		}
	}
	// fastReg: a valid fast-reg region with access; at says where in it to aim.
	fastReg := func(flags rdma.FastRegFlags, access rdma.Access, at func(addr uint64, n int) uint64) prep {
		return func(t *testing.T, c *conn) (target, []byte) {
			f := c.srv.newFastReg(t, 4096, flags)
			key := c.srv.regMR(t, f, access)
			fill(f.backing.Bytes(), 0x5a)
			return target{key, at(f.mr.Addr(), 4096)}, f.backing.Bytes()
		}
	}
	// registered: a registered region with access; at says where to aim and key which key.
	registered := func(access rdma.Access, at func(addr uint64, n int) uint64, key func(uint32) uint32) prep {
		return func(t *testing.T, c *conn) (target, []byte) {
			m := c.srv.alloc(t, 4096, access)
			fill(m.Bytes(), 0x5a)
			return target{key(m.RKey()), at(m.Addr(), 4096)}, m.Bytes()
		}
	}
	start := func(addr uint64, _ int) uint64 { return addr }
	pastEnd := func(addr uint64, n int) uint64 { return addr + uint64(n) - 8 }
	beforeStart := func(addr uint64, _ int) uint64 { return addr - 8 }
	same := func(k uint32) uint32 { return k }

	for _, tc := range []struct {
		name string
		op   rdma.Opcode
		prep prep
	}{
		{"write after LOCAL_INV", rdma.OpRDMAWrite, afterLocalInv(rdma.FastRegRemoteInv, rw)},
		{"read after LOCAL_INV, PD-scoped", rdma.OpRDMARead, afterLocalInv(0, lw|rr)},
		{"write after SEND_WITH_INV", rdma.OpRDMAWrite, func(t *testing.T, c *conn) (target, []byte) {
			f := c.srv.newFastReg(t, 4096, rdma.FastRegRemoteInv)
			tg := target{c.srv.regMR(t, f, rw), f.mr.Addr()}
			c.srv.recv(t, 60)
			c.cli.post(t, rdma.SendWR{ID: 60, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: tg.rkey})
			if wc := c.srv.expect(t, 60, rdma.WCRecv, rdma.WCSuccess); wc.Flags&rdma.WCWithInv == 0 || wc.InvRKey != tg.rkey {
				t.Fatalf("SEND_WITH_INV's receive %s", fmtWC(wc))
			}
			c.cli.expect(t, 60, rdma.WCSend, rdma.WCSuccess)
			return tg, f.backing.Bytes()
		}},
		{"write with the key before re-registration", rdma.OpRDMAWrite, beforeReRegistration(rdma.FastRegRemoteInv, rw)},
		{"read with the key before re-registration, PD-scoped", rdma.OpRDMARead, beforeReRegistration(0, lw|rr)},
		{"write past the end", rdma.OpRDMAWrite, registered(rw, pastEnd, same)},
		{"write before the start", rdma.OpRDMAWrite, registered(rw, beforeStart, same)},
		{"read past the end", rdma.OpRDMARead, registered(lw|rr, pastEnd, same)},
		{"write past the end of a fast-reg region", rdma.OpRDMAWrite, fastReg(rdma.FastRegRemoteInv, rw, pastEnd)},
		{"read before the start of a fast-reg region", rdma.OpRDMARead, fastReg(0, lw|rr, beforeStart)},
		{"write without REMOTE_WRITE", rdma.OpRDMAWrite, registered(lw|rr, start, same)},
		{"read without REMOTE_READ", rdma.OpRDMARead, registered(rw, start, same)},
		{"write to a fast-reg region without REMOTE_WRITE", rdma.OpRDMAWrite, fastReg(rdma.FastRegRemoteInv, lw|rr, start)},
		{"read from a fast-reg region without REMOTE_READ", rdma.OpRDMARead, fastReg(0, rw, start)},
		{"wrong key byte", rdma.OpRDMAWrite, registered(rw, start, func(k uint32) uint32 { return k ^ 0x80 })},
		{"deregistered region", rdma.OpRDMAWrite, func(t *testing.T, c *conn) (target, []byte) {
			m := c.srv.alloc(t, 4096, rw)
			tg := target{m.RKey(), m.Addr()}
			if err := m.Dereg(); err != nil {
				t.Fatalf("Dereg: %v", err)
			}
			return tg, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env.begin(t)
			c := connect(t, env, env.opts())
			tg, victim := tc.prep(t, c)
			violate(t, c, tc.op, tg, victim)
		})
	}
}

// testLocalProtection: an SGE that names memory its QP may not use fails the request with a
// local protection error before anything is sent: the QP fails and flushes, and the peer,
// which saw nothing, flushes its receives once told of the disconnect.
func testLocalProtection(t *testing.T, env *Env) {
	for _, tc := range []struct {
		name string
		op   rdma.Opcode
		sge  func(t *testing.T, c *conn) rdma.SGE
	}{
		{"wrong key byte", rdma.OpSend, func(t *testing.T, c *conn) rdma.SGE {
			m := c.cli.alloc(t, 64, lw)
			return rdma.SGE{Addr: m.Addr(), Length: 8, LKey: m.LKey() ^ 0x80}
		}},
		{"deregistered region", rdma.OpSend, func(t *testing.T, c *conn) rdma.SGE {
			m := c.cli.alloc(t, 64, lw)
			sge := rdma.SGEOf(m, 0, 8)
			if err := m.Dereg(); err != nil {
				t.Fatalf("Dereg: %v", err)
			}
			return sge
		}},
		{"region of another PD", rdma.OpSend, func(t *testing.T, c *conn) rdma.SGE {
			return rdma.SGEOf(c.cli.allocOn(t, c.cli.extraPD(t), 64, lw), 0, 8)
		}},
		{"past the end", rdma.OpSend, func(t *testing.T, c *conn) rdma.SGE {
			return rdma.SGEOf(c.cli.alloc(t, 64, lw), 60, 8)
		}},
		{"before the start", rdma.OpRDMAWrite, func(t *testing.T, c *conn) rdma.SGE {
			m := c.cli.alloc(t, 64, lw)
			return rdma.SGE{Addr: m.Addr() - 1, Length: 8, LKey: m.LKey()}
		}},
		{"fast-reg key after LOCAL_INV", rdma.OpRDMAWrite, func(t *testing.T, c *conn) rdma.SGE {
			f := c.cli.newFastReg(t, 4096, rdma.FastRegRemoteInv)
			key := c.cli.regMR(t, f, lw)
			c.cli.localInv(t, f)
			return rdma.SGE{Addr: f.mr.Addr(), Length: 8, LKey: key}
		}},
		{"RDMA_READ into memory without LOCAL_WRITE", rdma.OpRDMARead, func(t *testing.T, c *conn) rdma.SGE {
			return rdma.SGEOf(c.cli.alloc(t, 64, rr), 0, 8)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env.begin(t)
			c := connect(t, env, env.opts())
			remote := c.srv.alloc(t, 64, rw|rr)
			fill(remote.Bytes(), 0x5a)
			ok := c.cli.alloc(t, 64, lw)
			sge := tc.sge(t, c)
			c.srv.recv(t, 11)
			c.cli.recv(t, 12)
			c.cli.post(t,
				rdma.SendWR{ID: 1, Opcode: tc.op, Flags: rdma.SendSignaled, SGList: []rdma.SGE{sge}, RemoteAddr: remote.Addr(), RKey: remote.RKey()},
				rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWrite, SGList: []rdma.SGE{rdma.SGEOf(ok, 0, 8)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()})
			// An SGE that names no usable region is a local protection error; rxe reports
			// a key it cannot find as a local QP operation error.
			failed := []rdma.WCStatus{rdma.WCLocProtErr, rdma.WCLocQPOpErr}
			if env.LocalErrorsFlush {
				failed = append(failed, rdma.WCFlushErr)
			}
			c.cli.expectSetAny(t, map[uint64][]rdma.WCStatus{1: failed, 2: {rdma.WCFlushErr}, 12: {rdma.WCFlushErr}})
			c.cli.expectState(t, rdma.QPSErr)
			c.disconnect(t, c.cli)
			c.srv.expect(t, 11, rdma.WCRecv, rdma.WCFlushErr)
			want := pattern(64, 0x5a)
			untouched := bytes.Equal(remote.Bytes(), want)
			// At most the WRITE behind a READ: ok's first 8 bytes, the rest untouched.
			copy(want, ok.Bytes()[:8])
			writeLanded := env.LocalErrorsFlush && tc.op == rdma.OpRDMARead && bytes.Equal(remote.Bytes(), want)
			if !untouched && !writeLanded {
				t.Fatal("a request that failed locally changed remote memory")
			}
		})
	}
}

// testReceiveTooSmall: a SEND longer than the receive it lands in fails at both ends: a
// remote invalid request at the requester, an error completion of that receive at the
// responder, and both QPs flush what follows.
func testReceiveTooSmall(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	src := c.cli.alloc(t, 64, lw)
	buf := c.srv.alloc(t, 64, lw)
	c.srv.recv(t, 1, rdma.SGEOf(buf, 0, 16))
	c.srv.recv(t, 11)
	c.cli.recv(t, 12)
	c.cli.post(t,
		rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}},
		rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}})
	// The responder NAKs: an invalid request (soft), or a remote operation error (rxe,
	// which fails the receive it could not fill).
	c.cli.expectSetAny(t, map[uint64][]rdma.WCStatus{1: {rdma.WCRemInvReqErr, rdma.WCRemOpErr}, 2: {rdma.WCFlushErr}, 12: {rdma.WCFlushErr}})
	if wc := c.srv.next(t); wc.ID != 1 || wc.Status == rdma.WCSuccess {
		t.Fatalf("server: the too-small receive completed %s, want id 0x1 with an error", fmtWC(wc))
	}
	c.srv.expect(t, 11, rdma.WCRecv, rdma.WCFlushErr)
	c.cli.expectState(t, rdma.QPSErr)
	c.srv.expectState(t, rdma.QPSErr)
	c.disconnect(t, c.srv)
}

// testRNR: a SEND (or WRITE_WITH_IMM) that finds no receive is retried as the responder's
// accept said: for ever with 7, until a receive is posted; with fewer, it fails the requester
// with RNR_RETRY_EXC_ERR.
func testRNR(t *testing.T, env *Env) {
	t.Run("retry for ever", func(t *testing.T) {
		env.begin(t)
		o := env.opts()
		o.srvRNR = 7
		c := connect(t, env, o)
		src := c.cli.alloc(t, 64, lw)
		dst := c.srv.alloc(t, 128, rw)
		fill(src.Bytes(), 4)
		c.cli.post(t,
			rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}},
			rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWriteWithImm, Flags: rdma.SendSignaled, Imm: 0x12345678,
				SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}, RemoteAddr: dst.Addr() + 64, RKey: dst.RKey()})
		time.Sleep(2 * quietPeriod) // retries go on meanwhile
		c.cli.quiet(t)
		c.srv.quiet(t)
		c.srv.recv(t, 9, rdma.SGEOf(dst, 0, 64))
		c.srv.recv(t, 10)
		c.srv.expect(t, 9, rdma.WCRecv, rdma.WCSuccess)
		if wc := c.srv.expect(t, 10, rdma.WCRecvRDMAWithImm, rdma.WCSuccess); wc.Imm != 0x12345678 || wc.ByteLen != 64 {
			t.Fatalf("WRITE_WITH_IMM after RNR: %s", fmtWC(wc))
		}
		c.cli.expect(t, 1, rdma.WCSend, rdma.WCSuccess)
		c.cli.expect(t, 2, rdma.WCRDMAWrite, rdma.WCSuccess)
		if !bytes.Equal(dst.Bytes()[:64], src.Bytes()) || !bytes.Equal(dst.Bytes()[64:], src.Bytes()) {
			t.Fatal("payload after RNR waits differs")
		}
	})
	t.Run("retry exceeded", func(t *testing.T) {
		env.begin(t)
		o := env.opts()
		o.srvRNR = 2 // the server's accept: the client's SENDs are retried twice
		c := connect(t, env, o)
		src := c.cli.alloc(t, 64, lw)
		c.cli.recv(t, 12)
		c.cli.post(t,
			rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, Imm: 1, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}},
			rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}})
		c.cli.expectSet(t, map[uint64]rdma.WCStatus{1: rdma.WCRNRRetryExcErr, 2: rdma.WCFlushErr, 12: rdma.WCFlushErr})
		c.cli.expectState(t, rdma.QPSErr)
		c.disconnect(t, c.cli)
	})
}

// testDisconnect: an orderly disconnect from either side flushes every outstanding request on
// both sides, once each, reports EventDisconnected on both, and later requests flush.
func testDisconnect(t *testing.T, env *Env) {
	for _, from := range []string{"client", "server"} {
		t.Run(from, func(t *testing.T) {
			env.begin(t)
			c := connect(t, env, env.opts())
			src := c.cli.alloc(t, 64, lw)
			rbuf := c.srv.alloc(t, 64, lw)
			for i := range uint64(5) {
				c.cli.recv(t, 100+i)
				c.srv.recv(t, 200+i, rdma.SGEOf(rbuf, 0, 64))
			}
			// A SEND in flight while the disconnect happens.
			c.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}})
			s := c.cli
			if from == "server" {
				s = c.srv
			}
			c.disconnect(t, s)
			// Every request completes once. The SEND may have been delivered (receive 200
			// succeeds; another one only where env.DisconnectReordersReceives) and still be
			// flushed at the requester, whose ack the disconnect beat; but a successful
			// SEND implies its receive succeeded.
			got := map[uint64]rdma.WCStatus{}
			delivered := 0
			for _, s := range []*side{c.cli, c.srv} {
				n := 6
				if s == c.srv {
					n = 5
				}
				for range n {
					wc := s.next(t)
					if _, dup := got[wc.ID]; dup {
						t.Fatalf("%s: request %#x completed twice", s.name, wc.ID)
					}
					got[wc.ID] = wc.Status
					received := s == c.srv && wc.Status == rdma.WCSuccess && wc.Opcode == rdma.WCRecv && wc.ByteLen == 8 &&
						(wc.ID == 200 || env.DisconnectReordersReceives)
					if received {
						delivered++
					}
					if ok := wc.Status == rdma.WCFlushErr || (s == c.cli && wc.ID == 1 && wc.Status == rdma.WCSuccess) || received; !ok {
						t.Fatalf("%s: completion %s after the disconnect", s.name, fmtWC(wc))
					}
				}
				s.quiet(t)
			}
			if delivered > 1 {
				t.Fatalf("one SEND filled %d receives", delivered)
			}
			if got[1] == rdma.WCSuccess && delivered != 1 {
				t.Fatal("the SEND succeeded but no receive did")
			}
			c.cli.expectState(t, rdma.QPSErr)
			c.srv.expectState(t, rdma.QPSErr)
			// Requests posted after the disconnect flush.
			c.srv.recv(t, 300)
			c.srv.expect(t, 300, rdma.WCRecv, rdma.WCFlushErr)
			c.cli.post(t, rdma.SendWR{ID: 301, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 8)}})
			c.cli.expect(t, 301, rdma.WCSend, rdma.WCFlushErr)
		})
	}
}
