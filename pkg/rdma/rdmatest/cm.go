package rdmatest

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// testConnect: a connection carries 56 bytes of private data each way, both QPs are in RTS on
// a listed device with an active port, the addresses agree on both sides, and the QPs talk to
// each other.
func testConnect(t *testing.T, env *Env) {
	if env.Provider.Name() == "" {
		t.Error("provider without a name")
	}
	o := env.opts()
	c := connect(t, env, o)
	checkPriv(t, "private data the server received", c.cliData, o.cliPriv)
	checkPriv(t, "private data the client received", c.srvData, o.srvPriv)

	at := env.dest(c.ln)
	if got := c.ln.Addr(); got != at {
		t.Errorf("listener address %v, want %v", got, at)
	}
	if got := c.cli.id.RemoteAddr(); got != at {
		t.Errorf("client's remote address %v, want %v", got, at)
	}
	if got := c.srv.id.LocalAddr(); got != at {
		t.Errorf("server's local address %v, want %v", got, at)
	}
	if cl, sr := c.cli.id.LocalAddr(), c.srv.id.RemoteAddr(); cl != sr || cl.Port() == 0 {
		t.Errorf("client's local address %v, server's remote address %v: want one and the same, with a port", cl, sr)
	}
	if env.ClientAddr.IsValid() && c.cli.id.LocalAddr().Addr() != env.ClientAddr {
		t.Errorf("client's local address %v, want %v", c.cli.id.LocalAddr(), env.ClientAddr)
	}

	devs, err := env.Provider.Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	for _, s := range []*side{c.cli, c.srv} {
		if s.id.QP() != s.qp {
			t.Errorf("%s: ConnID.QP() is not the QP CreateQP returned", s.name)
		}
		s.expectState(t, rdma.QPSRTS)
		name := s.dev.Name()
		if !slices.ContainsFunc(devs, func(d rdma.DeviceInfo) bool { return d.Name == name }) {
			t.Errorf("%s: device %q is not among the provider's devices %v", s.name, name, devs)
		}
		a := s.dev.Query()
		if a.MaxQPWR < qd || a.MaxSGE < maxSGE || a.MaxCQE < 4*qd || a.MaxMRSize < 1<<20 || a.MaxMsgSize < 1<<20 || a.PhysPortCnt < 1 {
			t.Errorf("%s: device %q attributes %+v: too small for this suite", s.name, name, a)
		}
		port := s.id.Port()
		if port < 1 || port > a.PhysPortCnt {
			t.Errorf("%s: port %d of a device with %d", s.name, port, a.PhysPortCnt)
		}
		pa, err := s.dev.QueryPort(port)
		if err != nil || pa.State != rdma.PortActive || pa.MTU <= 0 || pa.LinkLayer == "" {
			t.Errorf("%s: port %d: %+v %v; want an active port with its MTU and link layer", s.name, port, pa, err)
		}
		if _, err := s.dev.QueryPort(a.PhysPortCnt + 1); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: QueryPort(%d) of a device with %d ports: %v, want EINVAL", s.name, a.PhysPortCnt+1, a.PhysPortCnt, err)
		}
	}
	d, err := env.Provider.OpenDevice(c.cli.dev.Name())
	if err != nil || d.Name() != c.cli.dev.Name() {
		t.Errorf("OpenDevice(%q): %v", c.cli.dev.Name(), err)
	} else if err := d.Close(); err != nil {
		t.Errorf("closing device %q: %v", d.Name(), err)
	}
	if _, err := env.Provider.OpenDevice("rdmatest_no_such_device"); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("OpenDevice of an unknown name: %v, want ENODEV", err)
	}

	// A message each way: the QPs are connected to each other.
	for _, dir := range [][2]*side{{c.cli, c.srv}, {c.srv, c.cli}} {
		from, to := dir[0], dir[1]
		src, dst := from.alloc(t, 64, lw), to.alloc(t, 64, lw)
		fill(src.Bytes(), 0x33)
		to.recv(t, 1, rdma.SGEOf(dst, 0, 64))
		from.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpSend, Flags: rdma.SendSignaled, SGList: []rdma.SGE{rdma.SGEOf(src, 0, 64)}})
		if wc := to.expect(t, 1, rdma.WCRecv, rdma.WCSuccess); wc.ByteLen != 64 || !bytes.Equal(dst.Bytes(), src.Bytes()) {
			t.Fatalf("%s to %s: %s, data %x", from.name, to.name, fmtWC(wc), dst.Bytes())
		}
		from.expect(t, 2, rdma.WCSend, rdma.WCSuccess)
	}
}

