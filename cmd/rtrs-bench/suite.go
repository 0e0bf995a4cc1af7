package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// tcpServerCmd is the raw TCP baseline's server: each connection starts with an 8-byte
// header (mode, request size, response size); mode 1 answers every request of reqSize bytes
// with respSize bytes (round trips), mode 2 only reads (a stream).
func tcpServerCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("tcpserver", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:1240", "listen address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	for {
		c, err := ln.Accept()
		if err != nil {
			return nil
		}
		go func() {
			defer c.Close()
			var h [8]byte
			if _, err := io.ReadFull(c, h[:]); err != nil {
				return
			}
			mode, req, resp := h[0], int(binary.LittleEndian.Uint16(h[2:])), int(binary.LittleEndian.Uint32(h[4:]))
			if mode == 2 {
				req = resp
			}
			if req < 1 || req > 64<<20 || resp > 64<<20 {
				return
			}
			rb, wb := make([]byte, req), make([]byte, max(resp, 1))
			br := bufio.NewReaderSize(c, 256<<10)
			for {
				if _, err := io.ReadFull(br, rb); err != nil {
					return
				}
				if mode == 1 {
					if _, err := c.Write(wb[:resp]); err != nil {
						return
					}
				}
			}
		}()
	}
}

// tcpRR measures round trips of reqSize bytes answered with respSize bytes, qd at a time
// (one connection per request in flight).
func tcpRR(addr string, reqSize, respSize, qd int, dur time.Duration) (Result, error) {
	lats := make([][]time.Duration, qd)
	errc := make(chan error, qd)
	start := time.Now()
	for w := 0; w < qd; w++ {
		go func() {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				errc <- err
				return
			}
			defer c.Close()
			var h [8]byte
			h[0] = 1
			binary.LittleEndian.PutUint16(h[2:], uint16(reqSize))
			binary.LittleEndian.PutUint32(h[4:], uint32(respSize))
			if _, err := c.Write(h[:]); err != nil {
				errc <- err
				return
			}
			req, resp := make([]byte, reqSize), make([]byte, respSize)
			for time.Since(start) < dur {
				t0 := time.Now()
				if _, err := c.Write(req); err != nil {
					errc <- err
					return
				}
				if _, err := io.ReadFull(c, resp); err != nil {
					errc <- err
					return
				}
				lats[w] = append(lats[w], time.Since(t0))
			}
			errc <- nil
		}()
	}
	for w := 0; w < qd; w++ {
		if err := <-errc; err != nil {
			return Result{}, err
		}
	}
	return latencyResult(lats, max(reqSize, respSize), qd, time.Since(start)), nil
}

// tcpStream measures a one-way stream of size-byte messages from rotating buffers.
func tcpStream(addr string, size int, dur time.Duration) (Result, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return Result{}, err
	}
	defer c.Close()
	var h [8]byte
	h[0] = 2
	binary.LittleEndian.PutUint32(h[4:], uint32(size))
	if _, err := c.Write(h[:]); err != nil {
		return Result{}, err
	}
	buf := make([]byte, 8*size)
	n := 0
	start := time.Now()
	for ; time.Since(start) < dur; n++ {
		if _, err := c.Write(buf[(n%8)*size : (n%8+1)*size]); err != nil {
			return Result{}, err
		}
	}
	el := time.Since(start)
	return Result{RW: "tcp-stream", BS: size, QD: 1, Ops: int64(n), Seconds: el.Seconds(), IOPS: float64(n) / el.Seconds(),
		MBps: float64(n) * float64(size) / el.Seconds() / 1e6}, nil
}

func latencyResult(lats [][]time.Duration, bs, qd int, el time.Duration) Result {
	r := Result{RW: "tcp-rr", BS: bs, QD: qd, Seconds: el.Seconds()}
	var n int
	r.P50us, r.P99us, r.P999us, n = percentiles(lats)
	r.Ops, r.IOPS, r.MBps = int64(n), float64(n)/el.Seconds(), float64(n)*float64(bs)/el.Seconds()/1e6
	return r
}

