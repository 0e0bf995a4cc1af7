package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
)

// suite runs every measurement reps times against a server in a second process, RDMA and
// its TCP baseline interleaved so that the machine's noise falls on both alike, and prints a
// markdown report with medians and ratios.
func suite(ctx context.Context, ap netip.AddrPort, reps int, dur time.Duration, provName string, out io.Writer) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	srv := exec.CommandContext(ctx, self, "-listen", ap.String(), "-provider", provName)
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		return err
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	time.Sleep(300 * time.Millisecond)
	prov, _, err := pick.Open(provName)
	if err != nil {
		return err
	}

	results := map[suiteKey][]Result{}
	runOne := func(test string, size int, mode string) error {
		p := params{Test: test, Size: size, Depth: 16}
		// Each run starts from a collected heap, so one run's garbage does not bill the next.
		runtime.GC()
		var r Result
		var err error
		switch test {
		case "send_lat":
			p.Depth = 1
			r, err = sendLat(ctx, prov, ap, p, dur, 0, mode)
			test += "/" + mode
		case "tcp_lat":
			p.Depth = 1
			r, err = tcpLat(ctx, tcpAddr(ap), p, dur)
		case "tcp_bw":
			r, err = tcpBW(ctx, tcpAddr(ap), p, dur)
		default:
			r, err = bandwidth(ctx, prov, ap, p, dur)
		}
		if err != nil {
			return fmt.Errorf("%s %d: %w", test, size, err)
		}
		results[suiteKey{test, size}] = append(results[suiteKey{test, size}], r)
		return nil
	}
	sizes := []int{4 << 10, 128 << 10, 1 << 20}
	for i := 0; i < reps; i++ {
		for _, sz := range sizes {
			for _, t := range []string{"write_bw", "tcp_bw", "read_bw"} {
				if err := runOne(t, sz, ""); err != nil {
					return err
				}
			}
		}
		for _, m := range []string{"handler", "tcp", "wait"} {
			var err error
			if m == "tcp" {
				err = runOne("tcp_lat", 64, "")
			} else {
				err = runOne("send_lat", 64, m)
			}
			if err != nil {
				return err
			}
		}
	}
	suiteReport(out, results, sizes, reps, dur)
	return nil
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return strings.TrimSpace(fmt.Sprintf("%d B", n))
}

// suiteKey is a test and its message size.
type suiteKey struct {
	test string
	size int
}

// median is the median of f over rs.
func median(rs []Result, f func(Result) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	sort.Float64s(v)
	return v[len(v)/2]
}

// suiteReport prints the suite's two tables, medians of the repetitions.
func suiteReport(out io.Writer, results map[suiteKey][]Result, sizes []int, reps int, dur time.Duration) {
	mbps := func(r Result) float64 { return r.MBps }
	host, _ := os.Hostname()
	fmt.Fprintf(out, "Run of `rdma-perf -suite` on %s (%d CPUs, %s/%s), %s, %d repetitions of %v each,\n",
		host, runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, time.Now().UTC().Format("2006-01-02 15:04 UTC"), reps, dur)
	fmt.Fprintf(out, "client and server in two processes over 127.0.0.1; medians.\n\n")
	fmt.Fprintf(out, "| size | RDMA_WRITE MB/s | RDMA_READ MB/s | TCP stream MB/s | WRITE/TCP | READ/TCP |\n|---|---|---|---|---|---|\n")
	for _, sz := range sizes {
		w := median(results[suiteKey{"write_bw", sz}], mbps)
		r := median(results[suiteKey{"read_bw", sz}], mbps)
		tc := median(results[suiteKey{"tcp_bw", sz}], mbps)
		fmt.Fprintf(out, "| %s | %.0f | %.0f | %.0f | %.2f | %.2f |\n", sizeName(sz), w, r, tc, w/tc, r/tc)
	}
	fmt.Fprintf(out, "\n| 64-byte ping-pong | p50 µs | p99 µs | p50 / TCP |\n|---|---|---|---|\n")
	tcp := median(results[suiteKey{"tcp_lat", 64}], func(r Result) float64 { return r.P50us })
	for _, row := range []struct{ name, k string }{
		{"SEND_WITH_IMM, completions in the CQ handler", "send_lat/handler"},
		{"SEND_WITH_IMM, completions by CQ.Wait", "send_lat/wait"},
		{"raw TCP (write, read)", "tcp_lat"},
	} {
		rs := results[suiteKey{row.k, 64}]
		p50 := median(rs, func(r Result) float64 { return r.P50us })
		p99 := median(rs, func(r Result) float64 { return r.P99us })
		fmt.Fprintf(out, "| %s | %.1f | %.1f | %.2f |\n", row.name, p50, p99, p50/tcp)
	}
}
