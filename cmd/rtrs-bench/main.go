// Command rtrs-bench is a load generator for RTRS: a client process drives the transport's Go
// API against a server process that answers from memory and can verify what was written.
//
//	rtrs-bench server -listen 127.0.0.1:1234 [-queue-depth 512] [-chunk-size 128K] [-always-invalidate=true]
//	rtrs-bench client -path ip:127.0.0.1@ip:127.0.0.1 [-path …] -port 1234 -bs 4K -qd 32 -rw randread -duration 5s [-json]
//	rtrs-bench suite [-duration 3s]      (starts its own servers, prints a markdown report)
//	rtrs-bench latency [-reps 5]         (QD1 latency against the TCP round trip, medians)
//	rtrs-bench stream [-reps 5]          (1 MiB QD8 throughput against the TCP stream, medians)
//	rtrs-bench invcost [-reps 5]         (always_invalidate on against off, interleaved, medians)
//	rtrs-bench blkserver -dir D          (an RNBD server over RTRS exporting D's files)
//	rtrs-bench nbdclient -path … -socket S  (maps a device, serves it over NBD)
//	rtrs-bench blksuite [-duration 5s]   (fio through NBD → RNBD → RTRS against an nbdkit chain)
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "rtrs-bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 0 {
		return errors.New("usage: rtrs-bench server|client|suite|latency|stream|invcost|blkserver|nbdclient|blksuite [flags]")
	}
	if _, err := log.Setup(log.Options{Level: "warning"}); err != nil {
		return err
	}
	switch args[0] {
	case "server":
		return serverCmd(ctx, args[1:])
	case "client":
		return clientCmd(ctx, args[1:], out)
	case "suite":
		return suiteCmd(ctx, args[1:], out)
	case "tcpserver":
		return tcpServerCmd(ctx, args[1:])
	case "latency":
		return latencyCmd(ctx, args[1:], out)
	case "stream":
		return streamCmd(ctx, args[1:], out)
	case "invcost":
		return invCostCmd(ctx, args[1:], out)
	case "blkserver":
		return blkServerCmd(ctx, args[1:])
	case "nbdclient":
		return nbdClientCmd(ctx, args[1:])
	case "blksuite":
		return blkSuiteCmd(ctx, args[1:], out)
	}
	return fmt.Errorf("unknown command %q", args[0])
}

// memStore answers requests from memory; the user header is the 8-byte offset. A null store
// answers without touching the data, to measure the transport alone.
type memStore struct {
	mem  []byte
	mu   sync.RWMutex
	null bool
}

func (m *memStore) Request(r *transport.SrvRequest) {
	if len(r.Usr) != 8 {
		r.Respond(-int(syscall.EINVAL))
		return
	}
	off := binary.LittleEndian.Uint64(r.Usr)
	if off > uint64(len(m.mem)) || uint64(len(r.Data)) > uint64(len(m.mem))-off {
		r.Respond(-int(syscall.EIO))
		return
	}
	if m.null {
		r.Respond(0)
		return
	}
	if r.Dir == transport.Write {
		m.mu.Lock()
		copy(m.mem[off:], r.Data)
		m.mu.Unlock()
	} else {
		m.mu.RLock()
		copy(r.Data, m.mem[off:])
		m.mu.RUnlock()
	}
	r.Respond(0)
}

func (m *memStore) LinkEvent(*transport.SrvSess, transport.LinkEvent) {}

func serverCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("server", flag.ContinueOnError)
	listen := fs.String("listen", "[::]:1234", "listen address")
	qd := fs.Int("queue-depth", transport.DefaultQueueDepth, "sess_queue_depth")
	chunk := fs.String("chunk-size", "128K", "max_chunk_size")
	inv := fs.Bool("always-invalidate", true, "always_invalidate")
	sizeF := fs.String("size", "256M", "memory the server answers from")
	null := fs.Bool("null", false, "answer without storing or returning data (the transport alone)")
	provName := fs.String("provider", "auto", pick.Usage)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ap, err := netip.ParseAddrPort(*listen)
	if err != nil {
		return err
	}
	prov, why, err := pick.Open(*provName, ap.Addr())
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "rtrs-bench server: provider %s\n", why)
	cs, err := size.Parse(*chunk)
	if err != nil {
		return err
	}
	ms, err := size.Parse(*sizeF)
	if err != nil {
		return err
	}
	o := transport.DefaultServerOptions()
	o.Provider, o.Addr, o.QueueDepth, o.ChunkSize, o.AlwaysInvalidate = prov, ap, *qd, cs, *inv
	o.Limits.MaxChunkMemory = daemon.DefaultChunkMemory()
	// The store is mapped outside the Go heap: in the heap it would count towards the
	// collector's goal (twice the live heap), and the runtime would keep that much again of
	// the sessions' garbage resident after they have gone.
	mem, err := rdma.Alloc(ms)
	if err != nil {
		return err
	}
	defer func() { _ = rdma.Free(mem) }()
	o.Handler = &memStore{mem: mem, null: *null}
	srv, err := transport.NewServer(o)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "rtrs-bench server on %v\n", srv.Addr())
	<-ctx.Done()
	return srv.Close()
}