// procCPU is a process's user + system CPU seconds from /proc.
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100 // USER_HZ
}

func suiteCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("suite", flag.ContinueOnError)
	dur := fs.Duration("duration", 3*time.Second, "length of each run")
	procs := fs.Int("gomaxprocs", 0, "GOMAXPROCS of every Go process of the suite (client, servers, TCP baseline); 0 leaves the default")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	kids, err := newChildren(ctx, *procs)
	if err != nil {
		return err
	}
	defer kids.stop()
	s := &suiteRun{ctx: ctx, dur: *dur, out: out}
	for _, srv := range []struct {
		cmd  **exec.Cmd
		args []string
	}{
		{&s.on, []string{"-listen", "127.0.0.1:18601", "-always-invalidate=true"}},
		{&s.off, []string{"-listen", "127.0.0.1:18602", "-always-invalidate=false"}},
		{&s.big, []string{"-listen", "127.0.0.1:18605", "-chunk-size", "2M", "-queue-depth", "128"}},
		{&s.bigNull, []string{"-listen", "127.0.0.1:18606", "-chunk-size", "2M", "-queue-depth", "128", "-null"}},
		{&s.null, []string{"-listen", "127.0.0.1:18604", "-always-invalidate=true", "-null"}},
	} {
		if *srv.cmd, err = kids.start(append([]string{"server"}, srv.args...)...); err != nil {
			return err
		}
	}
	if _, err := kids.start("tcpserver", "-listen", suiteTCP); err != nil {
		return err
	}
	time.Sleep(500 * time.Millisecond)

	host, _ := os.Hostname()
	fmt.Fprintf(out, "rtrs-bench suite on %s (%d CPUs, %s/%s), %s; runs of %v; GOMAXPROCS %d in every Go process; client and server in two processes over loopback (paths from 127.0.0.1 and 127.0.0.2).\n\n",
		host, runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, time.Now().UTC().Format("2006-01-02 15:04 UTC"), *dur, runtime.GOMAXPROCS(0))
	for _, section := range []func() error{s.matrix, s.async, s.nullStore, s.bigChunks, func() error {
		s.fio = fioBaselines(ctx, *dur, out)
		return nil
	}, s.tcpBaselines} {
		if err := section(); err != nil {
			return err
		}
	}
	s.ratios()
	return nil
}

// suiteTCP is the raw TCP baseline server's address.
const suiteTCP = "127.0.0.1:18603"

// suiteKey is a run of the main matrix.
type suiteKey struct {
	rw, bs string
	qd     int
	inv    bool
	paths  int
}

// suiteRun is one run of the suite: its servers, the length of each run, the report, and
// the results the ratios at its end are made of.
type suiteRun struct {
	ctx context.Context
	dur time.Duration
	out io.Writer
	// The servers: always_invalidate on and off (memory store), null store, and with 2 MiB
	// chunks (memory and null store).
	on, off, null, big, bigNull *exec.Cmd

	res                       map[suiteKey]Result
	asyncRes, nullRes, bigRes map[string]Result
	fio                       map[string]Result
	rt4kRead, rt4kWrite, strm Result
}

// measure runs the client as p says against srv for the run's length over a 256 MiB span,
// and returns its result and the server's CPU seconds meanwhile.
func (s *suiteRun) measure(srv *exec.Cmd, p clientParams) (Result, float64, error) {
	cpu0 := procCPU(srv.Process.Pid)
	runtime.GC()
	p.dur, p.span = s.dur, "256M"
	r, err := runClient(s.ctx, p)
	return r, procCPU(srv.Process.Pid) - cpu0, err
}

// onOff is the server and port of always_invalidate on or off.
func (s *suiteRun) onOff(inv bool) (*exec.Cmd, uint16) {
	if inv {
		return s.on, 18601
	}
	return s.off, 18602
}

var suitePath = []string{"ip:127.0.0.1@ip:127.0.0.1"}

