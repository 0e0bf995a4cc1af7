package soft

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

var benchSizes = []int{4 << 10, 128 << 10, 1 << 20}

const benchDepth = 16 // operations in flight

// BenchmarkRDMA measures one-sided throughput with benchDepth operations in flight, every one
// signaled, over loopback in one process.
func BenchmarkRDMA(b *testing.B) {
	for _, op := range []rdma.Opcode{rdma.OpRDMAWrite, rdma.OpRDMARead} {
		for _, sz := range benchSizes {
			b.Run(fmt.Sprintf("%v/%dK", op, sz>>10), func(b *testing.B) {
				pr := newPair(b, New(Options{}))
				oneSided(b, pr, op, sz, pr.cli.reg(b, sz*benchDepth, lw))
			})
		}
	}
}

// BenchmarkRDMAWriteFromFile is BenchmarkRDMA's WRITE sourced from a file region on tmpfs:
// sendfile hands the socket the page cache's pages, where a memory source is copied.
func BenchmarkRDMAWriteFromFile(b *testing.B) {
	for _, sz := range benchSizes[1:] {
		b.Run(fmt.Sprintf("%dK", sz>>10), func(b *testing.B) {
			f, err := os.CreateTemp("/dev/shm", "soft-bench-")
			if err != nil {
				b.Skip("no tmpfs at /dev/shm")
			}
			defer os.Remove(f.Name())
			defer f.Close()
			if err := f.Truncate(int64(sz * benchDepth)); err != nil {
				b.Fatal(err)
			}
			pr := newPair(b, New(Options{}))
			m, err := pr.cli.pd.RegFileMR(f, 0, sz*benchDepth, 0)
			if err != nil {
				b.Fatal(err)
			}
			defer m.Dereg()
			oneSided(b, pr, rdma.OpRDMAWrite, sz, m)
		})
	}
}

// oneSided posts b.N operations of sz bytes between local and a fresh remote region, benchDepth
// in flight, every one signaled.
func oneSided(b *testing.B, pr *pair, op rdma.Opcode, sz int, local rdma.MR) {
	remote := pr.srv.reg(b, sz*benchDepth, all)
	b.SetBytes(int64(sz))
	b.ReportAllocs()
	b.ResetTimer()
	inflight := 0
	var wc [benchDepth]rdma.WC
	wr := []rdma.SendWR{{Opcode: op, Flags: rdma.SendSignaled, SGList: make([]rdma.SGE, 1), RKey: remote.RKey()}}
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		for inflight == benchDepth {
			n := pr.cli.cq.Poll(wc[:])
			if n == 0 {
				_ = pr.cli.cq.Wait(ctx)
				continue
			}
			for _, w := range wc[:n] {
				if w.Status != rdma.WCSuccess {
					b.Fatal(w.Status)
				}
			}
			inflight -= n
		}
		slot := i % benchDepth
		wr[0].ID, wr[0].RemoteAddr = uint64(slot), remote.Addr()+uint64(slot*sz)
		wr[0].SGList[0] = rdma.SGEOf(local, slot*sz, sz)
		if _, err := pr.cli.qp.PostSend(wr); err != nil {
			b.Fatal(err)
		}
		inflight++
	}
	for inflight > 0 {
		_ = pr.cli.cq.Wait(ctx)
		inflight -= pr.cli.cq.Poll(wc[:])
	}
}

// BenchmarkTCPStream is the baseline for BenchmarkRDMA: the same messages over a loopback TCP
// socket, written from and read into benchDepth rotating buffers of the message size (the
// memory footprint of the RDMA benchmark), the reader taking whole messages.
func BenchmarkTCPStream(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(fmt.Sprintf("%dK", sz>>10), func(b *testing.B) {
			c, s := testutil.TCPPair(b)
			done := make(chan struct{})
			go func() {
				defer close(done)
				buf := make([]byte, sz*benchDepth)
				for i := 0; ; i++ {
					slot := i % benchDepth
					if _, err := io.ReadFull(s, buf[slot*sz:(slot+1)*sz]); err != nil {
						return
					}
				}
			}()
			buf := make([]byte, sz*benchDepth)
			b.SetBytes(int64(sz))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				slot := i % benchDepth
				if _, err := c.Write(buf[slot*sz : (slot+1)*sz]); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			c.Close()
			<-done
		})
	}
}

// BenchmarkSendLatency is a SEND_WITH_IMM ping-pong of 64 bytes, one message in flight; the
// figures are per round trip, with p50 and p99.
func BenchmarkSendLatency(b *testing.B) {
	pr := newPair(b, New(Options{}))
	const sz = 64
	cbuf, sbuf := pr.cli.reg(b, sz, lw), pr.srv.reg(b, sz, lw)
	stop := make(chan struct{})
	done := make(chan struct{})
	// The echo side re-posts a receive and answers each message.
	pr.srv.recv(b, 1, sbuf, 0, sz)
	go func() {
		defer close(done)
		var wc [4]rdma.WC
		rwr := []rdma.RecvWR{{ID: 1, SGList: []rdma.SGE{rdma.SGEOf(sbuf, 0, sz)}}}
		swr := []rdma.SendWR{{Opcode: rdma.OpSendWithImm, SGList: []rdma.SGE{rdma.SGEOf(sbuf, 0, sz)}}}
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-stop; cancel() }()
		for {
			n := pr.srv.cq.Poll(wc[:])
			if n == 0 {
				if pr.srv.cq.Wait(ctx) != nil {
					return
				}
				continue
			}
			for _, w := range wc[:n] {
				if w.Opcode != rdma.WCRecv {
					continue
				}
				swr[0].Imm = w.Imm
				_, _ = pr.srv.qp.PostRecv(rwr)
				_, _ = pr.srv.qp.PostSend(swr)
			}
		}
	}()
	lat := make([]time.Duration, 0, b.N)
	var wc [4]rdma.WC
	ctx := context.Background()
	rwr := []rdma.RecvWR{{ID: 2, SGList: []rdma.SGE{rdma.SGEOf(cbuf, 0, sz)}}}
	swr := []rdma.SendWR{{Opcode: rdma.OpSendWithImm, SGList: []rdma.SGE{rdma.SGEOf(cbuf, 0, sz)}}}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := pr.cli.qp.PostRecv(rwr); err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		swr[0].Imm = uint32(i)
		if _, err := pr.cli.qp.PostSend(swr); err != nil {
			b.Fatal(err)
		}
		for got := false; !got; {
			n := pr.cli.cq.Poll(wc[:])
			if n == 0 {
				_ = pr.cli.cq.Wait(ctx)
			}
			for _, w := range wc[:n] {
				got = got || w.Opcode == rdma.WCRecv
			}
		}
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	close(stop)
	<-done
	reportPercentiles(b, lat)
}

// BenchmarkTCPPingPong is the baseline for BenchmarkSendLatency: 64 bytes echoed over a
// loopback TCP connection.
func BenchmarkTCPPingPong(b *testing.B) {
	c, s := testutil.TCPPair(b)
	go func() {
		buf := make([]byte, 64)
		for {
			if _, err := io.ReadFull(s, buf); err != nil {
				return
			}
			if _, err := s.Write(buf); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 64)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	reportPercentiles(b, lat)
}

func reportPercentiles(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}
