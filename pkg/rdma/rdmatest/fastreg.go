package rdmatest

import (
	"bytes"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// frKinds are the two kinds of fast-reg region.
var frKinds = []struct {
	name  string
	flags rdma.FastRegFlags
}{{"QP-bound", rdma.FastRegRemoteInv}, {"PD-scoped", 0}}

// writeAndCheck writes data (placed in fresh client memory) to addr under rkey through c, and
// checks that it landed in mem once the server learns of it.
func (c *conn) writeAndCheck(t testing.TB, id uint64, rkey uint32, addr uint64, mem []byte, seed byte) {
	t.Helper()
	src := c.cli.alloc(t, len(mem), lw)
	fill(src.Bytes(), seed)
	c.cli.post(t, rdma.SendWR{ID: id, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(src, 0, len(mem))}, RemoteAddr: addr, RKey: rkey})
	c.cli.expect(t, id, rdma.WCRDMAWrite, rdma.WCSuccess)
	c.sync(t)
	if !bytes.Equal(mem, src.Bytes()) {
		t.Fatalf("RDMA_WRITE under key %#x did not land in the region's memory", rkey)
	}
}

// readAndCheck reads len(mem) bytes at addr under rkey through c and checks they are mem.
func (c *conn) readAndCheck(t testing.TB, id uint64, rkey uint32, addr uint64, mem []byte) {
	t.Helper()
	dst := c.cli.alloc(t, len(mem), lw)
	c.cli.post(t, rdma.SendWR{ID: id, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(dst, 0, len(mem))}, RemoteAddr: addr, RKey: rkey})
	c.cli.expect(t, id, rdma.WCRDMARead, rdma.WCSuccess)
	if !bytes.Equal(dst.Bytes(), mem) {
		t.Fatalf("RDMA_READ under key %#x does not return the region's memory", rkey)
	}
}

// testFastReg: REG_MR makes a fast-reg region serve remote writes and reads at MR.Addr, over
// exactly the memory it maps; LOCAL_INV ends that and a REG_MR with the next key brings it
// back; the key's scope follows FastRegRemoteInv; the key serves as a local key too, where
// the device's fast-reg regions have one.
func testFastReg(t *testing.T, env *Env) {
	for _, k := range frKinds {
		t.Run(k.name+"/register, invalidate, re-register", func(t *testing.T) {
			env.begin(t)
			c := connect(t, env, env.opts())
			f := c.srv.newFastReg(t, 8192, k.flags)
			key1 := c.srv.regMR(t, f, rw|rr)
			c.writeAndCheck(t, 1, key1, f.mr.Addr(), f.mem, 21)
			if !zero(f.backing.Bytes()[:frSlack]) || !zero(f.backing.Bytes()[frSlack+8192:]) {
				t.Fatal("a write through the fast-reg region landed outside the memory it maps")
			}
			c.readAndCheck(t, 2, key1, f.mr.Addr(), f.mem)
			c.srv.localInv(t, f)
			key2 := c.srv.regMR(t, f, rw|rr)
			if key2 == key1 || key2>>8 != key1>>8 {
				t.Fatalf("re-registered with key %#x after %#x: want a new key byte on the same index", key2, key1)
			}
			c.writeAndCheck(t, 3, key2, f.mr.Addr(), f.mem, 22)
			c.readAndCheck(t, 4, key2, f.mr.Addr()+100, f.mem[100:200])
		})
	}

	t.Run("PD-scoped key serves every QP of the PD", func(t *testing.T) {
		env.begin(t)
		c1 := connect(t, env, env.opts())
		o := env.opts()
		o.srvPD = c1.srv.pd
		c2 := connect(t, env, o)
		f := c1.srv.newFastReg(t, 4096, 0)
		key := c1.srv.regMR(t, f, rw|rr)
		c1.writeAndCheck(t, 1, key, f.mr.Addr(), f.mem, 31)
		c2.writeAndCheck(t, 2, key, f.mr.Addr(), f.mem, 32)
		c2.readAndCheck(t, 3, key, f.mr.Addr(), f.mem)
	})

	t.Run("QP-bound key serves only the QP that registered it", func(t *testing.T) {
		env.begin(t)
		c1 := connect(t, env, env.opts())
		o := env.opts()
		o.srvPD = c1.srv.pd
		c2 := connect(t, env, o)
		f := c1.srv.newFastReg(t, 4096, rdma.FastRegRemoteInv)
		key := c1.srv.regMR(t, f, rw|rr)
		c1.writeAndCheck(t, 1, key, f.mr.Addr(), f.mem, 41)
		// Another QP of the same PD is refused, as for any key it was not given.
		violate(t, c2, rdma.OpRDMAWrite, target{key, f.mr.Addr()}, f.backing.Bytes())
	})

	for _, k := range frKinds {
		t.Run(k.name+"/key as a local key", func(t *testing.T) {
			env.begin(t)
			c := connect(t, env, env.opts())
			if c.cli.dev.Query().MapRegisteredOnly {
				// A memory window has an rkey only (rdma.DeviceAttr.MapRegisteredOnly): local
				// SGEs name the registered region under it, which the other cases cover.
				t.Log("the device's fast-reg regions are memory windows: no local key to test")
				return
			}
			f := c.cli.newFastReg(t, 8192, k.flags)
			key := c.cli.regMR(t, f, lw)
			fill(f.mem, 51)
			dst := c.srv.alloc(t, 8192, rw|rr)
			// WRITE from the region, READ into it, both through SGEs that name its key.
			c.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
				SGList:     []rdma.SGE{{Addr: f.mr.Addr() + 1000, Length: 5000, LKey: key}},
				RemoteAddr: dst.Addr(), RKey: dst.RKey()})
			c.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
			c.sync(t)
			if !bytes.Equal(dst.Bytes()[:5000], f.mem[1000:6000]) {
				t.Fatal("RDMA_WRITE from an SGE naming a fast-reg key: data differs")
			}
			fill(dst.Bytes(), 52)
			c.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
				SGList:     []rdma.SGE{{Addr: f.mr.Addr(), Length: 8192, LKey: key}},
				RemoteAddr: dst.Addr(), RKey: dst.RKey()})
			c.cli.expect(t, 2, rdma.WCRDMARead, rdma.WCSuccess)
			if !bytes.Equal(f.mem, dst.Bytes()) {
				t.Fatal("RDMA_READ into an SGE naming a fast-reg key: data differs")
			}
			if !zero(f.backing.Bytes()[:frSlack]) || !zero(f.backing.Bytes()[frSlack+8192:]) {
				t.Fatal("RDMA_READ through a fast-reg key landed outside the memory it maps")
			}
		})
	}
}

