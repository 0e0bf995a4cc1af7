package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"runtime"
	"sort"
	"time"
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
	kids, err := newChildren(ctx, 0)
	if err != nil {
		return err
	}
	defer kids.stop()
	if _, err := kids.start("server", "-listen", "127.0.0.1:18620", fmt.Sprintf("-always-invalidate=%v", *inv)); err != nil {
		return err
	}
	if _, err := kids.start("tcpserver", "-listen", "127.0.0.1:18621"); err != nil {
		return err
	}
	time.Sleep(500 * time.Millisecond)
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
	med := func(v []float64) float64 {
		s := append([]float64(nil), v...)
		sort.Float64s(s)
		return s[len(s)/2]
	}
	fmt.Fprintf(out, "4 KiB QD1 p50, async engine, always_invalidate %v, %d interleaved runs of %v, medians (all runs):\n", *inv, *reps, *dur)
	fmt.Fprintf(out, "  read : RTRS %.1f µs, TCP round trip (8 B out, 4 KiB back) %.1f µs, ratio %.2f   %v / %v\n", med(rr), med(tr), med(rr)/med(tr), rr, tr)
	fmt.Fprintf(out, "  write: RTRS %.1f µs, TCP round trip (4 KiB out, 8 B back) %.1f µs, ratio %.2f   %v / %v\n", med(rw), med(tw), med(rw)/med(tw), rw, tw)
	return nil
}
