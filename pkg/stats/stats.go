// Package stats holds the counters the transport updates and the renderers that print them in
// the kernel's sysfs formats. Every counter is a monotonic total with a reset baseline: a
// reset moves the baseline, so what a file shows starts again from zero while the totals an
// exporter scrapes never go backwards. Counters are per path and atomic: counting takes no
// lock on the IO path.
package stats

import (
	"fmt"
	"math"
	"math/bits"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Counter is a monotonic total with a reset baseline.
type Counter struct {
	total atomic.Uint64
	base  atomic.Uint64
}

// Add adds n.
func (c *Counter) Add(n uint64) { c.total.Add(n) }

// Inc adds one.
func (c *Counter) Inc() { c.total.Add(1) }

// Total is the count since the counter was created.
func (c *Counter) Total() uint64 { return c.total.Load() }

// Value is the count since the last reset.
func (c *Counter) Value() uint64 { return c.total.Load() - c.base.Load() }

// Reset makes Value start again from zero.
func (c *Counter) Reset() { c.base.Store(c.total.Load()) }

// Sharded is a Counter in cache-line-separated shards, for counts that goroutines on different
// CPUs update at IO rates: updates to different shards do not contend. An update goes to the
// shard of the CPU it runs on where the CPU number costs a few cycles (RDPID), as the kernel's
// per-CPU counters do; elsewhere to the shard the caller's hint names (any int, reduced modulo
// the shard count), such as a request's chunk. A hint spreads updates but does not keep a
// CPU to its shard: with it, the cache line an update finds was often last written by the
// other CPU.
type Sharded struct {
	s [shards]struct {
		Counter
		_ [128 - 16]byte // a shard per 128 bytes: two cache lines, whatever the alignment
	}
}

const shards = 8

// Inc adds one, to this CPU's shard or to shard hint.
func (c *Sharded) Inc(hint int) { c.s[shard(hint)].Inc() }

// Add adds n, to this CPU's shard or to shard hint.
func (c *Sharded) Add(hint int, n uint64) { c.s[shard(hint)].Add(n) }

func shard(hint int) uint {
	if cpu, ok := cheapCPU(); ok {
		return uint(cpu) % shards
	}
	return uint(hint) % shards
}

// Value is the count since the last reset.
func (c *Sharded) Value() uint64 {
	var v uint64
	for i := range c.s {
		v += c.s[i].Value()
	}
	return v
}

// Total is the count since the counter was created.
func (c *Sharded) Total() uint64 {
	var v uint64
	for i := range c.s {
		v += c.s[i].Total()
	}
	return v
}

// Reset makes Value start again from zero.
func (c *Sharded) Reset() {
	for i := range c.s {
		c.s[i].Reset()
	}
}

// Max is a running maximum with a reset.
type Max struct{ v atomic.Uint64 }

// Observe raises the maximum to n if n is larger.
func (m *Max) Observe(n uint64) {
	for {
		cur := m.v.Load()
		if n <= cur || m.v.CompareAndSwap(cur, n) {
			return
		}
	}
}

// Value is the maximum since the last reset.
func (m *Max) Value() uint64 { return m.v.Load() }

// Reset clears the maximum.
func (m *Max) Reset() { m.v.Store(0) }

// getcpu returns the CPU the calling thread runs on (getcpu(2)).
func getcpu() int {
	var cpu uint32
	if _, _, e := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); e != 0 {
		return 0
	}
	return int(cpu)
}

// LatBuckets is the number of power-of-two millisecond rows of rdma_lat (1 ms..65536 ms).
const LatBuckets = 17

// The latency histogram is kept finer than rdma_lat shows it: bucket b (0 ≤ b < LatFine)
// counts the latencies below 2^b units of 1/256 ms (3.90625 µs) not counted in a lower
// bucket, and bucket LatFine those of 65536 ms and more. rdma_lat's row k (below 2^k ms) is
// bucket k+8, its first row buckets 0..8: an exporter gets sub-millisecond buckets from the
// same counters the sysfs file shows.
const (
	latUnitShift = 8 // 1/256 ms
	// LatFine is the number of bounded latency buckets.
	LatFine = LatBuckets + latUnitShift
)

// LatBoundSeconds is the upper bound of latency bucket b (b < LatFine) in seconds:
// 2^b/256 ms. The latencies the bucket counts are shorter.
func LatBoundSeconds(b int) float64 { return math.Ldexp(1, b-latUnitShift) / 1000 }

