package transport

import (
	"context"
	"fmt"
	"testing"
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
	s := e.open(b, "bench32", paths(b, "ip:127.0.0.1@ip:127.0.0.1"), nil)
	ctx := context.Background()
	sem := make(chan []byte, 32)
	for i := 0; i < 32; i++ {
		sem <- make([]byte, 4096)
	}
	hdr := offHdr(0)
	b.SetBytes(4096)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		buf := <-sem
		if err := s.Request(ctx, Read, hdr, buf, func(err error) {
			if err != nil {
				b.Error(err)
			}
			sem <- buf
		}); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < 32; i++ {
		<-sem
	}
}
