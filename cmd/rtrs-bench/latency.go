package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"runtime"
	"sort"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/size"
)

// latencyCmd measures 4 KiB QD1 latency with the async engine against the raw TCP round trip,
// interleaved reps times so that the machine's drift falls on both, and prints medians.
func latencyCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("latency", flag.ContinueOnError)
	reps := fs.Int("reps", 5, "interleaved repetitions")
	dur := fs.Duration("duration", 2*time.Second, "length of each run")
	inv := fs.Bool("always-invalidate", true, "server always_invalidate")
	if err := fs.Parse(args); err != nil {
		return err
	}
	kids, err := startKids(ctx, []string{"server", "-listen", "127.0.0.1:18620", fmt.Sprintf("-always-invalidate=%v", *inv)},
		[]string{"tcpserver", "-listen", "127.0.0.1:18621"})
	if err != nil {
		return err
	}
	defer kids.stop()
	var rr, rw, tr, tw []float64
	for i := 0; i < *reps; i++ {
		for _, c := range []struct {
			rw  string
			res *[]float64
		}{{"randread", &rr}, {"randwrite", &rw}} {
			runtime.GC()
			r, err := runClient(ctx, clientParams{paths: []string{"ip:127.0.0.1@ip:127.0.0.1"}, port: 18620, bs: "4K", qd: 1, rw: c.rw, dur: *dur, span: "64M", async: true})
			if err != nil {
				return err
			}
			*c.res = append(*c.res, r.P50us)
		}
		r, err := tcpRR("127.0.0.1:18621", 8, 4096, 1, *dur)
		if err != nil {
			return err
		}
		tr = append(tr, r.P50us)
		if r, err = tcpRR("127.0.0.1:18621", 4096, 8, 1, *dur); err != nil {
			return err
		}
		tw = append(tw, r.P50us)
	}
	med := median
	fmt.Fprintf(out, "4 KiB QD1 p50, async engine, always_invalidate %v, %d interleaved runs of %v, medians (all runs):\n", *inv, *reps, *dur)
	fmt.Fprintf(out, "  read : RTRS %.1f µs, TCP round trip (8 B out, 4 KiB back) %.1f µs, ratio %.2f   %v / %v\n", med(rr), med(tr), med(rr)/med(tr), rr, tr)
	fmt.Fprintf(out, "  write: RTRS %.1f µs, TCP round trip (4 KiB out, 8 B back) %.1f µs, ratio %.2f   %v / %v\n", med(rw), med(tw), med(rw)/med(tw), rw, tw)
	return nil
}