// latFine maps a latency to its bucket.
func latFine(d time.Duration) int {
	if d <= 0 {
		return 0
	}
	if d >= (1<<(LatBuckets-1))*time.Millisecond {
		return LatFine
	}
	return bits.Len64(uint64(d) << latUnitShift / uint64(time.Millisecond))
}

// Latency is a latency histogram in LatFine+1 buckets with the sum of what it counted.
type Latency struct {
	Buckets [LatFine + 1]Counter
	SumNs   Counter // the latencies counted, in nanoseconds
	Max     Max     // in ms, as rdma_lat shows it
}

func (l *Latency) observe(d time.Duration) {
	l.Buckets[latFine(d)].Inc()
	if d > 0 {
		l.SumNs.Add(uint64(d))
	}
	l.Max.Observe(uint64(d / time.Millisecond))
}

// row is what rdma_lat's row k shows (k = LatBuckets: the ">=" row).
func (l *Latency) row(k int) uint64 {
	if k > 0 {
		return l.Buckets[k+latUnitShift].Value()
	}
	var v uint64
	for b := 0; b <= latUnitShift; b++ {
		v += l.Buckets[b].Value()
	}
	return v
}

// Reset restarts what rdma_lat shows; the totals go on.
func (l *Latency) Reset() {
	for b := range l.Buckets {
		l.Buckets[b].Reset()
	}
	l.SumNs.Reset()
	l.Max.Reset()
}

// Snapshot returns the monotonic totals: the count in each bucket (not cumulative), the
// count of all and the sum in nanoseconds. Read while requests finish, the figures may be
// a few requests apart.
func (l *Latency) Snapshot() (buckets [LatFine + 1]uint64, count, sumNs uint64) {
	sumNs = l.SumNs.Total()
	for b := range l.Buckets {
		buckets[b] = l.Buckets[b].Total()
		count += buckets[b]
	}
	return buckets, count, sumNs
}

// Down causes: why a connected client path went into error recovery.
const (
	DownHeartbeat  = iota // its heartbeats went unanswered
	DownDisconnect        // a connection was disconnected
	DownCompletion        // a work request completed in error
	DownProtocol          // the server sent what the protocol does not allow
	DownOther
	NumDownCauses
)

// DownCauseNames name the down causes (metric labels).
var DownCauseNames = [NumDownCauses]string{"heartbeat", "disconnect", "completion", "protocol", "other"}

// ClientPath are the statistics of one client path (stats/ of a path directory).
type ClientPath struct {
	ReadCnt, ReadBytes, WriteCnt, WriteBytes Counter
	Failovered                               Counter
	// Inflight counts requests issued under min-inflight and not finished. It is a gauge, not
	// a total; reset_all zeroes it as the kernel does (it can then go negative).
	Inflight atomic.Int32

	// Reconnects: successful and failed reconnect attempts.
	ReconnectOK, ReconnectFail Counter

	// CPU migration: completions expected on one CPU (submission) that ran on another.
	MigFrom, MigTo []Counter

	// Latency histograms (rdma_lat) with their maxima, for reads and writes.
	LatRead, LatWrite Latency

	// Down counts the times the path went into error recovery, by cause (Down*). Not shown
	// in sysfs; never reset.
	Down [NumDownCauses]Counter

	// Completions per completion-handler call (wc_completion).
	WCMax          Max
	WCTotal, Calls Counter

	// sg_entries: requests whose data came in 0 or 1 scatter/gather entries (the Go API
	// takes one buffer). Only those without data are counted: the others are the rest of
	// the read and write counts, which spares the IO path an atomic update per request.
	sg0     Counter
	sg1Base atomic.Uint64
}

// NewClientPath returns zeroed statistics for the CPUs of this machine: one migration column
// per possible CPU, as the kernel prints them (nr_cpu_ids), not only those this process may
// run on (under taskset or a cpuset) or those online.
func NewClientPath() *ClientPath {
	n := PossibleCPUs()
	return &ClientPath{MigFrom: make([]Counter, n), MigTo: make([]Counter, n)}
}

// PossibleCPUs is the kernel's nr_cpu_ids: one past the highest CPU id in
// /sys/devices/system/cpu/possible (runtime.NumCPU where that cannot be read).
var PossibleCPUs = sync.OnceValue(func() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err == nil {
		s := strings.TrimSpace(string(b))
		if i := strings.LastIndexAny(s, "-,"); i >= 0 {
			s = s[i+1:]
		}
		if n, err := strconv.Atoi(s); err == nil && n >= 0 {
			return n + 1
		}
	}
	return runtime.NumCPU()
})