// Result is one client run.
type Result struct {
	RW           string  `json:"rw"`
	BS           int     `json:"bs"`
	QD           int     `json:"qd"`
	Paths        int     `json:"paths"`
	Ops          int64   `json:"ops"`
	Seconds      float64 `json:"seconds"`
	IOPS         float64 `json:"iops"`
	MBps         float64 `json:"mb_per_s"`
	P50us        float64 `json:"p50_us"`
	P99us        float64 `json:"p99_us"`
	P999us       float64 `json:"p999_us"`
	CPUSec       float64 `json:"client_cpu_s"`
	ServerCPUSec float64 `json:"server_cpu_s,omitempty"`
	Verified     int64   `json:"verified_reads,omitempty"`
	// CCallsPerIO is the client's calls into C per IO, with a provider that counts them
	// (rdma.CallCounter: verbs).
	CCallsPerIO float64 `json:"c_calls_per_io,omitempty"`
}

type pathList []string

func (p *pathList) String() string     { return strings.Join(*p, ",") }
func (p *pathList) Set(s string) error { *p = append(*p, s); return nil }

// pattern fills b with the verification pattern of the block at off.
func pattern(b []byte, off uint64) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], (off+uint64(i))*0x9E3779B97F4A7C15)
	}
}

func clientCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("client", flag.ContinueOnError)
	var paths pathList
	fs.Var(&paths, "path", "a path, [src@]dst in RTRS syntax (repeat for more)")
	port := fs.Uint("port", transport.DefaultPort, "server port")
	bsF := fs.String("bs", "4K", "block size")
	qd := fs.Int("qd", 32, "requests in flight")
	rw := fs.String("rw", "randread", "read, write, randread, randwrite, randrw (50/50)")
	dur := fs.Duration("duration", 5*time.Second, "how long to run")
	span := fs.String("size", "256M", "region of the server's memory to use")
	verify := fs.Bool("verify", false, "write a pattern and check it on every read of a written block")
	cons := fs.Int("cons", 0, "connections per path (0: CPUs + 1)")
	async := fs.Bool("async", false, "issue each of the qd request chains' next request from the previous one's completion callback (as fio's async engines) instead of qd goroutines calling Do")
	asJSON := fs.Bool("json", false, "print JSON")
	serverPid := fs.Int("server-pid", 0, "pid of a server on this machine, to report its CPU seconds too")
	provName := fs.String("provider", "auto", pick.Usage)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if len(paths) == 0 {
		return errors.New("need at least one -path")
	}
	scpu0 := 0.0
	if *serverPid > 0 {
		scpu0 = procCPU(*serverPid)
	}
	r, err := runClient(ctx, clientParams{paths: paths, port: uint16(*port), bs: *bsF, qd: *qd, rw: *rw, dur: *dur, span: *span, verify: *verify, cons: *cons, async: *async, provider: *provName})
	if err != nil {
		return err
	}
	if *serverPid > 0 {
		r.ServerCPUSec = procCPU(*serverPid) - scpu0
	}
	if *asJSON {
		return json.NewEncoder(out).Encode(r)
	}
	fmt.Fprintf(out, "%-9s bs %7d qd %3d paths %d: %9.0f IOPS %8.1f MB/s  p50 %7.1f us  p99 %7.1f us  p99.9 %7.1f us  cpu %.2f s",
		r.RW, r.BS, r.QD, r.Paths, r.IOPS, r.MBps, r.P50us, r.P99us, r.P999us, r.CPUSec)
	if *serverPid > 0 {
		fmt.Fprintf(out, "  server cpu %.2f s", r.ServerCPUSec)
	}
	if r.CCallsPerIO > 0 {
		fmt.Fprintf(out, "  calls into C %.2f/IO", r.CCallsPerIO)
	}
	fmt.Fprintln(out)
	return nil
}

