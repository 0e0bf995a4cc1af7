// Command rdma-perf measures an RDMA provider (soft, or verbs on an RDMA device) between two
// processes, in the manner of perftest (ib_send_lat, ib_write_bw, ib_read_bw), next to the
// same measurement over a plain TCP socket, so that a run gives both figures on the same
// machine; over verbs, perftest itself is the baseline on the same device.
//
// Server: rdma-perf -listen 127.0.0.1:18515   (RDMA on that port, raw TCP on port+1)
// Client: rdma-perf -connect 127.0.0.1:18515 -test send_lat|write_bw|read_bw|tcp_lat|tcp_bw
// Suite:  rdma-perf -suite 5 -duration 2s   (starts its own server, prints a markdown report)
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/resched"
	"github.com/rtrs-go/rtrs/internal/lib/size"
	"github.com/rtrs-go/rtrs/pkg/rdma"
	"github.com/rtrs-go/rtrs/pkg/rdma/pick"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "rdma-perf:", err)
		os.Exit(1)
	}
}

// params is what a client asks of the server, sent as connect private data. Poll asks the
// server to answer a latency test from a busy-polling loop (as perftest's server does) instead
// of its CQ handler.
type params struct {
	Test  string
	Size  int
	Depth int
	Poll  bool
}

func (p params) encode() []byte {
	mode := "handler"
	if p.Poll {
		mode = "poll"
	}
	return []byte(fmt.Sprintf("%s %d %d %s", p.Test, p.Size, p.Depth, mode))
}

func decodeParams(b []byte) (params, error) {
	// Over an IB CM the private data arrives padded with zeros to the CM's size.
	f := strings.Fields(strings.TrimRight(string(b), "\x00"))
	if len(f) != 4 || f[3] != "poll" && f[3] != "handler" {
		return params{}, errors.New("bad test parameters")
	}
	size, err1 := strconv.Atoi(f[1])
	depth, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || size < 1 || size > 64<<20 || depth < 1 || depth > 1024 {
		return params{}, errors.New("test parameters out of range")
	}
	return params{Test: f[0], Size: size, Depth: depth, Poll: f[3] == "poll"}, nil
}

