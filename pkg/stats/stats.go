// Package stats holds the counters the transport updates and the renderers that print them in
// the kernel's sysfs formats. Every counter is a monotonic total with a reset baseline: a
// reset moves the baseline, so what a file shows starts again from zero while the totals an
// exporter scrapes never go backwards. Counters are per path and atomic: counting takes no
// lock on the IO path.
package stats

import (
	"fmt"
	"runtime"
	"strings"
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

// LatBuckets is the number of power-of-two millisecond buckets of rdma_lat (1 ms..65536 ms).
const LatBuckets = 17

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

	// Latency histograms (rdma_lat) and maxima, in ms, for reads and writes.
	LatRead, LatWrite       [LatBuckets + 1]Counter
	LatMaxRead, LatMaxWrite Max

	// Completions per completion-handler call (wc_completion).
	WCMax          Max
	WCTotal, Calls Counter

	// SGEntries[n] counts requests whose data came in n scatter/gather entries (0 or 1:
	// the Go API takes one buffer).
	SGEntries [2]Counter
}

// NewClientPath returns zeroed statistics for the CPUs of this machine.
func NewClientPath() *ClientPath {
	n := runtime.NumCPU()
	return &ClientPath{MigFrom: make([]Counter, n), MigTo: make([]Counter, n)}
}

// latBucket maps a latency to its rdma_lat row: row k (label 2^k ms) holds latencies below
// 2^k ms not counted in a lower row; the last row holds 65536 ms and more.
func latBucket(d time.Duration) int {
	ms := uint64(d / time.Millisecond)
	for k := 0; k < LatBuckets; k++ {
		if ms < 1<<k {
			return k
		}
	}
	return LatBuckets
}

// Done records a finished request: its direction, size, latency and the CPUs it was
// submitted and completed on.
func (s *ClientPath) Done(read bool, size uint64, lat time.Duration, cpuSub, cpuDone int, sgEntries int) {
	ms := uint64(lat / time.Millisecond)
	if read {
		s.ReadCnt.Inc()
		s.ReadBytes.Add(size)
		s.LatRead[latBucket(lat)].Inc()
		s.LatMaxRead.Observe(ms)
	} else {
		s.WriteCnt.Inc()
		s.WriteBytes.Add(size)
		s.LatWrite[latBucket(lat)].Inc()
		s.LatMaxWrite.Observe(ms)
	}
	if cpuSub != cpuDone && cpuSub < len(s.MigFrom) && cpuDone < len(s.MigTo) {
		s.MigFrom[cpuSub].Inc()
		s.MigTo[cpuDone].Inc()
	}
	if sgEntries > 1 {
		sgEntries = 1
	}
	s.SGEntries[sgEntries].Inc()
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
	for k := 0; k < LatBuckets; k++ {
		fmt.Fprintf(&b, "%d ms: %d %d\n", 1<<k, s.LatRead[k].Value(), s.LatWrite[k].Value())
	}
	fmt.Fprintf(&b, ">= %d ms: %d %d\n", 1<<(LatBuckets-1), s.LatRead[LatBuckets].Value(), s.LatWrite[LatBuckets].Value())
	fmt.Fprintf(&b, "maximum ms: %d %d\n", s.LatMaxRead.Value(), s.LatMaxWrite.Value())
	return b.String()
}

// ResetRDMALat resets the histograms and maxima.
func (s *ClientPath) ResetRDMALat() {
	for k := range s.LatRead {
		s.LatRead[k].Reset()
		s.LatWrite[k].Reset()
	}
	s.LatMaxRead.Reset()
	s.LatMaxWrite.Reset()
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
	return fmt.Sprintf("0: %d\n1: %d\n", s.SGEntries[0].Value(), s.SGEntries[1].Value())
}

// ResetSGEntries resets the distribution.
func (s *ClientPath) ResetSGEntries() {
	s.SGEntries[0].Reset()
	s.SGEntries[1].Reset()
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

// ResetAll resets every counter.
func (s *ServerPath) ResetAll() {
	s.ResetRDMA()
	s.WCMax.Reset()
	s.WCTotal.Reset()
	s.Calls.Reset()
}