// matrix: block sizes and queue depths, always_invalidate on and off, one and two paths.
func (s *suiteRun) matrix() error {
	fmt.Fprintln(s.out, "| workload | always_invalidate | paths | IOPS | MB/s | p50 µs | p99 µs | p99.9 µs | client CPU s | server CPU s |")
	fmt.Fprintln(s.out, "|---|---|---|---|---|---|---|---|---|---|")
	s.res = map[suiteKey]Result{}
	for _, c := range []struct {
		rw, bs string
		qd     int
	}{{"randread", "4K", 1}, {"randwrite", "4K", 1}, {"randread", "4K", 32}, {"randwrite", "4K", 32},
		{"randread", "128K", 8}, {"randwrite", "128K", 8}, {"randread", "1M", 8}, {"randwrite", "1M", 8}} {
		for _, inv := range []bool{true, false} {
			for _, np := range []int{1, 2} {
				srv, port := s.onOff(inv)
				ps := []string{"ip:127.0.0.1@ip:127.0.0.1", "ip:127.0.0.2@ip:127.0.0.1"}[:np]
				r, scpu, err := s.measure(srv, clientParams{paths: ps, port: port, bs: c.bs, qd: c.qd, rw: c.rw})
				if err != nil {
					return fmt.Errorf("%s %s qd%d: %w", c.rw, c.bs, c.qd, err)
				}
				s.res[suiteKey{c.rw, c.bs, c.qd, inv, np}] = r
				fmt.Fprintf(s.out, "| %s %s QD%d | %v | %d | %.0f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |\n",
					c.rw, c.bs, c.qd, inv, np, r.IOPS, r.MBps, r.P50us, r.P99us, r.P999us, r.CPUSec, scpu)
			}
		}
	}
	return nil
}

// async: the asynchronous engine at 4 KiB.
func (s *suiteRun) async() error {
	fmt.Fprintln(s.out, "\nAsynchronous engine (-async: each of the QD request chains issues its next request from the previous one's completion callback, as fio's async engines do; 1 path, memory store):")
	fmt.Fprintln(s.out, "\n| workload | IOPS | MB/s | p50 µs | p99 µs | p99.9 µs | client CPU s | server CPU s |\n|---|---|---|---|---|---|---|---|")
	s.asyncRes = map[string]Result{}
	for _, c := range []struct {
		rw  string
		qd  int
		inv bool
	}{{"randread", 1, true}, {"randwrite", 1, true}, {"randread", 32, true}, {"randwrite", 32, true},
		{"randread", 32, false}, {"randwrite", 32, false}} {
		srv, port := s.onOff(c.inv)
		r, scpu, err := s.measure(srv, clientParams{paths: suitePath, port: port, bs: "4K", qd: c.qd, rw: c.rw, async: true})
		if err != nil {
			return err
		}
		k := fmt.Sprintf("%s %d", c.rw, c.qd)
		if !c.inv {
			k += " off"
		}
		s.asyncRes[k] = r
		fmt.Fprintf(s.out, "| %s 4K QD%d, always_invalidate %v | %.0f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", c.rw, c.qd, c.inv, r.IOPS, r.MBps, r.P50us, r.P99us, r.P999us, r.CPUSec, scpu)
	}
	return nil
}

// nullStore: the transport alone, against a server that keeps no data.
func (s *suiteRun) nullStore() error {
	fmt.Fprintln(s.out, "\nThe transport alone: a server that answers without copying data into or out of a store (always_invalidate on, 1 path):")
	fmt.Fprintln(s.out, "\n| workload | IOPS | MB/s | p50 µs | p99 µs | client CPU s | server CPU s |\n|---|---|---|---|---|---|---|")
	s.nullRes = map[string]Result{}
	for _, c := range []struct {
		rw, bs string
		qd     int
	}{{"randread", "4K", 1}, {"randread", "4K", 32}, {"randwrite", "4K", 32}, {"randread", "1M", 8}, {"randwrite", "1M", 8}} {
		r, scpu, err := s.measure(s.null, clientParams{paths: suitePath, port: 18604, bs: c.bs, qd: c.qd, rw: c.rw})
		if err != nil {
			return err
		}
		s.nullRes[fmt.Sprintf("%s %s %d", c.rw, c.bs, c.qd)] = r
		fmt.Fprintf(s.out, "| %s %s QD%d | %.0f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", c.rw, c.bs, c.qd, r.IOPS, r.MBps, r.P50us, r.P99us, r.CPUSec, scpu)
	}
	return nil
}

