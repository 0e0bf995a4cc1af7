package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/rtrs-go/rtrs/internal/daemon"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/nbd"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// blkServerCmd runs an RNBD server over RTRS exporting the files of a directory.
func blkServerCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("blkserver", flag.ContinueOnError)
	listen := fs.String("listen", "[::]:1234", "listen address")
	dir := fs.String("dir", "", "export directory (dev_search_path)")
	inv := fs.Bool("always-invalidate", true, "always_invalidate")
	chunk := fs.String("chunk-size", "128K", "max_chunk_size")
	zc := fs.String("zero-copy-read-min", "64K", "READs this large or larger leave a tmpfs export without a copy (off: never)")
	zcLocal := fs.Bool("zero-copy-local", false, "the same for a client on this host (loopback)")
	eio := fs.String("export-io", "direct", "block device exports: direct (O_DIRECT through Linux AIO) or buffered (the page cache)")
	provName := fs.String("provider", "auto", pick.Usage)
	prof := fs.String("profile-dir", "", "SIGUSR1 starts a CPU profile into this directory, SIGUSR2 stops it (blkserver.pprof, blkserver.sched)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cs, err := size.Parse(*chunk)
	if err != nil {
		return err
	}
	zcMin, err := size.ParseThreshold(*zc)
	if err != nil {
		return fmt.Errorf("-zero-copy-read-min: %w", err)
	}
	exportIO, err := rnbd.ParseExportIO(*eio)
	if err != nil {
		return fmt.Errorf("-export-io: %w", err)
	}
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: *dir, MaxIOSize: int(cs) - transport.MaxHdrSize, ZeroCopyReadMin: zcMin, ZeroCopyLocal: *zcLocal, ExportIO: exportIO})
	if err != nil {
		return err
	}
	defer rs.Close()
	o := transport.DefaultServerOptions()
	if o.Addr, err = netip.ParseAddrPort(*listen); err != nil {
		return err
	}
	prov, why, err := pick.Open(*provName, o.Addr.Addr())
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "rtrs-bench blkserver: provider %s\n", why)
	profileOnSignal(ctx, *prof, "blkserver", prov)
	o.Provider, o.Handler, o.AlwaysInvalidate, o.ChunkSize = prov, rs, *inv, int(cs)
	o.Limits.MaxChunkMemory = daemon.DefaultChunkMemory()
	srv, err := transport.NewServer(o)
	if err != nil {
		return err
	}
	defer srv.Close()
	<-ctx.Done()
	return nil
}

// nbdClientCmd maps a device over RTRS and serves it as an NBD export on a unix socket
// (and a TCP address if given) until stopped.
func nbdClientCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("nbdclient", flag.ContinueOnError)
	var paths pathList
	fs.Var(&paths, "path", "a path, [src@]dst in RTRS syntax (repeat for more)")
	port := fs.Uint("port", 1234, "server port")
	sess := fs.String("sess", "bench", "session name")
	dev := fs.String("device", "disk", "device path on the server")
	sock := fs.String("socket", "", "unix socket to serve NBD on")
	tcp := fs.String("tcp", "", "TCP address to serve NBD on too")
	cons := fs.Int("con-per-path", 0, "connections per path (0: CPUs + 1)")
	provName := fs.String("provider", "auto", pick.Usage)
	prof := fs.String("profile-dir", "", "SIGUSR1 starts a CPU profile into this directory, SIGUSR2 stops it (nbdclient.pprof, nbdclient.sched)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	pa, err := parsePaths(paths)
	if err != nil {
		return err
	}
	prov, _, err := pick.Open(*provName)
	if err != nil {
		return err
	}
	profileOnSignal(ctx, *prof, "nbdclient", prov)
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: prov, MaxReconnectAttempts: -1, ConPerPath: *cons}})
	defer c.Close(context.Background())
	mctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	d, err := c.Map(mctx, rnbd.MapOptions{SessName: *sess, Paths: pa, Port: uint16(*port), DevicePath: *dev, AccessMode: rnbd.AccessRW})
	cancel()
	if err != nil {
		return err
	}
	ns := nbd.NewServer(nbd.Options{Exports: func() []nbd.Export {
		return []nbd.Export{{Name: *sess + "/" + *dev, Dev: d}}
	}})
	var lns []net.Listener
	if *sock != "" {
		_ = os.Remove(*sock)
		ln, err := net.Listen("unix", *sock)
		if err != nil {
			return err
		}
		lns = append(lns, ln)
	}
	if *tcp != "" {
		ln, err := net.Listen("tcp", *tcp)
		if err != nil {
			return err
		}
		lns = append(lns, ln)
	}
	if len(lns) == 0 {
		return errors.New("nbdclient: no -socket or -tcp")
	}
	for _, ln := range lns {
		go func() { _ = ns.Serve(ln) }()
	}
	<-ctx.Done()
	ns.Close()
	return nil
}