// Result is one measurement.
type Result struct {
	Test    string  `json:"test"`
	Size    int     `json:"size"`
	Depth   int     `json:"depth"`
	Ops     int     `json:"ops"`
	Seconds float64 `json:"seconds"`
	MBps    float64 `json:"mb_per_s,omitempty"`
	P50us   float64 `json:"p50_us,omitempty"`
	P99us   float64 `json:"p99_us,omitempty"`
	Mode    string  `json:"mode,omitempty"`
	// CCallsPerOp is this side's calls into C per operation (a round trip for send_lat), with
	// a provider that counts them (rdma.CallCounter: verbs).
	CCallsPerOp float64 `json:"c_calls_per_op,omitempty"`
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("rdma-perf", flag.ContinueOnError)
	listen := fs.String("listen", "", "serve on this address (RDMA on the port, raw TCP on port+1)")
	connect := fs.String("connect", "", "server address")
	test := fs.String("test", "send_lat", "send_lat, write_bw, read_bw, tcp_lat or tcp_bw")
	sizeF := fs.String("size", "64", "message size (K and M suffixes)")
	depth := fs.Int("depth", 16, "operations in flight (bandwidth tests)")
	dur := fs.Duration("duration", 5*time.Second, "how long to measure")
	iters := fs.Int("iters", 0, "send_lat: measure this many round trips instead of -duration (as perftest's -n)")
	mode := fs.String("mode", "handler", "how the latency client takes completions: handler (CQ handler, the provider's poll context), wait (CQ.Wait) or poll (busy Poll)")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	suiteReps := fs.Int("suite", 0, "run the whole comparison this many times against a server it starts itself, print markdown")
	provName := fs.String("provider", "auto", pick.Usage)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *suiteReps > 0 {
		if *connect == "" {
			*connect = "127.0.0.1:18515"
		}
		ap, err := netip.ParseAddrPort(*connect)
		if err != nil {
			return err
		}
		return suite(ctx, ap, *suiteReps, *dur, *provName, out)
	}
	var addr netip.Addr
	if ap, err := netip.ParseAddrPort(*listen); err == nil {
		addr = ap.Addr()
	}
	prov, why, err := pick.Open(*provName, addr)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "rdma-perf: provider %s\n", why)
	if *listen != "" {
		ap, err := netip.ParseAddrPort(*listen)
		if err != nil {
			return err
		}
		return serve(ctx, prov, ap)
	}
	if *connect == "" {
		return errors.New("need -listen or -connect")
	}
	ap, err := netip.ParseAddrPort(*connect)
	if err != nil {
		return err
	}
	sz, err := size.Parse(*sizeF)
	if err != nil {
		return err
	}
	p := params{Test: *test, Size: sz, Depth: *depth, Poll: *mode == "poll"}
	cc, counts := prov.(rdma.CallCounter)
	var calls0 uint64
	if counts {
		calls0 = cc.DataPathCalls()
	}
	var r Result
	switch *test {
	case "send_lat":
		p.Depth = 1
		r, err = sendLat(ctx, prov, ap, p, *dur, *iters, *mode)
	case "write_bw", "read_bw":
		r, err = bandwidth(ctx, prov, ap, p, *dur)
	case "tcp_lat":
		p.Depth = 1
		r, err = tcpLat(ctx, tcpAddr(ap), p, *dur)
	case "tcp_bw":
		r, err = tcpBW(ctx, tcpAddr(ap), p, *dur)
	default:
		return fmt.Errorf("unknown test %q", *test)
	}
	if err != nil {
		return err
	}
	if counts && r.Ops > 0 {
		r.CCallsPerOp = float64(cc.DataPathCalls()-calls0) / float64(r.Ops)
	}
	if *asJSON {
		return json.NewEncoder(out).Encode(r)
	}
	fmt.Fprintf(out, "%-9s size %8d depth %3d ops %8d  %9.1f MB/s  p50 %7.2f us  p99 %7.2f us",
		r.Test, r.Size, r.Depth, r.Ops, r.MBps, r.P50us, r.P99us)
	if r.CCallsPerOp > 0 {
		fmt.Fprintf(out, "  calls into C %.2f/op", r.CCallsPerOp)
	}
	fmt.Fprintln(out)
	return nil
}

func tcpAddr(ap netip.AddrPort) string {
	return netip.AddrPortFrom(ap.Addr(), ap.Port()+1).String()
}

// side is one end's verbs objects.
type side struct {
	id rdma.ConnID
	pd rdma.PD
	cq rdma.CQ
	qp rdma.QP
	wc [1]rdma.WC // next's, kept here: on its stack it would be a heap allocation per call
	// pace keeps a busy-polling next passing through the scheduler.
	pace resched.Pacer
}

func newSide(id rdma.ConnID, depth int) (*side, error) {
	s := &side{id: id}
	var err error
	if s.pd, err = id.Device().AllocPD(); err != nil {
		return nil, err
	}
	// Room in the CQ for every request both queues can hold: a disconnect flushes them all
	// at once (a smaller CQ overflowed at each send_lat's end, which rxe logs as an error).
	wrs := 2*depth + 64
	if s.cq, err = id.Device().CreateCQ(2 * wrs); err != nil {
		return nil, err
	}
	s.qp, err = id.CreateQP(s.pd, rdma.QPInitAttr{SendCQ: s.cq, RecvCQ: s.cq, MaxSendWR: wrs, MaxRecvWR: wrs, MaxSendSGE: 1, MaxRecvSGE: 1})
	return s, err
}

func (s *side) close() {
	_ = s.id.Destroy()
	_ = s.cq.Destroy()
}