// bigChunks: 1 MiB IOs in one request each, with 2 MiB chunks.
func (s *suiteRun) bigChunks() error {
	fmt.Fprintln(s.out, "\nWith 2 MiB chunks (max_chunk_size 2M, queue depth 128, always_invalidate on, 1 path), a 1 MiB IO is one request:")
	fmt.Fprintln(s.out, "\n| workload | store | IOPS | MB/s | p50 µs | p99 µs | client CPU s | server CPU s |\n|---|---|---|---|---|---|---|---|")
	s.bigRes = map[string]Result{}
	for _, srv := range []struct {
		name string
		port uint16
		cmd  *exec.Cmd
	}{{"memory", 18605, s.big}, {"null", 18606, s.bigNull}} {
		for _, rw := range []string{"randread", "randwrite"} {
			r, scpu, err := s.measure(srv.cmd, clientParams{paths: suitePath, port: srv.port, bs: "1M", qd: 8, rw: rw})
			if err != nil {
				return err
			}
			s.bigRes[srv.name+" "+rw] = r
			fmt.Fprintf(s.out, "| %s 1M QD8 | %s | %.0f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", rw, srv.name, r.IOPS, r.MBps, r.P50us, r.P99us, r.CPUSec, scpu)
		}
	}
	return nil
}

// tcpBaselines: raw TCP round trips and a stream over the same loopback.
func (s *suiteRun) tcpBaselines() error {
	fmt.Fprintln(s.out, "\nSame-run raw TCP baselines (one process each side, same loopback):")
	fmt.Fprintln(s.out, "\n| baseline | IOPS | MB/s | p50 µs | p99 µs |\n|---|---|---|---|---|")
	for _, b := range []struct {
		name      string
		req, resp int
		qd        int
		out       *Result
	}{
		{"round trip: 8 B out, 4 KiB back (a 4 KiB read)", 8, 4096, 1, &s.rt4kRead},
		{"round trip: 4 KiB out, 8 B back (a 4 KiB write)", 4096, 8, 1, &s.rt4kWrite},
		{"round trips, 32 connections: 8 B out, 4 KiB back", 8, 4096, 32, nil},
	} {
		r, err := tcpRR(suiteTCP, b.req, b.resp, b.qd, s.dur)
		if err != nil {
			return err
		}
		if b.out != nil {
			*b.out = r
		}
		fmt.Fprintf(s.out, "| %s | %.0f | %.1f | %.1f | %.1f |\n", b.name, r.IOPS, r.MBps, r.P50us, r.P99us)
	}
	var err error
	if s.strm, err = tcpStream(suiteTCP, 1<<20, s.dur); err != nil {
		return err
	}
	fmt.Fprintf(s.out, "| stream of 1 MiB writes | %.0f | %.1f | | |\n", s.strm.IOPS, s.strm.MBps)
	return nil
}

