package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/metrics"
	"runtime/pprof"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// profileOnSignal lets another process choose the window a bench process is profiled over
// (scripts/profile-blk.sh: the length of one fio run). SIGUSR1 starts a CPU profile into
// dir/name.pprof; SIGUSR2 stops it and writes dir/name.sched: the goroutine wake-ups and the
// GC cycles over the window, and the provider's calls into C when it counts them
// (rdma.CallCounter: verbs). The runtime times one in eight of a goroutine's moves from
// runnable to running (runtime/metrics' /sched/latencies:seconds), so the wake-ups written
// are that count times eight: an estimate. Nothing when dir is "".
func profileOnSignal(ctx context.Context, dir, name string, prov rdma.Provider) {
	if dir == "" {
		return
	}
	calls := func() uint64 { return 0 }
	cc, counts := prov.(rdma.CallCounter)
	if counts {
		calls = cc.DataPathCalls
	}
	sig := make(chan os.Signal, 2)
	signal.Notify(sig, syscall.SIGUSR1, syscall.SIGUSR2)
	go func() {
		defer signal.Stop(sig)
		var f *os.File
		var wake0, gc0, calls0 uint64
		for {
			select {
			case <-ctx.Done():
				if f != nil {
					pprof.StopCPUProfile()
					f.Close()
				}
				return
			case s := <-sig:
				switch {
				case s == syscall.SIGUSR1 && f == nil:
					var err error
					if f, err = os.Create(filepath.Join(dir, name+".pprof")); err != nil {
						fmt.Fprintln(os.Stderr, "rtrs-bench: profile:", err)
						continue
					}
					_ = pprof.StartCPUProfile(f)
					wake0, gc0 = schedCounts()
					calls0 = calls()
				case s == syscall.SIGUSR2 && f != nil:
					pprof.StopCPUProfile()
					f.Close()
					f = nil
					wake, gc := schedCounts()
					b := fmt.Appendf(nil, "wakeups %d\ngc %d\n", 8*(wake-wake0), gc-gc0)
					if counts {
						b = fmt.Appendf(b, "ccalls %d\n", calls()-calls0)
					}
					_ = os.WriteFile(filepath.Join(dir, name+".sched"), b, 0o644)
				}
			}
		}
	}()
}

// schedCounts reads the runtime's count of goroutine schedulings and of GC cycles.
func schedCounts() (wakeups, gcs uint64) {
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}, {Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(s)
	if s[0].Value.Kind() == metrics.KindFloat64Histogram {
		for _, c := range s[0].Value.Float64Histogram().Counts {
			wakeups += c
		}
	}
	if s[1].Value.Kind() == metrics.KindUint64 {
		gcs = s[1].Value.Uint64()
	}
	return wakeups, gcs
}