// next returns the next successful completion.
func (s *side) next(ctx context.Context, poll bool) (rdma.WC, error) {
	wc := &s.wc
	if poll {
		// A polling goroutine never parks: paced, the runtime's monitor does not take its P
		// at every tick while it is inside the provider's call into C.
		s.pace.Tick()
	}
	for spins := 0; s.poll(wc[:], poll) == 0; spins++ {
		if poll {
			// The context is looked at now and then: a spin should be one poll, not a lock.
			if spins%1024 == 1023 && ctx.Err() != nil {
				return wc[0], ctx.Err()
			}
			continue
		}
		if err := s.cq.Wait(ctx); err != nil {
			return wc[0], err
		}
	}
	if wc[0].Status != rdma.WCSuccess {
		return wc[0], fmt.Errorf("completion %v: %v", wc[0].Opcode, wc[0].Status)
	}
	return wc[0], nil
}

// busySpins is how many empty polls a provider that spins by itself (rdma.BusyPoller) makes
// before it returns to rdma-perf's loop, which then looks at its context.
const busySpins = 1 << 12

// poll polls the side's queue; busy, in the provider when it can spin there, as perftest
// spins on ibv_poll_cq in C.
func (s *side) poll(wc []rdma.WC, busy bool) int {
	if bp, ok := s.cq.(rdma.BusyPoller); ok && busy {
		return bp.PollBusy(wc, busySpins)
	}
	return s.cq.Poll(wc)
}

// serve answers RDMA tests on ap and raw TCP tests on ap's port + 1 until ctx ends.
func serve(ctx context.Context, prov rdma.Provider, ap netip.AddrPort) error {
	ln, err := prov.Listen(ap, 16)
	if err != nil {
		return err
	}
	defer ln.Close()
	tl, err := net.Listen("tcp", tcpAddr(ap))
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); _ = tl.Close() }()
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			go serveTCP(c)
		}
	}()
	for {
		req, err := ln.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			if err := serveRDMA(ctx, req); err != nil {
				fmt.Fprintln(os.Stderr, "rdma-perf: session:", err)
			}
		}()
	}
}

// echoRing is how many receives each side of send_lat keeps posted, half of them at least.
const echoRing = 32

// recvBatch is half a ring of receives into the first size bytes of mr, posted at once.
func recvBatch(mr rdma.MR, size int) []rdma.RecvWR {
	b := make([]rdma.RecvWR, echoRing/2)
	for i := range b {
		b[i] = rdma.RecvWR{SGList: []rdma.SGE{rdma.SGEOf(mr, 0, size)}}
	}
	return b
}