// Done records a finished request: its direction, size, latency and the CPUs it was
// submitted and completed on.
func (s *ClientPath) Done(read bool, size uint64, lat time.Duration, cpuSub, cpuDone int, sgEntries int) {
	if read {
		s.ReadCnt.Inc()
		s.ReadBytes.Add(size)
		s.LatRead.observe(lat)
	} else {
		s.WriteCnt.Inc()
		s.WriteBytes.Add(size)
		s.LatWrite.observe(lat)
	}
	if cpuSub != cpuDone && cpuSub < len(s.MigFrom) && cpuDone < len(s.MigTo) {
		s.MigFrom[cpuSub].Inc()
		s.MigTo[cpuDone].Inc()
	}
	if sgEntries == 0 {
		s.sg0.Inc()
	}
}

// sg1Total is the total of requests with one scatter/gather entry. sg0 is read first: each
// request counts itself in the read or write count before sg0, so the difference cannot
// go below zero.
func (s *ClientPath) sg1Total() uint64 {
	sg0 := s.sg0.Total()
	return s.ReadCnt.Total() + s.WriteCnt.Total() - sg0
}

// HandlerCall records one completion-handler call that processed n completions.
func (s *ClientPath) HandlerCall(n int) {
	if n == 0 {
		return
	}
	s.WCMax.Observe(uint64(n))
	s.WCTotal.Add(uint64(n))
	s.Calls.Inc()
}

// RDMA renders stats/rdma: read-count read-bytes write-count write-bytes inflight failovered.
func (s *ClientPath) RDMA() string {
	return fmt.Sprintf("%d %d %d %d %d %d\n", s.ReadCnt.Value(), s.ReadBytes.Value(), s.WriteCnt.Value(),
		s.WriteBytes.Value(), uint32(s.Inflight.Load()), s.Failovered.Value())
}

// ResetRDMA resets what stats/rdma shows except inflight.
func (s *ClientPath) ResetRDMA() {
	for _, c := range []*Counter{&s.ReadCnt, &s.ReadBytes, &s.WriteCnt, &s.WriteBytes, &s.Failovered} {
		c.Reset()
	}
}

// Reconnects renders stats/reconnects: successful failed.
func (s *ClientPath) Reconnects() string {
	return fmt.Sprintf("%d %d\n", s.ReconnectOK.Value(), s.ReconnectFail.Value())
}

// ResetReconnects resets both reconnect counters.
func (s *ClientPath) ResetReconnects() {
	s.ReconnectOK.Reset()
	s.ReconnectFail.Reset()
}

func perCPU(cs []Counter) string {
	var b strings.Builder
	for i := range cs {
		fmt.Fprintf(&b, "%d ", cs[i].Value())
	}
	b.WriteByte('\n')
	return b.String()
}

// CPUMigrationFrom renders stats/cpu_migration_from: per CPU "%d ", then a newline.
func (s *ClientPath) CPUMigrationFrom() string { return perCPU(s.MigFrom) }

// CPUMigrationTo renders stats/cpu_migration_to.
func (s *ClientPath) CPUMigrationTo() string { return perCPU(s.MigTo) }

// CPUMigration renders the seed ABI's single cpu_migration file: a header of CPU columns,
// then the from: and to: rows.
func (s *ClientPath) CPUMigration() string {
	var b strings.Builder
	b.WriteString("    ")
	for i := range s.MigFrom {
		fmt.Fprintf(&b, " CPU%d", i)
	}
	b.WriteString("\nfrom:")
	for i := range s.MigFrom {
		fmt.Fprintf(&b, " %*d", len(fmt.Sprint(i))+3, s.MigFrom[i].Value())
	}
	b.WriteString("\nto  :")
	for i := range s.MigTo {
		fmt.Fprintf(&b, " %*d", len(fmt.Sprint(i))+3, s.MigTo[i].Value())
	}
	b.WriteByte('\n')
	return b.String()
}

// ResetCPUMigration resets both directions.
func (s *ClientPath) ResetCPUMigration() {
	for i := range s.MigFrom {
		s.MigFrom[i].Reset()
		s.MigTo[i].Reset()
	}
}

