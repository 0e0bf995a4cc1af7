// Package soft is the embedded RDMA provider: verbs semantics over TCP, one TCP connection per
// queue pair, in the spirit of soft-iWARP. One-sided operations are executed by the responder
// against its own registered memory, with rkey, access and bounds checks; payload moves between
// the socket and MR memory without staging buffers. The frame format is in docs/soft-rdma.md.
package soft

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
	"golang.org/x/sys/unix"
)

// Device limits. They are generous but bounded so that a peer cannot make us allocate without
// limit.
const (
	maxQPWR       = 16384
	maxSGE        = 32
	maxCQE        = 1 << 20
	maxMRSize     = 1 << 40
	maxFRPageList = 512
	devicePrefix  = "soft_"
)

// Provider is the soft provider. The zero value is not usable; use New.
type Provider struct {
	opts Options

	mu   sync.Mutex
	devs map[string]*device
	pds  atomic.Int64 // allocated and not deallocated
}

// LivePDs is how many protection domains of the provider's devices are allocated and not
// deallocated: what a leak check compares.
func (p *Provider) LivePDs() int64 { return p.pds.Load() }

// Options tune the provider. Zero values take the defaults.
type Options struct {
	// RNRTimer is how long a responder waits for a receive before counting one RNR retry
	// (default 10 ms).
	RNRTimer time.Duration
	// ReadBufSize is the socket read buffer per QP: headers and small payloads that arrive
	// together are taken from it, larger payloads go straight to MR memory (default 64 KiB).
	ReadBufSize int
	// MaxPending bounds a listener's unfinished incoming connections: accepted by TCP, and
	// not yet accepted or rejected by the listener's user (default 256). Past it new ones are
	// closed at once.
	MaxPending int
	// MaxPendingPerAddr bounds them per peer address (default 32), so one host cannot take
	// every slot.
	MaxPendingPerAddr int
	// HandshakeTimeout is how long a new connection may take to send its connection request
	// (default 5 s).
	HandshakeTimeout time.Duration
	// TLS, when set, runs every connection inside TLS, both ways authenticated: a listener
	// presents Certificates and requires a client certificate from ClientCAs; a connect
	// presents Certificates and checks the server's against RootCAs, by ServerName or, when
	// that is empty, by the destination address. The peer's certificate subject is then the
	// connection's identity (rdma.Authenticated).
	TLS *tls.Config
	// LateLocalOps makes the devices report SyncLocalOps false, as an HCA does, so that a
	// consumer takes the path it takes on hardware: waiting for the completions of its
	// LOCAL_INVs and REG_MRs. The operations still take effect when posted (tests).
	LateLocalOps bool
}

// Defaults of the listener's admission bounds (Options).
const (
	DefaultMaxPending        = 256
	DefaultMaxPendingPerAddr = 32
	DefaultHandshakeTimeout  = 5 * time.Second
)

// New returns a soft provider.
func New(o Options) *Provider {
	if o.RNRTimer <= 0 {
		o.RNRTimer = 10 * time.Millisecond
	}
	if o.ReadBufSize <= 0 {
		o.ReadBufSize = 64 << 10
	}
	if o.MaxPending <= 0 {
		o.MaxPending = DefaultMaxPending
	}
	if o.MaxPendingPerAddr <= 0 {
		o.MaxPendingPerAddr = DefaultMaxPendingPerAddr
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	return &Provider{opts: o, devs: map[string]*device{}}
}

var _ rdma.Provider = (*Provider)(nil)

// Name is "soft".
func (p *Provider) Name() string { return "soft" }

// Devices lists one device per local interface that is up and has an address.
func (p *Provider) Devices() ([]rdma.DeviceInfo, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("soft-rdma: list interfaces: %w", err)
	}
	var out []rdma.DeviceInfo
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 {
			continue
		}
		if addrs, err := ifc.Addrs(); err != nil || len(addrs) == 0 {
			continue
		}
		out = append(out, rdma.DeviceInfo{Name: devicePrefix + ifc.Name, Interface: ifc.Name})
	}
	return out, nil
}