func serveRDMA(ctx context.Context, req *rdma.ConnRequest) error {
	p, err := decodeParams(req.PrivateData)
	if err != nil {
		_ = req.ID.Reject([]byte(err.Error()))
		return err
	}
	s, err := newSide(req.ID, p.Depth)
	if err != nil {
		_ = req.ID.Reject(nil)
		return err
	}
	defer s.close()
	mr, err := s.pd.AllocMR(p.Size*p.Depth, rdma.AccessLocalWrite|rdma.AccessRemoteWrite|rdma.AccessRemoteRead)
	if err != nil {
		return err
	}
	var info [12]byte
	binary.LittleEndian.PutUint64(info[0:], mr.Addr())
	binary.LittleEndian.PutUint32(info[8:], mr.RKey())
	if p.Test != "send_lat" {
		if err := req.ID.Accept(ctx, rdma.ConnParam{PrivateData: info[:], RNRRetryCount: 7}); err != nil {
			return err
		}
		// One-sided tests need nothing from the server but its presence.
		select {
		case <-s.id.Events():
		case <-ctx.Done():
		}
		return nil
	}
	// A ring of receives, as perftest's server posts its rx_depth: each echo's SEND then
	// leaves before the receive it used is replaced. They are replaced half a ring at a time,
	// in one post: on verbs each post is a call into C, which under an emulated CPU costs as
	// much as the rest of an echo.
	refill := recvBatch(mr, p.Size)
	for range 2 {
		if _, err := s.qp.PostRecv(refill); err != nil {
			return err
		}
	}
	if err := req.ID.Accept(ctx, rdma.ConnParam{PrivateData: info[:], RNRRetryCount: 7}); err != nil {
		return err
	}
	// Echoes are answered on the goroutine that received them, as a TCP echo server answers
	// from the goroutine that read.
	send := []rdma.SendWR{{Opcode: rdma.OpSendWithImm, SGList: []rdma.SGE{rdma.SGEOf(mr, 0, p.Size)}}}
	var wc [16]rdma.WC
	echoes, used := 0, 0
	echo := func(n int) {
		for _, w := range wc[:n] {
			if w.Status != rdma.WCSuccess || w.Opcode != rdma.WCRecv {
				continue
			}
			send[0].Imm = w.Imm
			// Every 32nd echo is signaled, so that the send queue's slots come back.
			send[0].Flags = 0
			if echoes%32 == 0 {
				send[0].Flags = rdma.SendSignaled
			}
			echoes++
			_, _ = s.qp.PostSend(send)
			if used++; used == len(refill) {
				_, _ = s.qp.PostRecv(refill)
				used = 0
			}
		}
	}
	if p.Poll {
		// Busy polling, one core, until the client goes (looked at now and then). Each
		// batch is answered and the spin goes on: no second, empty poll after it.
		for spins := 0; ; spins++ {
			if spins%1024 == 0 {
				select {
				case <-s.id.Events():
					return nil
				case <-ctx.Done():
					return nil
				default:
				}
			}
			if n := s.poll(wc[:], true); n > 0 {
				echo(n)
			}
		}
	}
	drain := func() {
		for n := s.cq.Poll(wc[:]); n > 0; n = s.cq.Poll(wc[:]) {
			echo(n)
		}
	}
	s.cq.SetHandler(drain)
	select {
	case <-s.id.Events():
	case <-ctx.Done():
	}
	s.cq.SetHandler(nil)
	return nil
}

// serveTCP answers a raw TCP test: an 8-byte header (test, size), then echo or sink.
func serveTCP(c net.Conn) {
	defer c.Close()
	var hdr [8]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return
	}
	echo := hdr[0] == 1
	size := int(binary.LittleEndian.Uint32(hdr[4:]))
	if size < 1 || size > 64<<20 {
		return
	}
	buf := make([]byte, size*16)
	for i := 0; ; i++ {
		b := buf[(i%16)*size : (i%16+1)*size]
		if _, err := io.ReadFull(c, b); err != nil {
			return
		}
		if echo {
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	}
}

func dial(ctx context.Context, prov rdma.Provider, ap netip.AddrPort, p params) (*side, uint64, uint32, error) {
	id, err := prov.ResolveAddr(ctx, netip.Addr{}, ap)
	if err != nil {
		return nil, 0, 0, err
	}
	s, err := newSide(id, p.Depth)
	if err != nil {
		_ = id.Destroy()
		return nil, 0, 0, err
	}
	info, err := id.Connect(ctx, rdma.ConnParam{PrivateData: p.encode(), RNRRetryCount: 7})
	if err != nil {
		s.close()
		return nil, 0, 0, err
	}
	// (An IB CM pads the answer with zeros to its size.)
	if len(info) < 12 {
		s.close()
		return nil, 0, 0, errors.New("bad server answer")
	}
	return s, binary.LittleEndian.Uint64(info), binary.LittleEndian.Uint32(info[8:]), nil
}

