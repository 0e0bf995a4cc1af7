package rdmatest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

const (
	// waitTimeout bounds every wait for something that must happen. It is generous: an RNR
	// retry on Soft-RoCE waits 655 ms, and a loaded CI machine is slow.
	waitTimeout = 30 * time.Second
	// quietPeriod is how long the suite watches for something that must not happen.
	quietPeriod = 100 * time.Millisecond
	// qd is the default queue depth of both queues of a QP.
	qd = 64
	// maxSGE is the default number of SGEs per request.
	maxSGE = 4
	// privLen is the private data each side sends: RTRS's 56 bytes, the most a CM REQ of the
	// TCP port space carries.
	privLen = 56
)

// Access shorthands.
const (
	lw = rdma.AccessLocalWrite
	rw = rdma.AccessLocalWrite | rdma.AccessRemoteWrite
	rr = rdma.AccessRemoteRead
)

// Work request ids the helpers use, apart from the ones cases choose.
const (
	idSync     = 0x5e5e0001
	idRegMR    = 0x5e5e0002
	idLocalInv = 0x5e5e0003
)

// side is one end of a connection under test and everything it owns. close releases it in
// the order verbs wants: the identifier (and its QP), the regions, their memory, the CQ, the
// PDs.
type side struct {
	name  string
	id    rdma.ConnID
	dev   rdma.Device
	pd    rdma.PD
	ownPD bool
	cq    rdma.CQ
	qp    rdma.QP
	mrs   []rdma.MR // deregistered last to first
	mem   [][]byte  // rdma.Alloc memory, freed after the regions
	pds   []rdma.PD // further PDs, deallocated after the regions
}

// close releases everything s holds; it reports what fails to be released.
func (s *side) close(t testing.TB) {
	errorf := func(what string, err error) {
		if err != nil && !errors.Is(err, rdma.ErrClosed) {
			t.Errorf("%s: %s: %v", s.name, what, err)
		}
	}
	if s.id != nil {
		errorf("destroying the identifier", s.id.Destroy())
	}
	for i := len(s.mrs) - 1; i >= 0; i-- {
		errorf("deregistering a region", s.mrs[i].Dereg())
	}
	for _, b := range s.mem {
		errorf("freeing memory", rdma.Free(b))
	}
	if s.cq != nil {
		errorf("destroying the CQ", s.cq.Destroy())
	}
	for _, p := range s.pds {
		errorf("deallocating a PD", p.Dealloc())
	}
	if s.ownPD && s.pd != nil {
		errorf("deallocating the PD", s.pd.Dealloc())
	}
}

// qpAttr is the default QP shape.
func qpAttr() rdma.QPInitAttr {
	return rdma.QPInitAttr{MaxSendWR: qd, MaxRecvWR: qd, MaxSendSGE: maxSGE, MaxRecvSGE: maxSGE}
}

// build gives s (whose id is set) a PD (pd, or a new one), a CQ and a QP of shape attr.
func (s *side) build(pd rdma.PD, attr rdma.QPInitAttr) error {
	s.dev = s.id.Device()
	if s.dev == nil {
		return fmt.Errorf("%s: identifier without a device", s.name)
	}
	var err error
	if pd == nil {
		if pd, err = s.dev.AllocPD(); err != nil {
			return fmt.Errorf("%s: AllocPD: %w", s.name, err)
		}
		s.ownPD = true
	}
	s.pd = pd
	if s.cq, err = s.dev.CreateCQ(max(4*qd, 2*(attr.MaxSendWR+attr.MaxRecvWR))); err != nil {
		return fmt.Errorf("%s: CreateCQ: %w", s.name, err)
	}
	attr.SendCQ, attr.RecvCQ = s.cq, s.cq
	if s.qp, err = s.id.CreateQP(s.pd, attr); err != nil {
		return fmt.Errorf("%s: CreateQP: %w", s.name, err)
	}
	return nil
}

// conn is a connected client/server pair.
type conn struct {
	env      *Env
	ln       rdma.Listener
	cli, srv *side
	cliData  []byte // private data the server received
	srvData  []byte // private data the client received
}