type clientParams struct {
	paths    []string
	port     uint16
	bs       string
	qd       int
	rw       string
	dur      time.Duration
	span     string
	verify   bool
	cons     int
	async    bool
	provider string // pick.Open's name; empty: auto
}

func runClient(ctx context.Context, cp clientParams) (Result, error) {
	bs, err := size.Parse(cp.bs)
	if err != nil {
		return Result{}, err
	}
	span, err := size.Parse(cp.span)
	if err != nil {
		return Result{}, err
	}
	var pas []transport.PathAddrs
	for _, p := range cp.paths {
		src, dst, err := transport.ParsePathAddrs(p)
		if err != nil {
			return Result{}, err
		}
		pas = append(pas, transport.PathAddrs{Src: src, Dst: dst})
	}
	prov, _, err := pick.Open(cp.provider)
	if err != nil {
		return Result{}, err
	}
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sess, err := transport.Open(octx, transport.ClientOptions{Provider: prov, SessName: fmt.Sprintf("bench%d", os.Getpid()),
		Paths: pas, Port: cp.port, ConPerPath: cp.cons, Policy: transport.MinInflight, MaxReconnectAttempts: -1})
	if err != nil {
		return Result{}, err
	}
	defer sess.Close()

	blocks := span / bs
	random := strings.HasPrefix(cp.rw, "rand")
	readPct := map[string]int{"read": 100, "randread": 100, "write": 0, "randwrite": 0, "randrw": 50}[cp.rw]
	if _, ok := map[string]bool{"read": true, "randread": true, "write": true, "randwrite": true, "randrw": true}[cp.rw]; !ok {
		return Result{}, fmt.Errorf("unknown -rw %q", cp.rw)
	}
	if cp.async && (cp.verify || bs > sess.MaxIOSize()) {
		return Result{}, errors.New("-async needs blocks within the max IO size and no -verify")
	}
	cc, counts := prov.(rdma.CallCounter)
	var calls0 uint64
	if counts {
		calls0 = cc.DataPathCalls()
	}
	run := runSync
	if cp.async {
		run = runAsync
	}
	r, err := run(ctx, sess, cp, bs, blocks, random, readPct, len(pas))
	if err == nil && counts && r.Ops > 0 {
		r.CCallsPerIO = float64(cc.DataPathCalls()-calls0) / float64(r.Ops)
	}
	return r, err
}

