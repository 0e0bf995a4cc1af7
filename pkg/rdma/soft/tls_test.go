package soft

import (
	"bytes"
	"context"
	"crypto/tls"
	"net/netip"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// tlsServer is a provider that requires client certificates of pki.
func tlsServer(t *testing.T, pki *testutil.PKI) *Provider {
	return New(Options{TLS: &tls.Config{Certificates: []tls.Certificate{pki.Issue(t, "server", true)},
		ClientCAs: pki.Pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}})
}

// dialTLS connects a client end of provider p to addr.
func dialTLS(t *testing.T, p *Provider, addr netip.AddrPort) (*end, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := p.ResolveAddr(ctx, netip.Addr{}, addr)
	if err != nil {
		t.Fatal(err)
	}
	e := &end{id: id, dev: id.Device()}
	e.pd, _ = e.dev.AllocPD()
	e.cq, _ = e.dev.CreateCQ(4 * testQD)
	if e.qp, err = id.CreateQP(e.pd, qpAttr(e.cq)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = id.Destroy(); _ = e.cq.Destroy() })
	_, err = id.Connect(ctx, rdma.ConnParam{RNRRetryCount: 7})
	return e, err
}

// Mutual TLS: a client with a certificate of the server's CA connects, moves data both ways
// and is known by its certificate's subject; one with a certificate of another CA, or none,
// or that does not trust the server's CA, does not connect.
func TestMutualTLS(t *testing.T) {
	pki, other := testutil.NewPKI(t, "rtrs-ca"), testutil.NewPKI(t, "other-ca")
	srv := tlsServer(t, pki)
	accepted, addr := acceptOne(t, srv)

	cli := New(Options{TLS: &tls.Config{Certificates: []tls.Certificate{pki.Issue(t, "client-a", false)},
		RootCAs: pki.Pool, MinVersion: tls.VersionTLS13}})
	c, err := dialTLS(t, cli, addr)
	if err != nil {
		t.Fatalf("client with a certificate of the CA: %v", err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("server did not accept")
	}
	if got := s.id.(rdma.Authenticated).PeerSubject(); got != "CN=client-a" {
		t.Fatalf("server sees subject %q", got)
	}
	if got := c.id.(rdma.Authenticated).PeerSubject(); got != "CN=server" {
		t.Fatalf("client sees subject %q", got)
	}
	remote := s.reg(t, 1<<20, rdma.AccessLocalWrite|rdma.AccessRemoteWrite|rdma.AccessRemoteRead)
	local := c.reg(t, 1<<20, rdma.AccessLocalWrite)
	fill(local.Bytes(), 5)
	c.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(local, 0, 1<<20)}, RemoteAddr: remote.Addr(), RKey: remote.RKey()})
	c.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
	if !bytes.Equal(remote.Bytes(), local.Bytes()) {
		t.Fatal("the write inside TLS did not land")
	}
	back := c.reg(t, 4096, rdma.AccessLocalWrite)
	c.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(back, 0, 4096)}, RemoteAddr: remote.Addr() + 8192, RKey: remote.RKey()})
	c.expect(t, 2, rdma.WCRDMARead, rdma.WCSuccess)
	if !bytes.Equal(back.Bytes(), local.Bytes()[8192:8192+4096]) {
		t.Fatal("the read inside TLS returned other data")
	}

	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{
		{"certificate of another CA", &tls.Config{Certificates: []tls.Certificate{other.Issue(t, "intruder", false)}, RootCAs: pki.Pool, MinVersion: tls.VersionTLS13}},
		{"no certificate", &tls.Config{RootCAs: pki.Pool, MinVersion: tls.VersionTLS13}},
		{"server of an untrusted CA", &tls.Config{Certificates: []tls.Certificate{other.Issue(t, "client-b", false)}, RootCAs: other.Pool, MinVersion: tls.VersionTLS13}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, addr := acceptOne(t, srv)
			if _, err := dialTLS(t, New(Options{TLS: tc.cfg}), addr); err == nil {
				t.Fatal("connected")
			}
		})
	}
}