// OpenDevice opens the device named name ("soft_<interface>").
func (p *Provider) OpenDevice(name string) (rdma.Device, error) {
	ifname, ok := strings.CutPrefix(name, devicePrefix)
	if !ok || ifname == "" {
		return nil, fmt.Errorf("%w: %q", rdma.ErrNoDevice, name)
	}
	if _, err := net.InterfaceByName(ifname); err != nil {
		return nil, fmt.Errorf("%w: %q: %v", rdma.ErrNoDevice, name, err)
	}
	return p.device(ifname), nil
}

// device returns the one device object of an interface, creating it on first use.
func (p *Provider) device(ifname string) *device {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.devs[ifname]
	if d == nil {
		d = &device{prov: p, name: devicePrefix + ifname, ifname: ifname}
		p.devs[ifname] = d
	}
	return d
}

// deviceFor returns the device of the interface that owns local address a.
func (p *Provider) deviceFor(a netip.Addr) (*device, error) {
	a = a.Unmap()
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("soft-rdma: list interfaces: %w", err)
	}
	var best string
	bestBits := -1
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, ad := range addrs {
			ipn, ok := ad.(*net.IPNet)
			if !ok {
				continue
			}
			pfx, err := netip.ParsePrefix(ipn.String())
			if err != nil {
				continue
			}
			pa := pfx.Addr().Unmap()
			if pa == a {
				return p.device(ifc.Name), nil
			}
			// 127.0.0.2 belongs to lo through 127.0.0.1/8: the longest containing prefix wins.
			if netip.PrefixFrom(pa, pfx.Bits()).Contains(a) && pfx.Bits() > bestBits && ifc.Flags&net.FlagLoopback != 0 {
				best, bestBits = ifc.Name, pfx.Bits()
			}
		}
	}
	if best == "" {
		return nil, fmt.Errorf("%w: %s is not a local address", rdma.ErrAddrError, a)
	}
	return p.device(best), nil
}

// device is one soft device: the key table of its memory regions and its QP numbers.
type device struct {
	prov   *Provider
	name   string
	ifname string

	qpn atomic.Uint32

	mu sync.Mutex
	// mrs is the table of regions, index = key >> 8, in pages of mrPageLen. Every access to
	// memory looks a key up, from every QP's goroutine, so lookups take no lock: entries are
	// atomic, and the list of pages is replaced, never changed, under mu when it grows. A
	// region added or removed costs a store, not a copy of the table: a server registers a
	// region per chunk on every path (a 64-client storm: 65 000), and copying the whole table
	// for each of them allocated gigabytes as the sessions came and went.
	mrs     atomic.Pointer[[]*mrPage]
	n       uint32   // indexes handed out
	keyByte []uint8  // last key byte used per index, so a reused index gets a fresh key
	free    []uint32 // free indexes
}

const mrPageLen = 1024

type mrPage [mrPageLen]atomic.Pointer[mr]

var _ rdma.Device = (*device)(nil)

func (d *device) Name() string { return d.name }

func (d *device) Query() rdma.DeviceAttr {
	return rdma.DeviceAttr{
		MaxQPWR: maxQPWR, MaxSGE: maxSGE, MaxCQE: maxCQE, MaxMRSize: maxMRSize,
		MaxFastRegPageListLen: maxFRPageList, MaxMsgSize: maxMsgSize, PhysPortCnt: 1,
		SyncLocalOps: !d.prov.opts.LateLocalOps,
	}
}

func (d *device) QueryPort(port int) (rdma.PortAttr, error) {
	if port != 1 {
		return rdma.PortAttr{}, fmt.Errorf("%w: port %d (the device has port 1)", rdma.ErrInvalid, port)
	}
	st := rdma.PortDown
	mtu := 0
	if ifc, err := net.InterfaceByName(d.ifname); err == nil {
		if ifc.Flags&net.FlagUp != 0 {
			st = rdma.PortActive
		}
		mtu = ifc.MTU
	}
	return rdma.PortAttr{State: st, LinkLayer: "Ethernet", MTU: mtu}, nil
}

func (d *device) AllocPD() (rdma.PD, error) {
	d.prov.pds.Add(1)
	return &pd{dev: d}, nil
}

func (d *device) CreateCQ(cqe int) (rdma.CQ, error) {
	if cqe < 1 || cqe > maxCQE {
		return nil, fmt.Errorf("%w: cqe %d not in 1..%d", rdma.ErrInvalid, cqe, maxCQE)
	}
	return newCQ(cqe), nil
}

