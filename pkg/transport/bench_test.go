package transport

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/netip"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

// BenchmarkRequest measures synchronous 4 KiB requests at QD1 over one path, client and
// server in this process.
func BenchmarkRequest(b *testing.B) {
	for _, inv := range []bool{true, false} {
		for _, dir := range []Dir{Read, Write} {
			b.Run(fmt.Sprintf("%v/always_invalidate=%v", dir, inv), func(b *testing.B) {
				e := newEnv(b, inv, 128)
				s := e.open(b, "bench", paths(b, "ip:127.0.0.1@ip:127.0.0.1"), func(o *ClientOptions) { o.ConPerPath = 2 })
				buf, hdr := make([]byte, 4096), offHdr(4096)
				ctx := context.Background()
				b.SetBytes(4096)
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := s.Do(ctx, dir, hdr, buf); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkRequestQD32 keeps 32 asynchronous 4 KiB reads in flight over one path.
func BenchmarkRequestQD32(b *testing.B) {
	for _, inv := range []bool{true, false} {
		b.Run(fmt.Sprintf("always_invalidate=%v", inv), func(b *testing.B) { benchQD32(b, inv) })
	}
}

func benchQD32(b *testing.B, inv bool) {
	e := newEnv(b, inv, 128)
	benchInflight(b, e.open(b, "bench32", paths(b, "ip:127.0.0.1@ip:127.0.0.1"), nil), Read, 4096, 32)
}

// BenchmarkTLS compares the soft provider with and without mutual TLS: 4 KiB reads at QD32
// and 1 MiB writes at QD8, one path, client and server in this process.
func BenchmarkTLS(b *testing.B) {
	pki := testutil.NewPKI(b, "bench-ca")
	node := pki.Issue(b, "node", true)
	cfg := &tls.Config{Certificates: []tls.Certificate{node}, RootCAs: pki.Pool, ClientCAs: pki.Pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
	for _, withTLS := range []bool{false, true} {
		so := soft.Options{}
		if withTLS {
			so.TLS = cfg
		}
		for _, w := range []struct {
			name     string
			dir      Dir
			size, qd int
		}{{"read-4K-QD32", Read, 4 << 10, 32}, {"write-1M-QD8", Write, 1 << 20, 8}} {
			b.Run(fmt.Sprintf("%s/tls=%v", w.name, withTLS), func(b *testing.B) {
				e := &env{prov: soft.New(so), disk: newMemDisk(64 << 20)}
				o := DefaultServerOptions()
				o.Provider, o.Handler, o.Timings, o.QueueDepth = e.prov, e.disk, Timings(testutil.FastTimings()), 128
				o.Addr = netip.MustParseAddrPort("127.0.0.1:0")
				o.ChunkSize = 2 << 20 // 1 MiB of data and its header
				srv, err := NewServer(o)
				if err != nil {
					b.Fatal(err)
				}
				defer srv.Close()
				e.srv, e.port = srv, srv.Addr().Port()
				s := e.open(b, "tls", paths(b, "ip:127.0.0.1@ip:127.0.0.1"), nil)
				benchInflight(b, s, w.dir, w.size, w.qd)
			})
		}
	}
}

// benchInflight keeps qd requests of size bytes in flight for b.N requests.
func benchInflight(b *testing.B, s *Session, dir Dir, size, qd int) {
	ctx := context.Background()
	sem := make(chan []byte, qd)
	for i := 0; i < qd; i++ {
		sem <- make([]byte, size)
	}
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		buf := <-sem
		off := offHdr((i % qd) * size)
		if err := s.Request(ctx, dir, off, buf, func(err error) {
			if err != nil {
				b.Error(err)
			}
			sem <- buf
		}); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < qd; i++ {
		<-sem
	}
}
