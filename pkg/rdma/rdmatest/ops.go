package rdmatest

import (
	"bytes"
	"errors"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// testMRValidation: registration refuses what verbs refuse, a fast-reg region maps only what
// it can (and, with MapRegisteredOnly, only registered memory with local write), and a region
// deregisters once.
func testMRValidation(t *testing.T, env *Env) {
	s := env.standalone(t)
	attr := s.dev.Query()
	b := s.memory(t, 4096)
	for _, tc := range []struct {
		name   string
		buf    []byte
		access rdma.Access
	}{
		{"no memory", nil, lw},
		{"REMOTE_WRITE without LOCAL_WRITE", b, rdma.AccessRemoteWrite},
		{"unknown access bit", b, lw | 1<<7},
	} {
		if m, err := s.pd.RegMR(tc.buf, tc.access); !errors.Is(err, syscall.EINVAL) {
			if err == nil {
				s.mrs = append(s.mrs, m)
			}
			t.Errorf("RegMR, %s: %v, want EINVAL", tc.name, err)
		}
	}
	if m, err := s.pd.AllocMR(0, lw); !errors.Is(err, syscall.EINVAL) {
		if err == nil {
			s.mrs = append(s.mrs, m)
		}
		t.Errorf("AllocMR of 0 bytes: %v, want EINVAL", err)
	}
	m := s.mapped(t, 4096, lw)
	a := s.alloc(t, 8192, rw|rr)
	if !zero(a.Bytes()) {
		t.Error("AllocMR memory is not zeroed")
	}
	if m.LKey() == a.LKey() || m.RKey() == a.RKey() {
		t.Errorf("two regions share a key: lkeys %#x %#x, rkeys %#x %#x", m.LKey(), a.LKey(), m.RKey(), a.RKey())
	}
	if err := m.Map(a.Bytes()[:4096], 0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Map of a registered region: %v, want EINVAL", err)
	}
	for _, tc := range []struct {
		name  string
		n     int
		flags rdma.FastRegFlags
	}{{"no length", 0, 0}, {"unknown flag", 4096, 1 << 7}} {
		if fr, err := s.pd.AllocFastRegMR(tc.n, tc.flags); !errors.Is(err, syscall.EINVAL) {
			if err == nil {
				s.mrs = append(s.mrs, fr)
			}
			t.Errorf("AllocFastRegMR, %s: %v, want EINVAL", tc.name, err)
		}
	}
	for _, flags := range []rdma.FastRegFlags{0, rdma.FastRegRemoteInv} {
		f := s.newFastReg(t, 4096, flags)
		if err := f.mr.Map(f.backing.Bytes(), 0); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("fast-reg region of 4096 bytes (flags %d): Map of %d bytes: %v, want EINVAL", flags, f.backing.Len(), err)
		}
		if attr.MapRegisteredOnly {
			if err := f.mr.Map(b, 0); err == nil {
				t.Error("MapRegisteredOnly, yet Map took memory registered nowhere")
			}
			ro, err := s.pd.RegMR(s.memory(t, 4096), rr)
			if err != nil {
				t.Fatalf("RegMR: %v", err)
			}
			s.mrs = append(s.mrs, ro)
			if err := f.mr.Map(ro.Bytes(), 0); err == nil {
				t.Error("MapRegisteredOnly, yet Map took memory registered without LOCAL_WRITE")
			}
		}
		if err := f.mr.Map(f.mem, 0x5000_0000_0000); err != nil {
			t.Errorf("fast-reg region (flags %d): Map of registered memory: %v", flags, err)
		}
		if f.mr.Valid() {
			t.Errorf("fast-reg region (flags %d) valid after Map, before its REG_MR", flags)
		}
		if err := f.mr.Dereg(); err != nil {
			t.Errorf("Dereg of a fast-reg region: %v", err)
		}
		if err := f.mr.Dereg(); !errors.Is(err, rdma.ErrClosed) {
			t.Errorf("second Dereg of a fast-reg region: %v, want ErrClosed", err)
		}
	}
	if err := m.Dereg(); err != nil {
		t.Errorf("Dereg: %v", err)
	}
	if m.Valid() {
		t.Error("region valid after Dereg")
	}
	if err := m.Dereg(); !errors.Is(err, rdma.ErrClosed) {
		t.Errorf("second Dereg: %v, want ErrClosed", err)
	}
	if rdma.IncKey(0x123456ff) != 0x12345600 || rdma.IncKey(0x10) != 0x11 {
		t.Error("IncKey does not step the low byte alone")
	}
}