// Close is a no-op: the device object lives as long as the provider.
func (d *device) Close() error { return nil }

// addMR gives m an index and an initial key.
func (d *device) addMR(m *mr) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var idx uint32
	if n := len(d.free); n > 0 {
		idx = d.free[n-1]
		d.free = d.free[:n-1]
	} else {
		idx = d.n
		d.n++
		d.keyByte = append(d.keyByte, 0)
		var pages []*mrPage
		if t := d.mrs.Load(); t != nil {
			pages = *t
		}
		if int(idx/mrPageLen) == len(pages) {
			grown := append(make([]*mrPage, 0, len(pages)+1), pages...)
			grown = append(grown, new(mrPage))
			d.mrs.Store(&grown)
		}
	}
	d.keyByte[idx]++
	m.st.Store(m.st.Load()&^0xffffffff | uint64(idx<<8|uint32(d.keyByte[idx])))
	d.entry(idx).Store(m)
}

// entry is index idx's slot, or nil past the table.
func (d *device) entry(idx uint32) *atomic.Pointer[mr] {
	t := d.mrs.Load()
	if t == nil || int(idx/mrPageLen) >= len(*t) {
		return nil
	}
	return &(*t)[idx/mrPageLen][idx%mrPageLen]
}

func (d *device) removeMR(m *mr) {
	d.mu.Lock()
	defer d.mu.Unlock()
	key := m.key()
	idx := key >> 8
	if e := d.entry(idx); e != nil && e.Load() == m {
		d.keyByte[idx] = uint8(key)
		e.Store(nil)
		d.free = append(d.free, idx)
	}
}

// lookup returns the MR whose index key names, or nil. The caller checks the full key.
func (d *device) lookup(key uint32) *mr {
	if e := d.entry(key >> 8); e != nil {
		return e.Load()
	}
	return nil
}

type pd struct {
	dev   *device
	freed atomic.Bool
}

var _ rdma.PD = (*pd)(nil)

func (p *pd) Device() rdma.Device { return p.dev }

func (p *pd) RegMR(buf []byte, access rdma.Access) (rdma.MR, error) {
	if len(buf) == 0 || uint64(len(buf)) > maxMRSize {
		return nil, fmt.Errorf("%w: MR length %d", rdma.ErrInvalid, len(buf))
	}
	if access&^(rdma.AccessLocalWrite|rdma.AccessRemoteWrite|rdma.AccessRemoteRead) != 0 {
		return nil, fmt.Errorf("%w: access %#x", rdma.ErrInvalid, uint32(access))
	}
	// As in verbs, remote write needs local write.
	if access&rdma.AccessRemoteWrite != 0 && access&rdma.AccessLocalWrite == 0 {
		return nil, fmt.Errorf("%w: REMOTE_WRITE without LOCAL_WRITE", rdma.ErrInvalid)
	}
	if p.freed.Load() {
		return nil, rdma.ErrClosed
	}
	m := &mr{pd: p, buf: buf, iova: nextIOVA(len(buf)), maxLen: len(buf)}
	m.setState(0, access, true, false)
	p.dev.addMR(m)
	return m, nil
}

func (p *pd) AllocMR(length int, access rdma.Access) (rdma.MR, error) {
	if length <= 0 || uint64(length) > maxMRSize {
		return nil, fmt.Errorf("%w: MR length %d", rdma.ErrInvalid, length)
	}
	return p.RegMR(make([]byte, length), access)
}