// streamCmd measures QD8 throughput of large IOs (reads and writes; split at the max IO size
// and issued in parallel) against a one-way raw
// TCP stream of the same size, interleaved reps times, and prints medians.
func streamCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("stream", flag.ContinueOnError)
	reps := fs.Int("reps", 5, "interleaved repetitions")
	dur := fs.Duration("duration", 2*time.Second, "length of each run")
	bs := fs.String("bs", "1M", "IO size (and the TCP stream's message size)")
	qd := fs.Int("qd", 8, "IOs in flight")
	inv := fs.Bool("always-invalidate", true, "server always_invalidate")
	chunk := fs.String("chunk-size", "128K", "server max_chunk_size")
	depth := fs.Int("queue-depth", 512, "server sess_queue_depth (with the chunk size, within 28 bits)")
	null := fs.Bool("null", false, "server answers without storing or returning data")
	paths := fs.Int("paths", 1, "paths (1 or 2, on 127.0.0.1 and 127.0.0.2)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	n, err := size.Parse(*bs)
	if err != nil {
		return err
	}
	pp := []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"}
	if *paths < 1 || *paths > len(pp) {
		return fmt.Errorf("stream: -paths %d (1 or 2)", *paths)
	}
	kids, err := startKids(ctx, []string{"server", "-listen", "127.0.0.1:18622", fmt.Sprintf("-always-invalidate=%v", *inv),
		"-chunk-size", *chunk, fmt.Sprint("-queue-depth=", *depth), fmt.Sprintf("-null=%v", *null)},
		[]string{"tcpserver", "-listen", "127.0.0.1:18623"})
	if err != nil {
		return err
	}
	defer kids.stop()
	var rd, wr, tcp []float64
	for i := 0; i < *reps; i++ {
		for _, c := range []struct {
			rw  string
			res *[]float64
		}{{"read", &rd}, {"write", &wr}} {
			runtime.GC()
			r, err := runClient(ctx, clientParams{paths: pp[:*paths], port: 18622, bs: *bs, qd: *qd, rw: c.rw, dur: *dur, span: "256M"})
			if err != nil {
				return err
			}
			*c.res = append(*c.res, r.MBps)
		}
		r, err := tcpStream("127.0.0.1:18623", int(n), *dur)
		if err != nil {
			return err
		}
		tcp = append(tcp, r.MBps)
	}
	store := "memory store"
	if *null {
		store = "null store"
	}
	fmt.Fprintf(out, "%s QD%d MB/s, %d path(s), %s chunks, %s, always_invalidate %v, %d interleaved runs of %v, medians (all runs):\n",
		*bs, *qd, *paths, *chunk, store, *inv, *reps, *dur)
	fmt.Fprintf(out, "  read : RTRS %.0f, TCP stream %.0f, ratio %.2f   %.0f / %.0f\n", median(rd), median(tcp), median(rd)/median(tcp), rd, tcp)
	fmt.Fprintf(out, "  write: RTRS %.0f, TCP stream %.0f, ratio %.2f   %.0f\n", median(wr), median(tcp), median(wr)/median(tcp), wr)
	return nil
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// invCostCmd measures what always_invalidate costs: two servers, one with it and one
// without, the same workloads run against each in turn, reps times, medians compared.
func invCostCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("invcost", flag.ContinueOnError)
	reps := fs.Int("reps", 5, "interleaved repetitions")
	dur := fs.Duration("duration", 2*time.Second, "length of each run")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ports := map[bool]uint16{true: 18624, false: 18625}
	kids, err := startKids(ctx, []string{"server", "-listen", fmt.Sprint("127.0.0.1:", ports[true]), "-always-invalidate=true"},
		[]string{"server", "-listen", fmt.Sprint("127.0.0.1:", ports[false]), "-always-invalidate=false"})
	if err != nil {
		return err
	}
	defer kids.stop()
	type load struct {
		rw, bs string
		qd     int
		async  bool
	}
	loads := []load{{"randread", "4K", 32, true}, {"randwrite", "4K", 32, true}, {"randread", "4K", 1, true}, {"randwrite", "4K", 1, true},
		{"read", "1M", 8, false}, {"write", "1M", 8, false}}
	res := map[load]map[bool][]float64{}
	for i := 0; i < *reps; i++ {
		for _, l := range loads {
			if res[l] == nil {
				res[l] = map[bool][]float64{}
			}
			for _, inv := range []bool{true, false} {
				runtime.GC()
				r, err := runClient(ctx, clientParams{paths: []string{"ip:127.0.0.1@ip:127.0.0.1"}, port: ports[inv], bs: l.bs, qd: l.qd, rw: l.rw, dur: *dur, span: "256M", async: l.async})
				if err != nil {
					return err
				}
				res[l][inv] = append(res[l][inv], r.IOPS)
			}
		}
	}
	fmt.Fprintf(out, "always_invalidate on against off, one path, %d interleaved runs of %v, median IOPS (all runs):\n", *reps, *dur)
	fmt.Fprintln(out, "\n| workload | on | off | cost | runs on / off |\n|---|---|---|---|---|")
	for _, l := range loads {
		on, off := median(res[l][true]), median(res[l][false])
		fmt.Fprintf(out, "| %s %s QD%d | %.0f | %.0f | %+.1f%% | %.0f / %.0f |\n", l.rw, l.bs, l.qd, on, off, 100*(off-on)/off, res[l][true], res[l][false])
	}
	return nil
}

// startKids starts this program once per argument list (servers for a measurement) and gives
// them a moment to listen.
func startKids(ctx context.Context, cmds ...[]string) (*children, error) {
	kids, err := newChildren(ctx, 0)
	if err != nil {
		return nil, err
	}
	for _, args := range cmds {
		if _, err := kids.start(args...); err != nil {
			kids.stop()
			return nil, err
		}
	}
	time.Sleep(500 * time.Millisecond)
	return kids, nil
}