// ratios: the figures docs/benchmarks.md compares, from the sections' results.
func (s *suiteRun) ratios() {
	out, res := s.out, s.res
	fmt.Fprintln(out, "\nRatios (always_invalidate on, 1 path unless said):")
	r1 := res[suiteKey{"randread", "4K", 1, true, 1}]
	w1 := res[suiteKey{"randwrite", "4K", 1, true, 1}]
	fmt.Fprintf(out, "- 4 KiB QD1 p50 / raw TCP round trip: read %.2f, write %.2f (async engine: %.2f, %.2f)\n", r1.P50us/s.rt4kRead.P50us, w1.P50us/s.rt4kWrite.P50us,
		s.asyncRes["randread 1"].P50us/s.rt4kRead.P50us, s.asyncRes["randwrite 1"].P50us/s.rt4kWrite.P50us)
	for _, rw := range []string{"randread", "randwrite"} {
		fmt.Fprintf(out, "- 1 MiB QD8 %s / TCP stream: %.2f (2 paths: %.2f; null server: %.2f)\n", rw,
			res[suiteKey{rw, "1M", 8, true, 1}].MBps/s.strm.MBps, res[suiteKey{rw, "1M", 8, true, 2}].MBps/s.strm.MBps,
			s.nullRes[rw+" 1M 8"].MBps/s.strm.MBps)
	}
	for _, rw := range []string{"randread", "randwrite"} {
		fmt.Fprintf(out, "- 1 MiB QD8 %s with 2 MiB chunks / TCP stream: %.2f (null store: %.2f)\n", rw,
			s.bigRes["memory "+rw].MBps/s.strm.MBps, s.bigRes["null "+rw].MBps/s.strm.MBps)
	}
	for _, rw := range []string{"randread", "randwrite"} {
		if f, ok := s.fio[rw]; ok {
			r := res[suiteKey{rw, "4K", 32, true, 1}]
			a := s.asyncRes[rw+" 32"]
			fmt.Fprintf(out, "- 4 KiB QD32 %s / fio→nbdkit memory over TCP: %.2f (%.0f against %.0f IOPS); async engine: %.2f (%.0f IOPS)\n", rw, r.IOPS/f.IOPS, r.IOPS, f.IOPS, a.IOPS/f.IOPS, a.IOPS)
		}
	}
	for _, c := range []struct {
		rw, bs string
		qd     int
	}{{"randread", "4K", 32}, {"randwrite", "4K", 32}, {"randread", "1M", 8}, {"randwrite", "1M", 8}} {
		on, off := res[suiteKey{c.rw, c.bs, c.qd, true, 1}], res[suiteKey{c.rw, c.bs, c.qd, false, 1}]
		extra := ""
		if a, ok := s.asyncRes[fmt.Sprintf("%s %d off", c.rw, c.qd)]; ok && c.bs == "4K" {
			extra = fmt.Sprintf(" (async engine: %.0f%%)", 100*(1-s.asyncRes[fmt.Sprintf("%s %d", c.rw, c.qd)].IOPS/a.IOPS))
		}
		fmt.Fprintf(out, "- always_invalidate cost, %s %s QD%d: %.0f%% fewer IOPS than off%s\n", c.rw, c.bs, c.qd, 100*(1-on.IOPS/off.IOPS), extra)
	}
}