// RegFileMR registers a range of a regular file. Only local read is granted: the soft
// provider sends from the file with sendfile and never maps it, so nothing here can fault
// on a file that shrinks.
func (p *pd) RegFileMR(f *os.File, off int64, length int, access rdma.Access) (rdma.MR, error) {
	if length <= 0 || uint64(length) > maxMRSize || off < 0 || off+int64(length) < off {
		return nil, fmt.Errorf("%w: file MR of %d bytes at %d", rdma.ErrInvalid, length, off)
	}
	if access != 0 {
		return nil, fmt.Errorf("%w: file MR with access %v (the soft provider gives local read only)", rdma.ErrInvalid, access)
	}
	if p.freed.Load() {
		return nil, rdma.ErrClosed
	}
	var fd int
	sc, err := f.SyscallConn()
	if err == nil {
		cerr := sc.Control(func(raw uintptr) {
			var st unix.Stat_t
			if err = unix.Fstat(int(raw), &st); err == nil && st.Mode&unix.S_IFMT != unix.S_IFREG {
				err = fmt.Errorf("%w: file MR of %s: not a regular file", rdma.ErrInvalid, f.Name())
			}
			if err == nil {
				fd, err = unix.FcntlInt(raw, unix.F_DUPFD_CLOEXEC, 0)
			}
		})
		err = errors.Join(cerr, err)
	}
	if err != nil {
		return nil, fmt.Errorf("soft-rdma: file MR: %w", err)
	}
	fr := &fileRef{fd: fd}
	fr.refs.Store(1)
	m := &mr{pd: p, file: fr, foff: off, iova: nextIOVA(length), maxLen: length}
	m.setState(0, access, true, false)
	p.dev.addMR(m)
	return m, nil
}

// fileRef is a file region's descriptor, shared by the region and the queued pieces that
// send from it: the last of them to let go closes it, so a piece never names a closed (or
// reused) descriptor.
type fileRef struct {
	fd   int
	refs atomic.Int32
}

// get takes a reference unless the last one is already gone.
func (f *fileRef) get() bool {
	for {
		r := f.refs.Load()
		if r <= 0 {
			return false
		}
		if f.refs.CompareAndSwap(r, r+1) {
			return true
		}
	}
}

func (f *fileRef) put() {
	if f.refs.Add(-1) == 0 {
		_ = unix.Close(f.fd)
	}
}

func (p *pd) AllocFastRegMR(maxLen int, flags rdma.FastRegFlags) (rdma.MR, error) {
	if maxLen <= 0 || maxLen > maxFRPageList*4096 {
		return nil, fmt.Errorf("%w: fast-reg MR of %d bytes (at most %d)", rdma.ErrInvalid, maxLen, maxFRPageList*4096)
	}
	if p.freed.Load() {
		return nil, rdma.ErrClosed
	}
	if flags&^rdma.FastRegRemoteInv != 0 {
		return nil, fmt.Errorf("%w: fast-reg flags %#x", rdma.ErrInvalid, uint8(flags))
	}
	m := &mr{pd: p, fastReg: true, remoteInv: flags&rdma.FastRegRemoteInv != 0, maxLen: maxLen}
	m.setState(0, 0, false, false)
	p.dev.addMR(m)
	return m, nil
}

func (p *pd) Dealloc() error {
	if p.freed.Swap(true) {
		return rdma.ErrClosed
	}
	p.dev.prov.pds.Add(-1)
	return nil
}

// iovaNext hands out I/O virtual addresses so that no two regions ever overlap, which keeps a
// stray address meant for one region from landing in another.
var iovaNext atomic.Uint64

func init() { iovaNext.Store(0x10000000) }

func nextIOVA(n int) uint64 {
	span := (uint64(n) + 0xfff) &^ 0xfff
	return iovaNext.Add(span+0x1000) - span
}

// mr is a memory region. Key, access and the valid and deregistered flags are one atomic
// word, changed under mu; the memory of a registered region (RegMR) never changes, so the data
// path checks those regions without a lock (every connection of a path shares some, such as
// the server's chunks, and a lock there is a cache line passed between CPUs per IO). A
// fast-reg region's memory changes with Map: it is read under mu.
type mr struct {
	pd      *pd
	fastReg bool
	// remoteInv: a fast-reg region its peer may invalidate (rdma.FastRegRemoteInv).
	remoteInv bool
	maxLen    int
	st        atomic.Uint64

	// A file region (RegFileMR) has no memory: file, and foff where iova maps to.
	file *fileRef
	foff int64

	mu   sync.Mutex
	buf  []byte
	iova uint64
	// bound is the QP whose REG_MR last made a remoteInv region valid: its peer alone may
	// name the key (a type 2 memory window is bound to its QP).
	bound *qp
	// placers are the QPs whose readers are copying a peer's RDMA WRITE payload into a
	// fast-reg region now (resolved with a key that was valid when the frame began). An
	// invalidation or deregistration cuts them (fence): on an HCA no byte of a write lands
	// once the key is invalid, and a peer that trickles a write in after answering would
	// otherwise write into memory handed back to its owner.
	placers []*qp
}