// RDMALat renders stats/rdma_lat in the seed ABI's format.
func (s *ClientPath) RDMALat() string {
	var b strings.Builder
	for k := 0; k <= LatBuckets; k++ {
		label := fmt.Sprintf("%d ms", 1<<k)
		if k == LatBuckets {
			label = fmt.Sprintf(">= %d ms", 1<<(LatBuckets-1))
		}
		fmt.Fprintf(&b, "%s: %d %d\n", label, s.LatRead.row(k), s.LatWrite.row(k))
	}
	fmt.Fprintf(&b, "maximum ms: %d %d\n", s.LatRead.Max.Value(), s.LatWrite.Max.Value())
	return b.String()
}

// ResetRDMALat resets the histograms and maxima.
func (s *ClientPath) ResetRDMALat() {
	s.LatRead.Reset()
	s.LatWrite.Reset()
}

// WCCompletion renders the client's stats/wc_completion: max average.
func (s *ClientPath) WCCompletion() string {
	avg := uint64(0)
	if c := s.Calls.Value(); c > 0 {
		avg = s.WCTotal.Value() / c
	}
	return fmt.Sprintf("%d %d\n", s.WCMax.Value(), avg)
}

// ResetWCCompletion resets the handler statistics.
func (s *ClientPath) ResetWCCompletion() {
	s.WCMax.Reset()
	s.WCTotal.Reset()
	s.Calls.Reset()
}

// SGEntriesTable renders stats/sg_entries: one line per entry count, "<n>: <requests>".
func (s *ClientPath) SGEntriesTable() string {
	// A request without data that was between its two counts when the baseline was taken
	// is in the baseline as a one-entry request: clamp rather than wrap below it.
	total := s.sg1Total()
	sg1 := total - min(s.sg1Base.Load(), total)
	return fmt.Sprintf("0: %d\n1: %d\n", s.sg0.Value(), sg1)
}

// ResetSGEntries resets the distribution.
func (s *ClientPath) ResetSGEntries() {
	s.sg0.Reset()
	s.sg1Base.Store(s.sg1Total())
}

// ResetAll resets every file's counters and zeroes inflight (reset_all).
func (s *ClientPath) ResetAll() {
	s.ResetRDMA()
	s.ResetReconnects()
	s.ResetCPUMigration()
	s.ResetRDMALat()
	s.ResetWCCompletion()
	s.ResetSGEntries()
	s.Inflight.Store(0)
}

// ServerPath are the statistics of one server path.
type ServerPath struct {
	// Counted per CPU: every connection of the path counts here, once per request.
	ReadCnt, ReadBytes, WriteCnt, WriteBytes Sharded
	Inflight                                 atomic.Int32
	WCMax                                    Max
	WCTotal, Calls                           Counter
}

// Request records a request handed up; hint is its chunk (see Sharded).
func (s *ServerPath) Request(read bool, size uint64, hint int) {
	if read {
		s.ReadCnt.Inc(hint)
		s.ReadBytes.Add(hint, size)
	} else {
		s.WriteCnt.Inc(hint)
		s.WriteBytes.Add(hint, size)
	}
}

// HandlerCall records one completion-handler call that processed n completions.
func (s *ServerPath) HandlerCall(n int) {
	if n == 0 {
		return
	}
	s.WCMax.Observe(uint64(n))
	s.WCTotal.Add(uint64(n))
	s.Calls.Inc()
}

// RDMA renders the kernel's server stats/rdma: 4 values.
func (s *ServerPath) RDMA() string {
	return fmt.Sprintf("%d %d %d %d\n", s.ReadCnt.Value(), s.ReadBytes.Value(), s.WriteCnt.Value(), s.WriteBytes.Value())
}

// ResetRDMA resets the counts and bytes.
func (s *ServerPath) ResetRDMA() {
	for _, c := range []*Sharded{&s.ReadCnt, &s.ReadBytes, &s.WriteCnt, &s.WriteBytes} {
		c.Reset()
	}
}

// WCCompletion renders the server's stats/wc_completion: max total calls.
func (s *ServerPath) WCCompletion() string {
	return fmt.Sprintf("%d %d %d\n", s.WCMax.Value(), s.WCTotal.Value(), s.Calls.Value())
}

// ResetWCCompletion resets the handler statistics.
func (s *ServerPath) ResetWCCompletion() {
	s.WCMax.Reset()
	s.WCTotal.Reset()
	s.Calls.Reset()
}

// ResetAll resets every counter.
func (s *ServerPath) ResetAll() {
	s.ResetRDMA()
	s.ResetWCCompletion()
}