// fioBaselines runs fio's nbd engine against nbdkit's memory plugin over TCP, 4 KiB QD32 and
// QD1, when both are installed, and prints the figures.
func fioBaselines(ctx context.Context, dur time.Duration, out io.Writer) map[string]Result {
	res := map[string]Result{}
	if _, err := exec.LookPath("fio"); err != nil {
		fmt.Fprintln(out, "\n(fio not installed: no fio→nbdkit baseline)")
		return res
	}
	if _, err := exec.LookPath("nbdkit"); err != nil {
		fmt.Fprintln(out, "\n(nbdkit not installed: no fio→nbdkit baseline)")
		return res
	}
	nbd := exec.CommandContext(ctx, "nbdkit", "-f", "-p", "18610", "-i", "127.0.0.1", "memory", "256M")
	if err := nbd.Start(); err != nil {
		fmt.Fprintf(out, "\n(nbdkit: %v)\n", err)
		return res
	}
	defer func() { _ = nbd.Process.Kill(); _ = nbd.Wait() }()
	time.Sleep(500 * time.Millisecond)
	fmt.Fprintln(out, "\nSame-run baseline: fio (nbd engine) → nbdkit memory, over TCP on loopback:")
	fmt.Fprintln(out, "\n| workload | IOPS | MB/s | p50 µs | p99 µs | fio CPU s | nbdkit CPU s |\n|---|---|---|---|---|---|---|")
	for _, c := range []struct {
		rw string
		qd int
	}{{"randread", 1}, {"randwrite", 1}, {"randread", 32}, {"randwrite", 32}} {
		cpu0 := procCPU(nbd.Process.Pid)
		cmd := exec.CommandContext(ctx, "fio", "--name=b", "--ioengine=nbd", "--uri=nbd://127.0.0.1:18610", "--rw="+c.rw,
			"--bs=4k", fmt.Sprintf("--iodepth=%d", c.qd), fmt.Sprintf("--runtime=%d", int(dur.Seconds())), "--time_based",
			"--output-format=json")
		b, err := cmd.Output()
		if err != nil {
			fmt.Fprintf(out, "| %s 4K QD%d | fio failed: %v | | | | | |\n", c.rw, c.qd, err)
			continue
		}
		r, fcpu, err := parseFio(b, c.rw)
		if err != nil {
			fmt.Fprintf(out, "| %s 4K QD%d | %v | | | | | |\n", c.rw, c.qd, err)
			continue
		}
		if c.qd == 32 {
			res[c.rw] = r
		}
		fmt.Fprintf(out, "| %s 4K QD%d | %.0f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", c.rw, c.qd, r.IOPS, r.MBps, r.P50us, r.P99us, fcpu, procCPU(nbd.Process.Pid)-cpu0)
	}
	return res
}

// parseFio reads fio's JSON (after whatever the nbd engine printed before it).
func parseFio(b []byte, rw string) (Result, float64, error) {
	i := strings.IndexByte(string(b), '{')
	if i < 0 {
		return Result{}, 0, fmt.Errorf("no JSON from fio")
	}
	var d struct {
		Jobs []struct {
			Read, Write struct {
				IOPS   float64 `json:"iops"`
				BW     float64 `json:"bw_bytes"`
				ClatNs struct {
					Percentile map[string]float64 `json:"percentile"`
				} `json:"clat_ns"`
			}
			UsrCPU  float64 `json:"usr_cpu"`
			SysCPU  float64 `json:"sys_cpu"`
			Elapsed float64 `json:"elapsed"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal(b[i:], &d); err != nil || len(d.Jobs) == 0 {
		return Result{}, 0, fmt.Errorf("fio JSON: %v", err)
	}
	j := d.Jobs[0]
	st := j.Read
	if strings.Contains(rw, "write") {
		st = j.Write
	}
	cpu := (j.UsrCPU + j.SysCPU) / 100 * j.Elapsed
	return Result{RW: rw, IOPS: st.IOPS, MBps: st.BW / 1e6, P50us: st.ClatNs.Percentile["50.000000"] / 1e3,
		P99us: st.ClatNs.Percentile["99.000000"] / 1e3}, cpu, nil
}

// children starts copies of this program (the servers of a measurement) and stops them all.
type children struct {
	ctx   context.Context
	self  string
	env   []string
	procs []*exec.Cmd
}

// newChildren prepares to start children with GOMAXPROCS procs (0: inherited).
func newChildren(ctx context.Context, procs int) (*children, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	c := &children{ctx: ctx, self: self, env: os.Environ()}
	if procs > 0 {
		c.env = append(c.env, fmt.Sprintf("GOMAXPROCS=%d", procs))
	}
	return c, nil
}

func (c *children) start(args ...string) (*exec.Cmd, error) {
	cmd := exec.CommandContext(c.ctx, c.self, args...)
	cmd.Stderr, cmd.Env = io.Discard, c.env
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c.procs = append(c.procs, cmd)
	return cmd, nil
}

func (c *children) stop() {
	for _, p := range c.procs {
		_ = p.Process.Kill()
		_ = p.Wait()
	}
}