// testSend: SEND, SEND_WITH_IMM and an empty SEND land in order in the posted receives,
// scattered as the receives' SGE lists say, with byte counts and the immediate in host order.
func testSend(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	src := c.cli.mapped(t, 8192, lw) // rdma.Alloc memory
	dst := c.srv.alloc(t, 8192, lw)  // provider memory
	fill(src.Bytes(), 3)
	// Two SGEs on each side, split differently: the receive's list decides the scatter.
	if _, err := c.srv.qp.PostRecv([]rdma.RecvWR{
		{ID: 7, SGList: []rdma.SGE{rdma.SGEOf(dst, 0, 100), rdma.SGEOf(dst, 1000, 5000)}},
		{ID: 8, SGList: []rdma.SGE{rdma.SGEOf(dst, 6000, 100)}},
	}); err != nil {
		t.Fatal(err)
	}
	c.srv.recv(t, 9, rdma.SGEOf(dst, 7000, 100))
	c.cli.post(t,
		rdma.SendWR{ID: 1, Opcode: rdma.OpSend, Flags: rdma.SendSignaled,
			SGList: []rdma.SGE{rdma.SGEOf(src, 0, 3000), rdma.SGEOf(src, 4000, 10)}},
		rdma.SendWR{ID: 2, Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled | rdma.SendSolicited, Imm: 0x12345678,
			SGList: []rdma.SGE{rdma.SGEOf(src, 100, 64)}},
		rdma.SendWR{ID: 3, Opcode: rdma.OpSend, Flags: rdma.SendSignaled})
	wc := c.srv.expect(t, 7, rdma.WCRecv, rdma.WCSuccess)
	if wc.ByteLen != 3010 || wc.Flags&(rdma.WCWithImm|rdma.WCWithInv) != 0 {
		t.Fatalf("SEND's receive %s, want 3010 bytes, no immediate, no invalidation", fmtWC(wc))
	}
	want := append(append([]byte{}, src.Bytes()[:3000]...), src.Bytes()[4000:4010]...)
	got := append(append([]byte{}, dst.Bytes()[:100]...), dst.Bytes()[1000:1000+2910]...)
	if !bytes.Equal(got, want) {
		t.Fatal("SEND payload not gathered and scattered as posted")
	}
	if !zero(dst.Bytes()[100:1000]) || !zero(dst.Bytes()[1000+2910:6000]) {
		t.Fatal("SEND wrote outside what its receive's SGEs cover")
	}
	wc = c.srv.expect(t, 8, rdma.WCRecv, rdma.WCSuccess)
	if wc.ByteLen != 64 || wc.Flags&rdma.WCWithImm == 0 || wc.Imm != 0x12345678 || wc.Flags&rdma.WCWithInv != 0 {
		t.Fatalf("SEND_WITH_IMM's receive %s, want 64 bytes with immediate 0x12345678", fmtWC(wc))
	}
	if !bytes.Equal(dst.Bytes()[6000:6064], src.Bytes()[100:164]) {
		t.Fatal("SEND_WITH_IMM payload differs")
	}
	if wc = c.srv.expect(t, 9, rdma.WCRecv, rdma.WCSuccess); wc.ByteLen != 0 || wc.Flags&(rdma.WCWithImm|rdma.WCWithInv) != 0 {
		t.Fatalf("empty SEND's receive %s", fmtWC(wc))
	}
	for id := uint64(1); id <= 3; id++ {
		c.cli.expect(t, id, rdma.WCSend, rdma.WCSuccess)
	}
	// The other way, with the immediate's top bit set.
	back := c.cli.alloc(t, 64, lw)
	c.cli.recv(t, 20, rdma.SGEOf(back, 0, 64))
	c.srv.post(t, rdma.SendWR{ID: 21, Opcode: rdma.OpSendWithImm, Flags: rdma.SendSignaled, Imm: 0x80000001,
		SGList: []rdma.SGE{rdma.SGEOf(dst, 0, 32)}})
	if wc := c.cli.expect(t, 20, rdma.WCRecv, rdma.WCSuccess); wc.ByteLen != 32 || wc.Flags&rdma.WCWithImm == 0 || wc.Imm != 0x80000001 {
		t.Fatalf("server's SEND_WITH_IMM arrived as %s", fmtWC(wc))
	}
	if !bytes.Equal(back.Bytes()[:32], dst.Bytes()[:32]) {
		t.Fatal("server's SEND payload differs")
	}
	c.srv.expect(t, 21, rdma.WCSend, rdma.WCSuccess)
}