// testSourceAddress: the source address given to ResolveAddr is the one the peer sees, for
// the route's choice, ClientAddr and AltClientAddr.
func testSourceAddress(t *testing.T, env *Env) {
	for _, tc := range []struct {
		name string
		src  netip.Addr
	}{{"route", netip.Addr{}}, {"ClientAddr", env.ClientAddr}, {"AltClientAddr", env.AltClientAddr}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name != "route" && !tc.src.IsValid() {
				t.Skipf("Env.%s not set", tc.name)
			}
			env.begin(t)
			o := env.opts()
			o.src = tc.src
			c := connect(t, env, o)
			got := c.srv.id.RemoteAddr()
			if got != c.cli.id.LocalAddr() || (tc.src.IsValid() && got.Addr() != tc.src) {
				t.Fatalf("server sees the client at %v, client is at %v; source asked for %v", got, c.cli.id.LocalAddr(), tc.src)
			}
			src, dst := c.cli.alloc(t, 100, lw), c.srv.alloc(t, 100, rw)
			fill(src.Bytes(), 42)
			c.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
				SGList: []rdma.SGE{rdma.SGEOf(src, 0, 100)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
			c.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
			c.sync(t)
			if !bytes.Equal(src.Bytes(), dst.Bytes()) {
				t.Fatal("RDMA_WRITE data differs")
			}
		})
	}
}

// testReject: a reject carries the rejecting side's private data (RTRS's 56-byte conn_rsp) to
// the connector as *rdma.RejectError.
func testReject(t *testing.T, env *Env) {
	ctx := ctxFor(t, waitTimeout)
	ln := env.listen(t)
	req := pattern(privLen, 0x77)
	rsp := make([]byte, privLen)
	rsp[0], rsp[1], rsp[4], rsp[5] = 0x52, 0x54, 0xef, 0xff // -17 (EEXIST) as RTRS's conn_rsp carries it
	srv := &side{name: "server"}
	rejected := make(chan error, 1)
	go func() {
		r, err := ln.Accept(ctx)
		if err != nil {
			rejected <- err
			return
		}
		srv.id = r.ID
		if len(r.PrivateData) < len(req) || !bytes.Equal(r.PrivateData[:len(req)], req) {
			rejected <- errors.New("the request's private data differs")
			_ = r.ID.Reject(nil)
			return
		}
		rejected <- r.ID.Reject(rsp)
	}()
	waited := false
	t.Cleanup(func() {
		if !waited {
			<-rejected
		}
		srv.close(t)
	})
	cli := env.client(t, ctx, env.ClientAddr, env.dest(ln), qpAttr())
	_, err := cli.id.Connect(ctx, rdma.ConnParam{PrivateData: req, RNRRetryCount: 7})
	waited = true
	if err := <-rejected; err != nil {
		t.Fatalf("server: %v", err)
	}
	r, ok := rdma.IsReject(err)
	if !ok || r.NoListener || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect answered by a reject: %v, want a *rdma.RejectError (ECONNREFUSED) with private data", err)
	}
	checkPriv(t, "reject's private data", r.PrivateData, rsp)
}

// testConnectFailures: a connect fails, without hanging, when nothing listens at the
// destination, and ends at its context's deadline when the listener never answers.
func testConnectFailures(t *testing.T, env *Env) {
	t.Run("no listener", func(t *testing.T) {
		env.begin(t)
		ln := env.listen(t)
		dst := env.dest(ln)
		if err := ln.Close(); err != nil {
			t.Fatalf("closing the listener: %v", err)
		}
		ctx := ctxFor(t, waitTimeout)
		cli := env.client(t, ctx, env.ClientAddr, dst, qpAttr())
		start := time.Now()
		_, err := cli.id.Connect(ctx, rdma.ConnParam{PrivateData: pattern(privLen, 1)})
		if err == nil {
			t.Fatalf("connect to %v, where nothing listens, succeeded", dst)
		}
		if errors.Is(err, syscall.ETIMEDOUT) || errors.Is(err, context.DeadlineExceeded) || time.Since(start) > waitTimeout/2 {
			t.Fatalf("connect to %v, where nothing listens: %v after %v; want a prompt failure", dst, err, time.Since(start))
		}
	})
	t.Run("silent listener", func(t *testing.T) {
		env.begin(t)
		ln := env.listen(t) // never accepts
		cli := env.client(t, ctxFor(t, waitTimeout), env.ClientAddr, env.dest(ln), qpAttr())
		const deadline = 500 * time.Millisecond
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		start := time.Now()
		_, err := cli.id.Connect(ctx, rdma.ConnParam{})
		if !errors.Is(err, syscall.ETIMEDOUT) || time.Since(start) > deadline+10*time.Second {
			t.Fatalf("connect to a listener that never answers: %v after %v; want ETIMEDOUT at the %v deadline", err, time.Since(start), deadline)
		}
	})
}