// testSendWithInv: SEND_WITH_INV on a QP-bound region invalidates it at the receiver, whose
// receive reports WCWithInv and the key; the region is re-registered under the next key.
func testSendWithInv(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	f := c.srv.newFastReg(t, 4096, rdma.FastRegRemoteInv)
	key := c.srv.regMR(t, f, rw)
	c.writeAndCheck(t, 1, key, f.mr.Addr(), f.mem, 61)
	buf := c.srv.alloc(t, 64, lw)
	msg := c.cli.alloc(t, 64, lw)
	fill(msg.Bytes(), 62)
	c.srv.recv(t, 2, rdma.SGEOf(buf, 0, 64))
	c.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: key,
		SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}})
	wc := c.srv.expect(t, 2, rdma.WCRecv, rdma.WCSuccess)
	if wc.Flags&rdma.WCWithInv == 0 || wc.InvRKey != key || wc.Flags&rdma.WCWithImm != 0 || wc.ByteLen != 8 {
		t.Fatalf("SEND_WITH_INV's receive %s, want 8 bytes reporting the invalidation of %#x", fmtWC(wc), key)
	}
	if !bytes.Equal(buf.Bytes()[:8], msg.Bytes()[:8]) {
		t.Fatal("SEND_WITH_INV payload differs")
	}
	if f.mr.Valid() {
		t.Fatal("region still valid after the receive that reported its invalidation")
	}
	c.cli.expect(t, 2, rdma.WCSend, rdma.WCSuccess)
	key2 := c.srv.regMR(t, f, rw)
	if key2 == key {
		t.Fatalf("re-registered under the invalidated key %#x", key)
	}
	c.writeAndCheck(t, 3, key2, f.mr.Addr(), f.mem, 63)
}

// testSendWithInvRefused: a peer may not invalidate a PD-scoped fast-reg region nor a
// registered region: its SEND_WITH_INV fails as a remote invalid request, the connection
// fails, and the region stays valid for the PD's other QPs.
func testSendWithInvRefused(t *testing.T, env *Env) {
	for _, kind := range []string{"PD-scoped fast-reg region", "registered region"} {
		t.Run(kind, func(t *testing.T) {
			env.begin(t)
			c1 := connect(t, env, env.opts())
			o := env.opts()
			o.srvPD = c1.srv.pd
			c2 := connect(t, env, o)
			var tg target
			var region rdma.MR
			var mem []byte
			if kind == "registered region" {
				region = c1.srv.alloc(t, 4096, rw)
				tg, mem = target{region.RKey(), region.Addr()}, region.Bytes()
			} else {
				f := c1.srv.newFastReg(t, 4096, 0)
				tg = target{c1.srv.regMR(t, f, rw), f.mr.Addr()}
				region, mem = f.mr, f.mem
			}
			buf := c1.srv.alloc(t, 64, lw)
			msg := c1.cli.alloc(t, 64, lw)
			c1.srv.recv(t, 1, rdma.SGEOf(buf, 0, 64))
			c1.cli.recv(t, 12)
			c1.cli.post(t,
				rdma.SendWR{ID: 1, Opcode: rdma.OpSendWithInv, Flags: rdma.SendSignaled, InvRKey: tg.rkey, SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}},
				rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(msg, 0, 8)}})
			// The receiver refuses it: its receive completes with an error and its QP fails.
			// Whether the sender hears of it differs: soft NAKs (a remote invalid request),
			// rxe does not (the IB spec's class J error ends at the responder) and the
			// sender's SEND completes; either way the connection is over.
			if wc := c1.srv.next(t); wc.ID != 1 || wc.Status == rdma.WCSuccess {
				t.Fatalf("server: the refused SEND_WITH_INV's receive completed %s; want id 0x1 with an error", fmtWC(wc))
			}
			if wc := c1.cli.next(t); wc.ID != 1 || wc.Status != rdma.WCRemInvReqErr && wc.Status != rdma.WCSuccess {
				t.Fatalf("client: the refused SEND_WITH_INV completed %s; want a remote invalid request error or success", fmtWC(wc))
			}
			if !region.Valid() {
				t.Fatal("the peer invalidated a region it may not")
			}
			c2.writeAndCheck(t, 3, tg.rkey, tg.addr, mem, 71)
			c1.disconnect(t, c1.cli)
		})
	}
}