// testRDMAWrite: RDMA_WRITE gathers its SGEs into remote memory and consumes no receive;
// RDMA_WRITE_WITH_IMM consumes one and reports the immediate and the length; a zero-length
// WRITE_WITH_IMM with no key (the RTRS heartbeat) only delivers the immediate.
func testRDMAWrite(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	src := c.cli.alloc(t, 1<<20, lw)
	dst := c.srv.mapped(t, 1<<20, rw)
	fill(src.Bytes(), 9)
	c.srv.recv(t, 5)
	c.srv.recv(t, 6)
	c.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList:     []rdma.SGE{rdma.SGEOf(src, 0, 256<<10), rdma.SGEOf(src, 300<<10, 256<<10)},
		RemoteAddr: dst.Addr() + 4096, RKey: dst.RKey()})
	c.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
	c.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWriteWithImm, Flags: rdma.SendSignaled, Imm: 0x12345678,
		SGList: []rdma.SGE{rdma.SGEOf(src, 100, 1000)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	// Receive 5, not 6: the plain write before consumed none.
	wc := c.srv.expect(t, 5, rdma.WCRecvRDMAWithImm, rdma.WCSuccess)
	if wc.Flags&rdma.WCWithImm == 0 || wc.Imm != 0x12345678 || wc.ByteLen != 1000 {
		t.Fatalf("RDMA_WRITE_WITH_IMM's receive %s, want immediate 0x12345678 and 1000 bytes", fmtWC(wc))
	}
	c.cli.expect(t, 2, rdma.WCRDMAWrite, rdma.WCSuccess)
	want := append(append([]byte{}, src.Bytes()[:256<<10]...), src.Bytes()[300<<10:556<<10]...)
	if !bytes.Equal(dst.Bytes()[4096:4096+512<<10], want) {
		t.Fatal("RDMA_WRITE data differs")
	}
	if !bytes.Equal(dst.Bytes()[:1000], src.Bytes()[100:1100]) {
		t.Fatal("RDMA_WRITE_WITH_IMM data differs")
	}
	if !zero(dst.Bytes()[1000:4096]) || !zero(dst.Bytes()[4096+512<<10:]) {
		t.Fatal("RDMA_WRITE wrote outside its range")
	}
	// Zero-length WRITE_WITH_IMM without a key: no memory is touched, so none is checked.
	c.cli.post(t, rdma.SendWR{ID: 3, Opcode: rdma.OpRDMAWriteWithImm, Flags: rdma.SendSignaled, Imm: 0x80000000})
	if wc := c.srv.expect(t, 6, rdma.WCRecvRDMAWithImm, rdma.WCSuccess); wc.Flags&rdma.WCWithImm == 0 || wc.Imm != 0x80000000 || wc.ByteLen != 0 {
		t.Fatalf("zero-length RDMA_WRITE_WITH_IMM's receive %s", fmtWC(wc))
	}
	c.cli.expect(t, 3, rdma.WCRDMAWrite, rdma.WCSuccess)
}

// testRDMARead: RDMA_READ scatters remote memory into several local SGEs, reports its length,
// involves nothing at the responder, and sees an RDMA_WRITE posted before it on the same QP.
func testRDMARead(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	remote := c.srv.alloc(t, 256<<10, rw|rr)
	fill(remote.Bytes(), 77)
	local := c.cli.mapped(t, 256<<10, lw)
	c.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList:     []rdma.SGE{rdma.SGEOf(local, 0, 1000), rdma.SGEOf(local, 2000, 127<<10)},
		RemoteAddr: remote.Addr() + 50, RKey: remote.RKey()})
	wc := c.cli.expect(t, 1, rdma.WCRDMARead, rdma.WCSuccess)
	if wc.ByteLen != 1000+127<<10 {
		t.Fatalf("RDMA_READ completion %s, want %d bytes", fmtWC(wc), 1000+127<<10)
	}
	r := remote.Bytes()[50:]
	if !bytes.Equal(local.Bytes()[:1000], r[:1000]) || !bytes.Equal(local.Bytes()[2000:2000+127<<10], r[1000:1000+127<<10]) {
		t.Fatal("RDMA_READ data differs")
	}
	if !zero(local.Bytes()[1000:2000]) || !zero(local.Bytes()[2000+127<<10:]) {
		t.Fatal("RDMA_READ wrote outside its SGEs")
	}
	c.srv.quiet(t) // one-sided: nothing at the responder

	// WRITE then READ of the same remote bytes, unsignaled write: the read sees the write.
	src := c.cli.alloc(t, 4096, lw)
	fill(src.Bytes(), 5)
	clear(local.Bytes())
	c.cli.post(t,
		rdma.SendWR{ID: 2, Opcode: rdma.OpRDMAWrite, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 4096)}, RemoteAddr: remote.Addr() + 8192, RKey: remote.RKey()},
		rdma.SendWR{ID: 3, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(local, 0, 4096)}, RemoteAddr: remote.Addr() + 8192, RKey: remote.RKey()})
	c.cli.expect(t, 3, rdma.WCRDMARead, rdma.WCSuccess)
	if !bytes.Equal(local.Bytes()[:4096], src.Bytes()) {
		t.Fatal("RDMA_READ after RDMA_WRITE on the same QP does not see the write")
	}
}