// sendLat measures SEND round trips for dur, or iters of them when iters > 0 (perftest's
// ib_send_lat measures a count, -n, 1000 by default).
func sendLat(ctx context.Context, prov rdma.Provider, ap netip.AddrPort, p params, dur time.Duration, iters int, mode string) (Result, error) {
	s, _, _, err := dial(ctx, prov, ap, p)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	mr, err := s.pd.AllocMR(p.Size, rdma.AccessLocalWrite)
	if err != nil {
		return Result{}, err
	}
	pp := &pinger{s: s, iters: iters, dur: dur,
		recv: recvBatch(mr, p.Size),
		send: []rdma.SendWR{{Opcode: rdma.OpSendWithImm, SGList: []rdma.SGE{rdma.SGEOf(mr, 0, p.Size)}}},
		// Room for every sample up front; with a count, no more than that (8 MiB would
		// start a GC cycle, whose worker takes a CPU, as the measurement starts).
		lat: make([]time.Duration, 0, 1<<20)}
	if iters > 0 {
		pp.lat = make([]time.Duration, 0, iters)
	}
	pp.start = time.Now()
	if mode == "handler" {
		err = pp.fromHandler(ctx)
	} else {
		err = pp.loop(ctx, mode == "poll")
	}
	if err != nil {
		return Result{}, err
	}
	return latResult(p, pp.lat, time.Since(pp.start), mode), nil
}

// pinger is send_lat's side that measures: it sends a ping (SEND with the round's number as
// immediate) and times the round until the echo comes back.
type pinger struct {
	s         *side
	recv      []rdma.RecvWR // half a ring, posted whenever the receives posted run out
	posted    int           // receives posted and not yet used
	send      []rdma.SendWR
	iters     int           // rounds; 0: for dur
	dur       time.Duration // with iters 0
	start, t0 time.Time
	lat       []time.Duration
}

// more says whether round i is to run (i rounds are done).
func (pp *pinger) more(i int) bool {
	if pp.iters > 0 {
		return i < pp.iters
	}
	return time.Since(pp.start) < pp.dur
}

// ping makes sure a receive waits for the echo and sends round i's ping.
func (pp *pinger) ping(i int) error {
	if pp.posted == 0 {
		// Half a ring at once: one call into C on verbs for that many rounds.
		if _, err := pp.s.qp.PostRecv(pp.recv); err != nil {
			return err
		}
		pp.posted = len(pp.recv)
	}
	pp.posted--
	pp.t0 = time.Now()
	pp.send[0].Imm = uint32(i)
	// Every 32nd SEND is signaled: an unsignaled request keeps its send queue slot until a
	// later one completes (as on an HCA; perftest does the same).
	pp.send[0].Flags = 0
	if i%32 == 0 {
		pp.send[0].Flags = rdma.SendSignaled
	}
	_, err := pp.s.qp.PostSend(pp.send)
	return err
}

// loop runs the rounds from this goroutine, waiting for each echo by polling or by the
// completion channel.
func (pp *pinger) loop(ctx context.Context, poll bool) error {
	for i := 0; pp.more(i); i++ {
		if err := pp.ping(i); err != nil {
			return err
		}
		for {
			wc, err := pp.s.next(ctx, poll)
			if err != nil {
				return err
			}
			if wc.Opcode == rdma.WCRecv {
				if wc.Imm != uint32(i) {
					return fmt.Errorf("echo %d for %d", wc.Imm, i)
				}
				break
			}
		}
		pp.lat = append(pp.lat, time.Since(pp.t0))
	}
	return nil
}