// opts shape a connection.
type opts struct {
	src              netip.Addr // client source address
	cliRNR, srvRNR   uint8      // RNR retry counts the connect and the accept carry
	cliAttr, srvAttr rdma.QPInitAttr
	srvPD            rdma.PD // the server's PD; nil: a new one
	cliPriv, srvPriv []byte
}

// opts returns the default connection shape: RNR retries for ever both ways, 56 bytes of
// private data each way.
func (e *Env) opts() opts {
	return opts{
		src: e.ClientAddr, cliRNR: 7, srvRNR: 7, cliAttr: qpAttr(), srvAttr: qpAttr(),
		cliPriv: pattern(privLen, 0xc1), srvPriv: pattern(privLen, 0x51),
	}
}

// ctxFor returns a context that ends after d or with the test.
func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// listen listens on the server address, port 0, closed when the test ends.
func (e *Env) listen(t testing.TB) rdma.Listener {
	t.Helper()
	ln, err := e.Provider.Listen(netip.AddrPortFrom(e.ServerAddr, 0), 16)
	if err != nil {
		t.Fatalf("listen on %v: %v", e.ServerAddr, err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	if ln.Addr().Port() == 0 {
		t.Fatalf("listener on %v reports port 0", ln.Addr())
	}
	return ln
}

// dest is where a client reaches ln.
func (e *Env) dest(ln rdma.Listener) netip.AddrPort {
	return netip.AddrPortFrom(e.ServerAddr, ln.Addr().Port())
}

// client resolves a client identifier from src to dst and gives it a QP of shape attr; it is
// released when the test ends.
func (e *Env) client(t testing.TB, ctx context.Context, src netip.Addr, dst netip.AddrPort, attr rdma.QPInitAttr) *side {
	t.Helper()
	s := &side{name: "client"}
	id, err := e.Provider.ResolveAddr(ctx, src, dst)
	if err != nil {
		t.Fatalf("resolving %v from %v: %v", dst, src, err)
	}
	s.id = id
	t.Cleanup(func() { s.close(t) })
	if err := s.build(nil, attr); err != nil {
		t.Fatal(err)
	}
	return s
}

// connect builds a connected pair: a fresh listener, a server that accepts one request on it
// and a client that connects from o.src.
func connect(t testing.TB, env *Env, o opts) *conn {
	t.Helper()
	c := &conn{env: env, ln: env.listen(t), srv: &side{name: "server"}}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	served := make(chan error, 1)
	go func() { served <- c.serve(ctx, o) }()
	waited := false
	t.Cleanup(func() {
		cancel()
		if !waited {
			<-served
		}
		c.srv.close(t)
	})
	c.cli = env.client(t, ctx, o.src, env.dest(c.ln), o.cliAttr)
	data, err := c.cli.id.Connect(ctx, rdma.ConnParam{PrivateData: o.cliPriv, RNRRetryCount: o.cliRNR})
	if err != nil {
		t.Fatalf("connect to %v: %v", env.dest(c.ln), err)
	}
	c.srvData = data
	waited = true
	if err := <-served; err != nil {
		t.Fatalf("server: %v", err)
	}
	return c
}

// serve accepts one connection request on c.ln and builds the server side for it.
func (c *conn) serve(ctx context.Context, o opts) error {
	req, err := c.ln.Accept(ctx)
	if err != nil {
		return fmt.Errorf("Listener.Accept: %w", err)
	}
	c.srv.id = req.ID
	c.cliData = req.PrivateData
	if err := c.srv.build(o.srvPD, o.srvAttr); err != nil {
		return err
	}
	if err := req.ID.Accept(ctx, rdma.ConnParam{PrivateData: o.srvPriv, RNRRetryCount: o.srvRNR}); err != nil {
		return fmt.Errorf("ConnID.Accept: %w", err)
	}
	return nil
}

// standalone returns a side with a PD on the device that serves the server address, and no
// connection (an identifier resolved to the server address, which needs no listener).
func (e *Env) standalone(t testing.TB) *side {
	t.Helper()
	ctx := ctxFor(t, waitTimeout)
	s := &side{name: "local"}
	id, err := e.Provider.ResolveAddr(ctx, e.ClientAddr, netip.AddrPortFrom(e.ServerAddr, 9))
	if err != nil {
		t.Fatalf("resolving %v from %v: %v", e.ServerAddr, e.ClientAddr, err)
	}
	s.id = id
	t.Cleanup(func() { s.close(t) })
	s.dev = id.Device()
	if s.pd, err = s.dev.AllocPD(); err != nil {
		t.Fatalf("AllocPD: %v", err)
	}
	s.ownPD = true
	return s
}

// alloc registers n bytes of provider memory (PD.AllocMR) on s's PD.
func (s *side) alloc(t testing.TB, n int, access rdma.Access) rdma.MR {
	t.Helper()
	return s.allocOn(t, s.pd, n, access)
}

// allocOn registers n bytes of provider memory on pd.
func (s *side) allocOn(t testing.TB, pd rdma.PD, n int, access rdma.Access) rdma.MR {
	t.Helper()
	m, err := pd.AllocMR(n, access)
	if err != nil {
		t.Fatalf("%s: AllocMR(%d, %v): %v", s.name, n, access, err)
	}
	s.mrs = append(s.mrs, m)
	checkRegion(t, m, n, access)
	return m
}

// memory maps n bytes with rdma.Alloc, freed after s's regions.
func (s *side) memory(t testing.TB, n int) []byte {
	t.Helper()
	b, err := rdma.Alloc(n)
	if err != nil {
		t.Fatalf("rdma.Alloc(%d): %v", n, err)
	}
	s.mem = append(s.mem, b)
	return b
}

// mapped registers n bytes of rdma.Alloc memory (PD.RegMR) on s's PD.
func (s *side) mapped(t testing.TB, n int, access rdma.Access) rdma.MR {
	t.Helper()
	b := s.memory(t, n)
	m, err := s.pd.RegMR(b, access)
	if err != nil {
		t.Fatalf("%s: RegMR(%d bytes, %v): %v", s.name, n, access, err)
	}
	s.mrs = append(s.mrs, m)
	checkRegion(t, m, n, access)
	if &m.Bytes()[0] != &b[0] {
		t.Fatalf("%s: RegMR's Bytes are not the memory registered", s.name)
	}
	return m
}

// checkRegion checks what a fresh registration reports.
func checkRegion(t testing.TB, m rdma.MR, n int, access rdma.Access) {
	t.Helper()
	if m.Len() != n || len(m.Bytes()) != n || m.Access() != access || !m.Valid() {
		t.Fatalf("new region: len %d, %d bytes, access %v, valid %v; want %d bytes, %v, valid",
			m.Len(), len(m.Bytes()), m.Access(), m.Valid(), n, access)
	}
}

// fastReg is a fast-registration region mapped over part of a registered region.
type fastReg struct {
	mr      rdma.MR
	backing rdma.MR // the registered region (LOCAL_WRITE) under it
	mem     []byte  // the part of backing it maps
}

// frSlack is the registered memory on either side of what a fast-reg region maps: an access
// just outside the region stays inside registered memory, so only the region's own bounds
// can refuse it.
const frSlack = 4096

// newFastReg allocates a fast-reg region of n bytes with flags and maps it over the middle of
// a fresh registered region; it is not valid until a REG_MR (regMR).
func (s *side) newFastReg(t testing.TB, n int, flags rdma.FastRegFlags) *fastReg {
	t.Helper()
	backing := s.mapped(t, n+2*frSlack, lw)
	m, err := s.pd.AllocFastRegMR(n, flags)
	if err != nil {
		t.Fatalf("%s: AllocFastRegMR(%d, %d): %v", s.name, n, flags, err)
	}
	s.mrs = append(s.mrs, m) // after backing: deregistered before it
	if m.Valid() {
		t.Fatalf("%s: a new fast-reg region is valid before its REG_MR", s.name)
	}
	return &fastReg{mr: m, backing: backing, mem: backing.Bytes()[frSlack : frSlack+n]}
}

// regMR maps f over its memory and makes it valid with access by a signaled REG_MR on s's QP
// with the next key, waiting for the completion; it returns the key.
func (s *side) regMR(t testing.TB, f *fastReg, access rdma.Access) uint32 {
	t.Helper()
	if err := f.mr.Map(f.mem, 0x5000_0000_0000); err != nil {
		t.Fatalf("%s: Map: %v", s.name, err)
	}
	key := rdma.IncKey(f.mr.RKey())
	s.post(t, rdma.SendWR{ID: idRegMR, Opcode: rdma.OpRegMR, Flags: rdma.SendSignaled, MR: f.mr, Key: key, Access: access})
	s.expect(t, idRegMR, rdma.WCRegMR, rdma.WCSuccess)
	if !f.mr.Valid() || f.mr.RKey() != key || f.mr.Len() != len(f.mem) || f.mr.Addr() == 0 {
		t.Fatalf("%s: after REG_MR: valid %v, rkey %#x (want %#x), len %d (want %d), addr %#x",
			s.name, f.mr.Valid(), f.mr.RKey(), key, f.mr.Len(), len(f.mem), f.mr.Addr())
	}
	return key
}

// localInv invalidates f's key by a signaled LOCAL_INV on s's QP, waiting for the completion.
func (s *side) localInv(t testing.TB, f *fastReg) {
	t.Helper()
	s.post(t, rdma.SendWR{ID: idLocalInv, Opcode: rdma.OpLocalInv, Flags: rdma.SendSignaled, InvRKey: f.mr.RKey()})
	s.expect(t, idLocalInv, rdma.WCLocalInv, rdma.WCSuccess)
	if f.mr.Valid() {
		t.Fatalf("%s: fast-reg region still valid after LOCAL_INV", s.name)
	}
}

// extraPD allocates another PD on s's device, deallocated after s's regions.
func (s *side) extraPD(t testing.TB) rdma.PD {
	t.Helper()
	p, err := s.dev.AllocPD()
	if err != nil {
		t.Fatalf("%s: AllocPD: %v", s.name, err)
	}
	s.pds = append(s.pds, p)
	return p
}

// post posts send requests, failing the test if the post fails.
func (s *side) post(t testing.TB, wrs ...rdma.SendWR) {
	t.Helper()
	if bad, err := s.qp.PostSend(wrs); err != nil {
		t.Fatalf("%s: PostSend (request %d of %d): %v", s.name, bad, len(wrs), err)
	}
}

// recv posts one receive with sges (none: a receive for WRITE_WITH_IMM or empty SENDs).
func (s *side) recv(t testing.TB, id uint64, sges ...rdma.SGE) {
	t.Helper()
	if _, err := s.qp.PostRecv([]rdma.RecvWR{{ID: id, SGList: sges}}); err != nil {
		t.Fatalf("%s: PostRecv: %v", s.name, err)
	}
}

// next returns the next completion on s's CQ, failing the test after waitTimeout.
func (s *side) next(t testing.TB) rdma.WC {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var wc [1]rdma.WC
	for {
		if s.cq.Poll(wc[:]) == 1 {
			if wc[0].QPNum != s.qp.Num() {
				t.Fatalf("%s: completion %s names QP %d, the CQ's only QP is %d", s.name, fmtWC(wc[0]), wc[0].QPNum, s.qp.Num())
			}
			return wc[0]
		}
		if err := s.cq.Wait(ctx); err != nil {
			t.Fatalf("%s: no completion within %v: %v", s.name, waitTimeout, err)
		}
	}
}

// fmtWC describes a completion for a failure message.
func fmtWC(wc rdma.WC) string {
	if wc.Status != rdma.WCSuccess {
		return fmt.Sprintf("{id %#x status %q qp %d}", wc.ID, wc.Status, wc.QPNum)
	}
	return fmt.Sprintf("{id %#x %v success flags %#x len %d imm %#x invrkey %#x qp %d}",
		wc.ID, wc.Opcode, wc.Flags, wc.ByteLen, wc.Imm, wc.InvRKey, wc.QPNum)
}

// expect waits for the next completion and checks its id and status, and its opcode if it
// succeeded (verbs define no opcode for a failed completion).
func (s *side) expect(t testing.TB, id uint64, op rdma.WCOpcode, st rdma.WCStatus) rdma.WC {
	t.Helper()
	wc := s.next(t)
	if wc.ID != id || wc.Status != st || (st == rdma.WCSuccess && wc.Opcode != op) {
		t.Fatalf("%s: completion %s, want id %#x %v %q", s.name, fmtWC(wc), id, op, st)
	}
	return wc
}

// expectSet waits for completions with exactly these ids and statuses, in any order (a QP's
// send and receive queues complete in no defined order to each other).
func (s *side) expectSet(t testing.TB, want map[uint64]rdma.WCStatus) {
	t.Helper()
	alt := make(map[uint64][]rdma.WCStatus, len(want))
	for id, st := range want {
		alt[id] = []rdma.WCStatus{st}
	}
	s.expectSetAny(t, alt)
}

// expectSetAny is expectSet where a request may end in any of the statuses listed for it
// (where HCAs differ in the status they report for the same fault).
func (s *side) expectSetAny(t testing.TB, want map[uint64][]rdma.WCStatus) {
	t.Helper()
	left := make(map[uint64][]rdma.WCStatus, len(want))
	for id, st := range want {
		left[id] = st
	}
	for len(left) > 0 {
		wc := s.next(t)
		st, ok := left[wc.ID]
		if !ok || !slices.Contains(st, wc.Status) {
			t.Fatalf("%s: completion %s; still expected %v", s.name, fmtWC(wc), left)
		}
		delete(left, wc.ID)
	}
}

// quiet checks that no completion arrives on s's CQ for quietPeriod.
func (s *side) quiet(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), quietPeriod)
	defer cancel()
	_ = s.cq.Wait(ctx)
	var wc [1]rdma.WC
	if s.cq.Poll(wc[:]) != 0 {
		t.Fatalf("%s: unexpected completion %s", s.name, fmtWC(wc[0]))
	}
}