// postAll posts wrs one at a time, in order. When the send queue is full it takes a
// completion (appended to done) to make room, as a consumer of a real HCA must: unsignaled
// requests free their slots only with a later signaled completion.
func (s *side) postAll(t testing.TB, wrs []rdma.SendWR, done *[]rdma.WC) {
	t.Helper()
	for i := range wrs {
		for {
			_, err := s.qp.PostSend(wrs[i : i+1])
			if err == nil {
				break
			}
			if !errors.Is(err, syscall.ENOMEM) {
				t.Fatalf("%s: PostSend of request %d: %v", s.name, i, err)
			}
			*done = append(*done, s.next(t))
		}
	}
}

// testUnsignaledAndOrder: of many requests, more than the send queue holds, only the signaled
// ones complete, in the order posted, and the unsignaled ones still execute; local operations
// (REG_MR, LOCAL_INV) complete in order behind wire requests.
func testUnsignaledAndOrder(t *testing.T, env *Env) {
	c := connect(t, env, env.opts())
	const n, every, chunk = 4 * qd, 16, 64
	src := c.cli.alloc(t, n*chunk, lw)
	dst := c.srv.alloc(t, n*chunk, rw)
	fill(src.Bytes(), 11)
	wrs := make([]rdma.SendWR, n)
	for i := range wrs {
		wrs[i] = rdma.SendWR{ID: uint64(i), Opcode: rdma.OpRDMAWrite,
			SGList: []rdma.SGE{rdma.SGEOf(src, i*chunk, chunk)}, RemoteAddr: dst.Addr() + uint64(i*chunk), RKey: dst.RKey()}
		if i%every == every-1 {
			wrs[i].Flags = rdma.SendSignaled
		}
	}
	var done []rdma.WC
	c.cli.postAll(t, wrs, &done)
	for len(done) < n/every {
		done = append(done, c.cli.next(t))
	}
	for k, wc := range done {
		if want := uint64(k*every + every - 1); wc.ID != want || wc.Status != rdma.WCSuccess || wc.Opcode != rdma.WCRDMAWrite {
			t.Fatalf("completion %d: %s, want id %d RDMA_WRITE success (signaled requests only, in order)", k, fmtWC(wc), want)
		}
	}
	c.sync(t)
	if !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatal("unsignaled RDMA_WRITEs did not all land")
	}

	// REG_MR and LOCAL_INV, signaled, each behind an unsignaled write in the same post.
	f := c.cli.newFastReg(t, 4096, rdma.FastRegRemoteInv)
	if err := f.mr.Map(f.mem, 0x6000_0000_0000); err != nil {
		t.Fatal(err)
	}
	key := rdma.IncKey(f.mr.RKey())
	write := rdma.SendWR{ID: 100, Opcode: rdma.OpRDMAWrite, SGList: []rdma.SGE{rdma.SGEOf(src, 0, chunk)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}
	c.cli.post(t, write, rdma.SendWR{ID: 101, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: f.mr, Key: key, Access: lw})
	c.cli.expect(t, 101, rdma.WCRegMR, rdma.WCSuccess)
	if !f.mr.Valid() || f.mr.RKey() != key {
		t.Fatalf("after REG_MR: valid %v, key %#x, want %#x", f.mr.Valid(), f.mr.RKey(), key)
	}
	write.ID = 102
	c.cli.post(t, write, rdma.SendWR{ID: 103, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: key})
	c.cli.expect(t, 103, rdma.WCLocalInv, rdma.WCSuccess)
	if f.mr.Valid() {
		t.Fatal("fast-reg region valid after LOCAL_INV")
	}
	// A signaled write behind them completes alone: nothing unsignaled completed meanwhile.
	write.ID, write.Flags = 104, rdma.SendSignaled
	c.cli.post(t, write)
	c.cli.expect(t, 104, rdma.WCRDMAWrite, rdma.WCSuccess)
	c.cli.quiet(t)
	c.srv.quiet(t)
}