// fence moves the QPs still placing into a region just invalidated to error and waits for
// their copies to stop (qp.ToError). Called with no QP's or region's lock held.
func fence(placers []*qp) {
	for _, q := range placers {
		q.ToError()
	}
}

// placed ends q's placement into m (resolve with place set).
func (m *mr) placed(q *qp) {
	m.mu.Lock()
	for i, o := range m.placers {
		if o == q {
			m.placers = append(m.placers[:i], m.placers[i+1:]...)
			break
		}
	}
	m.mu.Unlock()
}

// The state word: key in bits 0-31, access in 32-39, valid bit 40, deregistered bit 41.
const (
	stValid = 1 << 40
	stDereg = 1 << 41
)

func (m *mr) setState(key uint32, access rdma.Access, valid, dereg bool) {
	v := uint64(key) | uint64(access&0xff)<<32
	if valid {
		v |= stValid
	}
	if dereg {
		v |= stDereg
	}
	m.st.Store(v)
}

func (m *mr) key() uint32         { return uint32(m.st.Load()) }
func (m *mr) access() rdma.Access { return rdma.Access(m.st.Load() >> 32 & 0xff) }

// usable reports whether the state grants need under key.
func usable(st uint64, key uint32, need rdma.Access) bool {
	return uint32(st) == key && st&stValid != 0 && st&stDereg == 0 && rdma.Access(st>>32&0xff)&need == need
}

var _ rdma.MR = (*mr)(nil)

func (m *mr) LKey() uint32 { return m.key() }
func (m *mr) RKey() uint32 { return m.LKey() }
func (m *mr) Addr() uint64 { _, iova := m.mem(); return iova }
func (m *mr) Len() int {
	if m.file != nil {
		return m.maxLen
	}
	b, _ := m.mem()
	return len(b)
}
func (m *mr) Bytes() []byte {
	b, _ := m.mem()
	return b
}