// runSync is the synchronous engine: cp.qd workers, each sending its next request when the
// last one completed, over blocks blocks of bs bytes, for cp.dur; with cp.verify, reads of
// written blocks are compared with what was written.
func runSync(ctx context.Context, sess *transport.Session, cp clientParams, bs, blocks int, random bool, readPct, npaths int) (Result, error) {
	written := make([]atomic.Bool, blocks)
	busy := make([]atomic.Bool, blocks)
	lats := make([][]time.Duration, cp.qd)
	var ops, verified atomic.Int64
	var seq atomic.Int64
	errc := make(chan error, cp.qd)
	cpu0 := cpuSeconds()
	start := time.Now()
	deadline := start.Add(cp.dur)
	var wg sync.WaitGroup
	for w := 0; w < cp.qd; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			buf := make([]byte, bs)
			for time.Now().Before(deadline) {
				var b int
				if random {
					b = rng.IntN(blocks)
				} else {
					b = int(seq.Add(1)-1) % blocks
				}
				if cp.verify && !busy[b].CompareAndSwap(false, true) {
					continue // another worker owns this block now
				}
				off := uint64(b) * uint64(bs)
				dir := transport.Write
				if rng.IntN(100) < readPct {
					dir = transport.Read
				} else if cp.verify {
					pattern(buf, off)
				}
				t0 := time.Now()
				err := doSplit(ctx, sess, dir, off, buf)
				lats[w] = append(lats[w], time.Since(t0))
				if err == nil && cp.verify {
					if dir == transport.Write {
						written[b].Store(true)
					} else if written[b].Load() {
						want := make([]byte, bs)
						pattern(want, off)
						if string(want) != string(buf) {
							err = fmt.Errorf("block %d read back wrong", b)
						}
						verified.Add(1)
					}
				}
				if cp.verify {
					busy[b].Store(false)
				}
				if err != nil {
					errc <- err
					return
				}
				ops.Add(1)
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	close(errc)
	if err := <-errc; err != nil {
		return Result{}, err
	}
	n := ops.Load()
	r := Result{RW: cp.rw, BS: bs, QD: cp.qd, Paths: npaths, Ops: n, Seconds: el.Seconds(),
		IOPS: float64(n) / el.Seconds(), MBps: float64(n) * float64(bs) / el.Seconds() / 1e6,
		CPUSec: cpuSeconds() - cpu0, Verified: verified.Load()}
	r.P50us, r.P99us, r.P999us, _ = percentiles(lats)
	return r, nil
}

// percentiles merges per-worker latencies and returns p50, p99 and p99.9 in µs, and the count.
func percentiles(lats [][]time.Duration) (p50, p99, p999 float64, n int) {
	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	if len(all) == 0 {
		return 0, 0, 0, 0
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	pct := func(q float64) float64 {
		return float64(all[min(len(all)-1, int(q*float64(len(all))))].Nanoseconds()) / 1e3
	}
	return pct(0.5), pct(0.99), pct(0.999), len(all)
}

// runAsync keeps qd request chains going, each issuing its next request from the completion
// callback of the previous one (on the transport's goroutine, without waiting for a permit:
// the completing request's permit is free again by then).
func runAsync(ctx context.Context, sess *transport.Session, cp clientParams, bs, blocks int, random bool, readPct, npaths int) (Result, error) {
	lats := make([][]time.Duration, cp.qd)
	var ops atomic.Int64
	var seq atomic.Int64
	errc := make(chan error, cp.qd)
	cpu0 := cpuSeconds()
	start := time.Now()
	deadline := start.Add(cp.dur)
	for w := 0; w < cp.qd; w++ {
		rng := rand.New(rand.NewPCG(uint64(w), uint64(start.UnixNano())))
		buf, hdr := make([]byte, bs), make([]byte, 8)
		var t0 time.Time
		var issue func() error
		done := func(err error) {
			lats[w] = append(lats[w], time.Since(t0))
			if err == nil {
				ops.Add(1)
				if time.Now().Before(deadline) {
					err = issue()
					if err == nil {
						return
					}
				}
			}
			errc <- err
		}
		issue = func() error {
			b := int(seq.Add(1)-1) % blocks
			if random {
				b = rng.IntN(blocks)
			}
			binary.LittleEndian.PutUint64(hdr, uint64(b)*uint64(bs))
			dir := transport.Write
			if rng.IntN(100) < readPct {
				dir = transport.Read
			}
			t0 = time.Now()
			return sess.TryRequest(dir, hdr, buf, done)
		}
		if err := issue(); err != nil {
			return Result{}, err
		}
	}
	var first error
	for w := 0; w < cp.qd; w++ {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	el := time.Since(start)
	if first != nil {
		return Result{}, first
	}
	n := ops.Load()
	r := Result{RW: cp.rw, BS: bs, QD: cp.qd, Paths: npaths, Ops: n, Seconds: el.Seconds(),
		IOPS: float64(n) / el.Seconds(), MBps: float64(n) * float64(bs) / el.Seconds() / 1e6, CPUSec: cpuSeconds() - cpu0}
	r.P50us, r.P99us, r.P999us, _ = percentiles(lats)
	return r, nil
}

// doSplit does one logical IO as requests of at most the session's max IO size, in parallel
// (as the block layer splits a bio for RNBD), and returns the first error.
func doSplit(ctx context.Context, sess *transport.Session, dir transport.Dir, off uint64, buf []byte) error {
	max := sess.MaxIOSize()
	if len(buf) <= max {
		hdr := make([]byte, 8)
		binary.LittleEndian.PutUint64(hdr, off)
		return sess.Do(ctx, dir, hdr, buf)
	}
	n := (len(buf) + max - 1) / max
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		part := buf[i*max : min((i+1)*max, len(buf))]
		hdr := make([]byte, 8)
		binary.LittleEndian.PutUint64(hdr, off+uint64(i*max))
		if err := sess.Request(ctx, dir, hdr, part, func(err error) { errs <- err }); err != nil {
			errs <- err
		}
	}
	var first error
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// cpuSeconds is this process's user + system CPU time.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}