// expectEvent waits for the identifier's next CM event and checks its type.
func (s *side) expectEvent(t testing.TB, typ rdma.CMEventType) rdma.CMEvent {
	t.Helper()
	ch := s.id.Events()
	if ch == nil {
		t.Fatalf("%s: Events() is nil on an established connection", s.name)
	}
	select {
	case ev := <-ch:
		if ev.Type != typ {
			t.Fatalf("%s: CM event %v (%v), want %v", s.name, ev.Type, ev.Err, typ)
		}
		return ev
	case <-time.After(waitTimeout):
		t.Fatalf("%s: no %v event within %v", s.name, typ, waitTimeout)
	}
	return rdma.CMEvent{}
}

// expectState checks s's QP state.
func (s *side) expectState(t testing.TB, st rdma.QPState) {
	t.Helper()
	if got := s.qp.State(); got != st {
		t.Fatalf("%s: QP state %v, want %v", s.name, got, st)
	}
}

// sync orders everything the client posted so far before what the server does next: a
// zero-length WRITE_WITH_IMM executes after the earlier requests, and its receive completion
// on the server's CQ is how a responder learns that one-sided data has landed (never from
// the requester's completion).
func (c *conn) sync(t testing.TB) {
	t.Helper()
	c.srv.recv(t, idSync)
	c.cli.post(t, rdma.SendWR{ID: idSync, Opcode: rdma.OpRDMAWriteWithImm, Imm: 0x5e5e})
	c.srv.expect(t, idSync, rdma.WCRecvRDMAWithImm, rdma.WCSuccess)
}

// disconnect disconnects from s and expects EventDisconnected on both sides.
func (c *conn) disconnect(t testing.TB, s *side) {
	t.Helper()
	if err := s.id.Disconnect(); err != nil {
		t.Fatalf("%s: Disconnect: %v", s.name, err)
	}
	c.cli.expectEvent(t, rdma.EventDisconnected)
	c.srv.expectEvent(t, rdma.EventDisconnected)
}

// pattern returns n bytes of a pattern that starts from seed and repeats only every 256
// bytes, so shifted or misplaced data shows.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	fill(b, seed)
	return b
}

// fill writes pattern bytes into b.
func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>8)
	}
}

// checkPriv checks private data that arrived: what was sent, then zeros only (the CM's fixed
// fields pad it).
func checkPriv(t testing.TB, what string, got, sent []byte) {
	t.Helper()
	if len(got) < len(sent) || !bytes.Equal(got[:len(sent)], sent) || !zero(got[len(sent):]) {
		t.Fatalf("%s: %d bytes %x, want the %d bytes sent %x (then zeros only)", what, len(got), got, len(sent), sent)
	}
}

// zero reports whether b holds only zeros.
func zero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