func parsePaths(specs []string) ([]transport.PathAddrs, error) {
	var out []transport.PathAddrs
	for _, s := range specs {
		src, dst, err := transport.ParsePathAddrs(s)
		if err != nil {
			return nil, err
		}
		out = append(out, transport.PathAddrs{Src: src, Dst: dst})
	}
	return out, nil
}

// blkSuiteCmd measures fio's nbd engine through the NBD front end → RNBD over RTRS → a
// tmpfs file, against the same shape built from nbdkit: fio → nbdkit nbd plugin (proxy) →
// TCP → nbdkit memory, in one run with the workloads interleaved.
// blkJob is one fio job of the block suite.
type blkJob struct {
	rw, bs string
	qd     int
}

// blkReport prints the block suite's table: per job, the medians of RTRS and of nbdkit.
func blkReport(out io.Writer, jobs []blkJob, res map[string][]Result, title, chunk string) {
	fmt.Fprintln(out, title)
	fmt.Fprintf(out, "RTRS: fio → NBD (unix socket) → rnbd client → RTRS (soft, 1 path, loopback, %s chunks) → rnbd server → tmpfs file\n", chunk)
	fmt.Fprintln(out, "nbdkit: fio → nbdkit nbd plugin (unix socket) → TCP (loopback) → nbdkit memory")
	fmt.Fprintln(out, "CPU/IO: CPU time of the whole chain (fio and both servers) per IO, in µs.")
	fmt.Fprintln(out, "\n| workload | RTRS IOPS | RTRS MB/s | RTRS p50 / p99 µs | RTRS CPU/IO | nbdkit IOPS | nbdkit MB/s | nbdkit p50 / p99 µs | nbdkit CPU/IO | RTRS / nbdkit |\n|---|---|---|---|---|---|---|---|---|---|")
	for _, j := range jobs {
		r := medianResult(res[fmt.Sprintf("%s %s %d rtrs", j.rw, j.bs, j.qd)])
		k := medianResult(res[fmt.Sprintf("%s %s %d nbdkit", j.rw, j.bs, j.qd)])
		fmt.Fprintf(out, "| %s %s QD%d | %.0f | %.1f | %.1f / %.1f | %.1f | %.0f | %.1f | %.1f / %.1f | %.1f | **%.2f×** |\n",
			j.rw, strings.ToUpper(j.bs), j.qd, r.IOPS, r.MBps, r.P50us, r.P99us, cpuPerIO(r), k.IOPS, k.MBps, k.P50us, k.P99us, cpuPerIO(k), r.IOPS/k.IOPS)
	}
}

// fioNBD runs fio's nbd engine on uri for dur and returns its result, with the CPU time of
// fio and of the processes pids (the servers of the chain) meanwhile.
func fioNBD(ctx context.Context, uri, rw, bs string, qd int, size int64, dur time.Duration, pids []int) (Result, error) {
	cpu0 := 0.0
	for _, pid := range pids {
		cpu0 += procCPU(pid)
	}
	cmd := exec.CommandContext(ctx, "fio", "--name=b", "--ioengine=nbd", "--uri="+uri, "--rw="+rw,
		"--bs="+bs, fmt.Sprintf("--iodepth=%d", qd), fmt.Sprintf("--size=%d", size),
		fmt.Sprintf("--runtime=%d", int(dur.Seconds())), "--time_based", "--output-format=json")
	b, err := cmd.Output()
	if err != nil {
		return Result{}, fmt.Errorf("%v: %s", err, b)
	}
	r, fioCPU, err := parseFio(b, rw)
	if err != nil {
		return Result{}, err
	}
	// Every process of the chain, fio included: CPU time is what the two vCPUs share, and
	// unlike throughput it does not count the time stolen from them.
	r.CPUSec = fioCPU - cpu0
	for _, pid := range pids {
		r.CPUSec += procCPU(pid)
	}
	r.Seconds = dur.Seconds()
	return r, nil
}

func blkSuiteCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("blksuite", flag.ContinueOnError)
	dur := fs.Duration("duration", 5*time.Second, "length of each fio run")
	sizeStr := fs.String("size", "1G", "device size")
	reps := fs.Int("reps", 1, "interleaved repetitions (medians are reported)")
	chunk := fs.String("chunk-size", "128K", "the RNBD server's max_chunk_size")
	if err := fs.Parse(args); err != nil {
		return err
	}
	szi, err := size.Parse(*sizeStr)
	if err != nil {
		return err
	}
	sz := int64(szi)
	for _, tool := range []string{"fio", "nbdkit", "nbdcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("blksuite needs %s", tool)
		}
	}
	dir, err := os.MkdirTemp("/dev/shm", "rtrs-blk-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sockDir, err := os.MkdirTemp("", "rtrs-blk-sock-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(sockDir)
	// The prefill: random data, copied into both exports.
	seed := filepath.Join(dir, "seed")
	if err := writeRandom(seed, sz); err != nil {
		return err
	}
	if err := os.Rename(seed, filepath.Join(dir, "disk")); err != nil {
		return err
	}
	kids, err := newChildren(ctx, 0)
	if err != nil {
		return err
	}
	defer kids.stop()
	bsrv, err := kids.start("blkserver", "-listen", "127.0.0.1:18630", "-dir", dir, "-chunk-size", *chunk)
	if err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond)
	rtrsSock := filepath.Join(sockDir, "rtrs.sock")
	bcli, err := kids.start("nbdclient", "-path", "ip:127.0.0.1@ip:127.0.0.1", "-port", "18630", "-socket", rtrsSock)
	if err != nil {
		return err
	}
	kitSock := filepath.Join(sockDir, "nbdkit.sock")
	mem := exec.CommandContext(ctx, "nbdkit", "-f", "-p", "18631", "-i", "127.0.0.1", "memory", fmt.Sprint(sz))
	proxy := exec.CommandContext(ctx, "nbdkit", "-f", "-U", kitSock, "nbd", "hostname=127.0.0.1", "port=18631")
	for _, c := range []*exec.Cmd{mem, proxy} {
		if err := c.Start(); err != nil {
			return err
		}
		defer func() { _ = c.Process.Kill(); _ = c.Wait() }()
		time.Sleep(300 * time.Millisecond)
	}
	if err := waitSocket(rtrsSock, 10*time.Second); err != nil {
		return err
	}
	rtrsURI := "nbd+unix:///bench/disk?socket=" + rtrsSock
	kitURI := "nbd+unix:///?socket=" + kitSock
	// nbdkit memory is sparse: fill it with the same data so reads do the same work.
	if b, err := exec.CommandContext(ctx, "nbdcopy", filepath.Join(dir, "disk"), kitURI).CombinedOutput(); err != nil {
		return fmt.Errorf("prefill nbdkit: %v: %s", err, b)
	}
	jobs := []blkJob{
		{"randread", "4k", 1}, {"randwrite", "4k", 1}, {"randread", "4k", 32}, {"randwrite", "4k", 32},
		{"read", "128k", 8}, {"write", "128k", 8}, {"read", "1m", 8}, {"write", "1m", 8},
	}
	res := map[string][]Result{}
	for rep := 0; rep < *reps; rep++ {
		for _, j := range jobs {
			for _, target := range []struct {
				name, uri string
				pids      []int
			}{{"rtrs", rtrsURI, []int{bsrv.Process.Pid, bcli.Process.Pid}}, {"nbdkit", kitURI, []int{mem.Process.Pid, proxy.Process.Pid}}} {
				r, err := fioNBD(ctx, target.uri, j.rw, j.bs, j.qd, sz, *dur, target.pids)
				if err != nil {
					return fmt.Errorf("fio %s %s QD%d on %s: %w", j.rw, j.bs, j.qd, target.name, err)
				}
				key := fmt.Sprintf("%s %s %d %s", j.rw, j.bs, j.qd, target.name)
				res[key] = append(res[key], r)
			}
		}
	}
	blkReport(out, jobs, res, fmt.Sprintf("fio (nbd engine, %v per run, %d interleaved run(s), medians) on a %s prefilled device:", *dur, *reps, *sizeStr), *chunk)
	return nil
}

// cpuPerIO is the CPU µs a run spent per IO.
func cpuPerIO(r Result) float64 {
	if r.IOPS == 0 || r.Seconds == 0 {
		return 0
	}
	return r.CPUSec / (r.IOPS * r.Seconds) * 1e6
}

// medianResult takes the run with the median IOPS.
func medianResult(rs []Result) Result {
	if len(rs) == 0 {
		return Result{}
	}
	s := append([]Result(nil), rs...)
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j].IOPS < s[i].IOPS {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
	return s[len(s)/2]
}

func writeRandom(path string, n int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	var x uint64 = 0x9e3779b97f4a7c15
	for w := int64(0); w < n; w += int64(len(buf)) {
		for i := 0; i+8 <= len(buf); i += 8 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			for k := 0; k < 8; k++ {
				buf[i+k] = byte(x >> (8 * k))
			}
		}
		if _, err := f.Write(buf[:min(int64(len(buf)), n-w)]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

func waitSocket(path string, d time.Duration) error {
	for end := time.Now().Add(d); ; {
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("%s: %w", path, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