// mem is the region's memory and address: fixed for a registered region, under mu for a
// fast-reg one.
func (m *mr) mem() ([]byte, uint64) {
	if !m.fastReg {
		return m.buf, m.iova
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.buf, m.iova
}
func (m *mr) Access() rdma.Access { return m.access() }
func (m *mr) Valid() bool         { st := m.st.Load(); return st&stValid != 0 && st&stDereg == 0 }

func (m *mr) Map(buf []byte, iova uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.st.Load()
	switch {
	case st&stDereg != 0:
		return rdma.ErrClosed
	case !m.fastReg:
		return fmt.Errorf("%w: map of a registered MR (only fast-reg MRs map memory)", rdma.ErrInvalid)
	case st&stValid != 0:
		return fmt.Errorf("%w: map of a valid MR (invalidate it first)", rdma.ErrInvalid)
	case len(buf) == 0 || len(buf) > m.maxLen:
		return fmt.Errorf("%w: map of %d bytes into an MR of at most %d", rdma.ErrInvalid, len(buf), m.maxLen)
	case iova+uint64(len(buf)) < iova:
		return fmt.Errorf("%w: iova range wraps", rdma.ErrInvalid)
	}
	m.buf, m.iova = buf, iova
	return nil
}

func (m *mr) Dereg() error {
	m.mu.Lock()
	if m.st.Load()&stDereg != 0 {
		m.mu.Unlock()
		return rdma.ErrClosed
	}
	m.setState(m.key(), m.access(), false, true)
	placers := slices.Clone(m.placers)
	m.mu.Unlock()
	fence(placers)
	m.pd.dev.removeMR(m)
	if m.file != nil {
		m.file.put()
	}
	return nil
}

// resolveFile returns the file piece that an SGE naming a file region of pd stands for; ok is
// false when key names no file region. A piece holds a reference on the file.
func (d *device) resolveFile(p *pd, key uint32, addr uint64, n uint32) (s seg, st rdma.WCStatus, ok bool) {
	m := d.lookup(key)
	if m == nil || m.file == nil {
		return seg{}, 0, false
	}
	if m.pd != p || !usable(m.st.Load(), key, 0) || addr < m.iova || addr-m.iova > uint64(m.maxLen) ||
		uint64(n) > uint64(m.maxLen)-(addr-m.iova) || !m.file.get() {
		return seg{}, rdma.WCLocProtErr, true
	}
	return seg{f: m.file, off: m.foff + int64(addr-m.iova), n: int(n)}, rdma.WCSuccess, true
}

// resolve checks that key names a valid region of pd granting need, covering [addr, addr+n),
// and returns the bytes. from is the QP executing a peer's request (nil for local access): a
// remoteInv region serves only the QP it was registered on. It returns the completion status
// to report when the key does not grant the access.
func (d *device) resolve(p *pd, from *qp, key uint32, addr uint64, n uint32, need rdma.Access) ([]byte, rdma.WCStatus) {
	b, _, st := d.resolvePlace(p, from, key, addr, n, need, false)
	return b, st
}

// resolvePlace is resolve; with place, a peer's RDMA WRITE into a fast-reg region is recorded
// as under way (m.placers) until the caller's m.placed: the region is returned then.
func (d *device) resolvePlace(p *pd, from *qp, key uint32, addr uint64, n uint32, need rdma.Access, place bool) ([]byte, *mr, rdma.WCStatus) {
	bad := rdma.WCLocProtErr
	if from != nil {
		bad = rdma.WCRemAccessErr
	}
	m := d.lookup(key)
	if m == nil || m.pd != p {
		return nil, nil, bad
	}
	if m.fastReg {
		m.mu.Lock()
	}
	ok := usable(m.st.Load(), key, need) && (from == nil || !m.remoteInv || m.bound == from) &&
		addr >= m.iova && addr-m.iova <= uint64(len(m.buf)) && uint64(n) <= uint64(len(m.buf))-(addr-m.iova)
	var b []byte
	if ok {
		off := addr - m.iova
		b = m.buf[off : off+uint64(n) : off+uint64(n)]
	}
	placing := ok && place && m.fastReg
	if placing {
		m.placers = append(m.placers, from)
	}
	if m.fastReg {
		m.mu.Unlock()
	}
	if !ok {
		return nil, nil, bad
	}
	if !placing {
		m = nil
	}
	return b, m, rdma.WCSuccess
}

// invalidate invalidates the region of pd named by key; from is the QP a remote invalidation
// came in on (nil: a local one). It returns the QPs placing a write into the region, which the
// caller fences once it holds no lock. A peer may invalidate only a
// fast-reg region allocated for it (rdma.FastRegRemoteInv), as a type 2 memory window.
func (d *device) invalidate(p *pd, from *qp, key uint32) (ok bool, placers []*qp) {
	m := d.lookup(key)
	if m == nil || from != nil && !m.remoteInv {
		return false, nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.st.Load()
	if m.pd != p || uint32(st) != key || st&stDereg != 0 {
		return false, nil
	}
	// A peer invalidates only what it was granted: a valid region with remote access, made
	// so by a REG_MR on the QP the request came in on (a type 2 window's binding).
	if from != nil && (st&stValid == 0 || m.access()&(rdma.AccessRemoteWrite|rdma.AccessRemoteRead) == 0 || m.bound != from) {
		return false, nil
	}
	m.setState(key, m.access(), false, false)
	// The peer's own invalidation comes from the reader that places its writes, between
	// frames: only a local one can find a placement under way.
	return true, slices.Clone(m.placers)
}

// register makes region m valid with key and access (a REG_MR work request posted on q).
func (d *device) register(p *pd, q *qp, m rdma.MR, key uint32, access rdma.Access) bool {
	sm, ok := m.(*mr)
	if !ok || sm.pd != p {
		return false
	}
	if access&^(rdma.AccessLocalWrite|rdma.AccessRemoteWrite|rdma.AccessRemoteRead) != 0 {
		return false
	}
	sm.mu.Lock()
	defer sm.mu.Unlock()
	st := sm.st.Load()
	if st&(stDereg|stValid) != 0 || sm.buf == nil || key>>8 != uint32(st)>>8 {
		return false
	}
	sm.setState(key, access, true, false)
	sm.bound = q
	return true
}