// fromHandler runs the rounds from the completion handler: the next ping leaves from the
// handler that took the echo.
func (pp *pinger) fromHandler(ctx context.Context) error {
	done := make(chan error, 1)
	var wc [16]rdma.WC
	i := 0
	cq := pp.s.cq
	cq.SetHandler(func() {
		for n := cq.Poll(wc[:]); n > 0; n = cq.Poll(wc[:]) {
			for _, w := range wc[:n] {
				if w.Status != rdma.WCSuccess {
					done <- fmt.Errorf("completion %v: %v", w.Opcode, w.Status)
					return
				}
				if w.Opcode != rdma.WCRecv {
					continue
				}
				pp.lat = append(pp.lat, time.Since(pp.t0))
				if w.Imm != uint32(i) {
					done <- fmt.Errorf("echo %d for %d", w.Imm, i)
					return
				}
				if i++; !pp.more(i) {
					done <- nil
					return
				}
				if err := pp.ping(i); err != nil {
					done <- err
					return
				}
			}
		}
	})
	defer cq.SetHandler(nil)
	if err := pp.ping(0); err != nil {
		return err
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func bandwidth(ctx context.Context, prov rdma.Provider, ap netip.AddrPort, p params, dur time.Duration) (Result, error) {
	s, raddr, rkey, err := dial(ctx, prov, ap, p)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	mr, err := s.pd.AllocMR(p.Size*p.Depth, rdma.AccessLocalWrite)
	if err != nil {
		return Result{}, err
	}
	op := rdma.OpRDMAWrite
	if p.Test == "read_bw" {
		op = rdma.OpRDMARead
	}
	wr := []rdma.SendWR{{Opcode: op, Flags: rdma.SendSignaled, SGList: make([]rdma.SGE, 1), RKey: rkey}}
	inflight, ops := 0, 0
	start := time.Now()
	for time.Since(start) < dur || inflight > 0 {
		if inflight < p.Depth && time.Since(start) < dur {
			slot := ops % p.Depth
			wr[0].SGList[0] = rdma.SGEOf(mr, slot*p.Size, p.Size)
			wr[0].RemoteAddr = raddr + uint64(slot*p.Size)
			if _, err := s.qp.PostSend(wr); err != nil {
				return Result{}, err
			}
			inflight++
			ops++
			continue
		}
		if _, err := s.next(ctx, false); err != nil {
			return Result{}, err
		}
		inflight--
	}
	el := time.Since(start)
	return Result{Test: p.Test, Size: p.Size, Depth: p.Depth, Ops: ops, Seconds: el.Seconds(),
		MBps: float64(ops) * float64(p.Size) / el.Seconds() / 1e6}, nil
}

func tcpConn(ctx context.Context, addr string, echo bool, size int) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	var hdr [8]byte
	if echo {
		hdr[0] = 1
	}
	binary.LittleEndian.PutUint32(hdr[4:], uint32(size))
	if _, err := c.Write(hdr[:]); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func tcpLat(ctx context.Context, addr string, p params, dur time.Duration) (Result, error) {
	c, err := tcpConn(ctx, addr, true, p.Size)
	if err != nil {
		return Result{}, err
	}
	defer c.Close()
	buf := make([]byte, p.Size)
	lat := make([]time.Duration, 0, 1<<20)
	start := time.Now()
	for time.Since(start) < dur {
		t0 := time.Now()
		if _, err := c.Write(buf); err != nil {
			return Result{}, err
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			return Result{}, err
		}
		lat = append(lat, time.Since(t0))
	}
	return latResult(p, lat, time.Since(start), ""), nil
}

func tcpBW(ctx context.Context, addr string, p params, dur time.Duration) (Result, error) {
	c, err := tcpConn(ctx, addr, false, p.Size)
	if err != nil {
		return Result{}, err
	}
	defer c.Close()
	buf := make([]byte, p.Size*16)
	ops := 0
	start := time.Now()
	for ; time.Since(start) < dur; ops++ {
		slot := ops % 16
		if _, err := c.Write(buf[slot*p.Size : (slot+1)*p.Size]); err != nil {
			return Result{}, err
		}
	}
	el := time.Since(start)
	return Result{Test: p.Test, Size: p.Size, Depth: 1, Ops: ops, Seconds: el.Seconds(),
		MBps: float64(ops) * float64(p.Size) / el.Seconds() / 1e6}, nil
}

func latResult(p params, lat []time.Duration, el time.Duration, mode string) Result {
	r := Result{Test: p.Test, Size: p.Size, Depth: 1, Ops: len(lat), Seconds: el.Seconds(), Mode: mode}
	if len(lat) == 0 {
		return r
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	r.P50us = float64(lat[len(lat)/2].Nanoseconds()) / 1e3
	r.P99us = float64(lat[len(lat)*99/100].Nanoseconds()) / 1e3
	return r
}