// testQueueLimits: requests the provider cannot take are refused at post time, with the index
// of the first one not posted; the ones before it were posted and complete.
func testQueueLimits(t *testing.T, env *Env) {
	const depth, tries = 8, 8*8 + 1
	o := env.opts()
	o.cliAttr.MaxSendWR, o.cliAttr.MaxRecvWR = depth, depth
	o.srvAttr.MaxRecvWR = 2 * tries
	c := connect(t, env, o)
	src := c.cli.alloc(t, 64, lw)
	maxSGEs := make([]rdma.SGE, c.cli.dev.Query().MaxSGE+1)
	for i := range maxSGEs {
		maxSGEs[i] = rdma.SGEOf(src, 0, 1)
	}
	for _, tc := range []struct {
		name string
		wr   rdma.SendWR
	}{
		{"unknown opcode", rdma.SendWR{Opcode: rdma.Opcode(99)}},
		{"more SGEs than the device has", rdma.SendWR{Opcode: rdma.OpSend, SGList: maxSGEs}},
		{"REG_MR without a region", rdma.SendWR{Opcode: rdma.OpRegMR, Key: 1, Access: lw}},
	} {
		if bad, err := c.cli.qp.PostSend([]rdma.SendWR{tc.wr}); !errors.Is(err, syscall.EINVAL) || bad != 0 {
			t.Fatalf("PostSend, %s: bad %d, %v; want 0, EINVAL", tc.name, bad, err)
		}
	}
	if bad, err := c.cli.qp.PostRecv([]rdma.RecvWR{{SGList: maxSGEs}}); !errors.Is(err, syscall.EINVAL) || bad != 0 {
		t.Fatalf("PostRecv with more SGEs than the device has: bad %d, %v; want 0, EINVAL", bad, err)
	}
	c.cli.quiet(t) // refused requests leave no trace

	// Sends with no receive at the server wait (RNR, retried for ever) and fill the queue.
	wrs := make([]rdma.SendWR, tries)
	for i := range wrs {
		wrs[i] = rdma.SendWR{ID: uint64(i), Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, i%8, 8)}}
	}
	bad, err := c.cli.qp.PostSend(wrs)
	if !errors.Is(err, syscall.ENOMEM) || bad < depth || bad >= tries || (env.ExactQueueSizes && bad != depth) {
		t.Fatalf("posting %d sends on a send queue of %d: bad %d, %v; want ENOMEM at %d or later", tries, depth, bad, err, depth)
	}
	recvs := make([]rdma.RecvWR, tries)
	for i := range recvs {
		recvs[i].ID = uint64(2000 + i)
	}
	rbad, err := c.cli.qp.PostRecv(recvs)
	if !errors.Is(err, syscall.ENOMEM) || rbad < depth || rbad >= tries || (env.ExactQueueSizes && rbad != depth) {
		t.Fatalf("posting %d receives on a receive queue of %d: bad %d, %v; want ENOMEM at %d or later", tries, depth, rbad, err, depth)
	}
	// The posted sends get their receives and complete, in order.
	dst := c.srv.alloc(t, tries*8, lw)
	for i := range bad {
		c.srv.recv(t, uint64(i), rdma.SGEOf(dst, i*8, 8))
	}
	for i := range bad {
		c.cli.expect(t, uint64(i), rdma.WCSend, rdma.WCSuccess)
		if wc := c.srv.expect(t, uint64(i), rdma.WCRecv, rdma.WCSuccess); wc.ByteLen != 8 || !bytes.Equal(dst.Bytes()[i*8:i*8+8], src.Bytes()[i%8:i%8+8]) {
			t.Fatalf("receive %d: %s, data %x", i, fmtWC(wc), dst.Bytes()[i*8:i*8+8])
		}
	}
	// The queue has room again.
	for i := range depth {
		c.srv.recv(t, uint64(1000+i), rdma.SGEOf(dst, 0, 8))
	}
	for i := range wrs[:depth] {
		wrs[i].ID = uint64(1000 + i)
	}
	c.cli.post(t, wrs[:depth]...)
	for i := range depth {
		c.cli.expect(t, uint64(1000+i), rdma.WCSend, rdma.WCSuccess)
		c.srv.expect(t, uint64(1000+i), rdma.WCRecv, rdma.WCSuccess)
	}
	// The receives the client posted before the full queue refused one are flushed by the
	// disconnect, once each.
	c.disconnect(t, c.cli)
	seen := map[uint64]bool{}
	for range rbad {
		wc := c.cli.next(t)
		if wc.Status != rdma.WCFlushErr || seen[wc.ID] || wc.ID < 2000 || wc.ID >= 2000+uint64(rbad) {
			t.Fatalf("after disconnect: %s (flushed so far %v)", fmtWC(wc), seen)
		}
		seen[wc.ID] = true
	}
	c.cli.quiet(t)
}
