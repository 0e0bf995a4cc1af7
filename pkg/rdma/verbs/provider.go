//go:build verbs

package verbs

// #include "glue.h"
import "C"

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Built reports whether this binary has the verbs provider (built with the verbs tag).
const Built = true

// Provider is the verbs provider: devices are librdmacm's (rdma_get_devices), so that a
// connection identifier's device and the PDs, CQs and MRs made on it share one context.
type Provider struct {
	mu      sync.Mutex
	devices map[string]*device
}

var (
	_ rdma.Provider    = (*Provider)(nil)
	_ rdma.CallCounter = (*Provider)(nil)
)

// New returns the verbs provider. It fails when rdma-core finds no RDMA device.
func New() (rdma.Provider, error) {
	p := &Provider{devices: map[string]*device{}}
	var n C.int
	list, err := C.rdma_get_devices(&n)
	if list == nil {
		return nil, fmt.Errorf("verbs: rdma_get_devices: %w", errOr(err))
	}
	// The list stays: librdmacm keeps the contexts open for the life of the process.
	for _, c := range unsafe.Slice(list, int(n)) {
		d := newDevice(c)
		p.devices[d.name] = d
	}
	if len(p.devices) == 0 {
		return nil, fmt.Errorf("verbs: no RDMA device: %w", rdma.ErrNoDevice)
	}
	return p, nil
}

// DataPathCalls counts the calls into C made by posts, polls and completion events
// (rdma.CallCounter): those of the QPs and CQs that exist now, and of those destroyed.
func (p *Provider) DataPathCalls() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var n uint64
	for _, d := range p.devices {
		n += d.dataPathCalls()
	}
	return n
}

// Name is "verbs".
func (p *Provider) Name() string { return "verbs" }

// Devices lists the RDMA devices with the network interface each serves (RoCE and iWARP
// devices have one; InfiniBand ports have none).
func (p *Provider) Devices() ([]rdma.DeviceInfo, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []rdma.DeviceInfo
	for name := range p.devices {
		out = append(out, rdma.DeviceInfo{Name: name, Interface: netdevOf(name)})
	}
	return out, nil
}

// netdevOf reads the interface behind port 1 of an RDMA device from sysfs.
func netdevOf(dev string) string {
	b, err := os.ReadFile(filepath.Join("/sys/class/infiniband", dev, "ports/1/gid_attrs/ndevs/0"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// OpenDevice returns the named device.
func (p *Provider) OpenDevice(name string) (rdma.Device, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d := p.devices[name]; d != nil {
		return d, nil
	}
	return nil, fmt.Errorf("verbs: %q: %w", name, rdma.ErrNoDevice)
}

// deviceOf returns the device of a librdmacm context.
func (p *Provider) deviceOf(c *C.struct_ibv_context) (*device, error) {
	name := C.GoString(C.ibv_get_device_name(c.device))
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.devices[name]
	if d == nil {
		// A device that appeared after start (librdmacm opens it on first use).
		d = newDevice(c)
		p.devices[name] = d
	}
	if d.ctx != c {
		return nil, fmt.Errorf("verbs: %s has a second context: %w", name, rdma.ErrInvalid)
	}
	return d, nil
}

type device struct {
	ctx  *C.struct_ibv_context
	name string
	attr rdma.DeviceAttr
	// mw is the device's memory window support: fast registration needs both types.
	mw bool

	mu  sync.Mutex
	qps map[uint32]*qp // by QP number, for completions
	// qpGen moves on whenever a QP leaves qps (before its number can be reused): a CQ's
	// cached QP (cq.qpFor) is good while the generation it was found in is current.
	qpGen atomic.Uint64
	// counted are the device's QPs and CQs that count calls into C, until their
	// destruction, and retired the calls of those destroyed: DataPathCalls adds the two.
	counted map[callCounted]struct{}
	retired atomic.Uint64
}

func newDevice(c *C.struct_ibv_context) *device {
	d := &device{ctx: c, name: C.GoString(C.ibv_get_device_name(c.device)), qps: map[uint32]*qp{}, counted: map[callCounted]struct{}{}}
	var a C.struct_ibv_device_attr
	if C.ibv_query_device(c, &a) == 0 {
		d.attr = rdma.DeviceAttr{
			MaxQPWR:     int(a.max_qp_wr),
			MaxSGE:      int(a.max_sge),
			MaxCQE:      int(a.max_cqe),
			MaxMRSize:   uint64(a.max_mr_size),
			PhysPortCnt: int(a.phys_port_cnt),
			// A memory window covers any range of its registered region: no page list.
			MaxFastRegPageListLen: int(min(uint64(a.max_mr_size)/4096, 1<<20)),
			MapRegisteredOnly:     true,
		}
		d.mw = a.device_cap_flags&C.IBV_DEVICE_MEM_WINDOW != 0 &&
			a.device_cap_flags&(C.IBV_DEVICE_MEM_WINDOW_TYPE_2A|C.IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0
	}
	var pa C.struct_ibv_port_attr
	if C.rtrs_query_port(c, 1, &pa) == 0 {
		d.attr.MaxMsgSize = uint32(pa.max_msg_sz)
	}
	return d
}

var _ rdma.Device = (*device)(nil)

func (d *device) Name() string           { return d.name }
func (d *device) Query() rdma.DeviceAttr { return d.attr }

func (d *device) QueryPort(port int) (rdma.PortAttr, error) {
	if port < 1 || port > 255 {
		return rdma.PortAttr{}, fmt.Errorf("%w: port %d", rdma.ErrInvalid, port)
	}
	var pa C.struct_ibv_port_attr
	if rc := C.rtrs_query_port(d.ctx, C.uint8_t(port), &pa); rc != 0 {
		return rdma.PortAttr{}, fmt.Errorf("verbs: ibv_query_port %s/%d: %w", d.name, port, syscall.Errno(rc))
	}
	a := rdma.PortAttr{State: rdma.PortState(pa.state), LinkLayer: "InfiniBand", MTU: 128 << uint(pa.active_mtu)}
	if pa.link_layer == C.IBV_LINK_LAYER_ETHERNET {
		a.LinkLayer = "Ethernet"
	}
	for i := 0; i < int(pa.gid_tbl_len); i++ {
		var g C.union_ibv_gid
		if C.ibv_query_gid(d.ctx, C.uint8_t(port), C.int(i), &g) != 0 {
			break
		}
		if gid := netip.AddrFrom16([16]byte(g[:])); gid != netip.IPv6Unspecified() {
			a.GIDs = append(a.GIDs, gid)
		}
	}
	return a, nil
}

func (d *device) AllocPD() (rdma.PD, error) {
	p, err := C.ibv_alloc_pd(d.ctx)
	if p == nil {
		return nil, fmt.Errorf("verbs: ibv_alloc_pd: %w", errOr(err))
	}
	return &pd{dev: d, pd: p}, nil
}

func (d *device) Close() error { return nil }

func (d *device) addQP(q *qp) {
	d.mu.Lock()
	d.qps[q.num] = q
	d.counted[q] = struct{}{}
	d.mu.Unlock()
}

func (d *device) removeQP(q *qp) {
	d.mu.Lock()
	if d.qps[q.num] == q {
		delete(d.qps, q.num)
		d.qpGen.Add(1)
	}
	d.mu.Unlock()
}

// callCounted is a QP or CQ, which counts its calls into C.
type callCounted interface{ callCount() uint64 }

func (q *qp) callCount() uint64 { return q.calls.Load() }
func (c *cq) callCount() uint64 { return c.calls.Load() }

func (d *device) addCQ(c *cq) {
	d.mu.Lock()
	d.counted[c] = struct{}{}
	d.mu.Unlock()
}

// retire moves a destroyed QP's or CQ's calls into the device's count. Called once the
// object makes no more calls (its dead flag set under its lock).
func (d *device) retire(o callCounted) {
	d.mu.Lock()
	if _, ok := d.counted[o]; ok {
		delete(d.counted, o)
		d.retired.Add(o.callCount())
	}
	d.mu.Unlock()
}

// dataPathCalls adds up the device's calls into C on the data path.
func (d *device) dataPathCalls() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.retired.Load()
	for o := range d.counted {
		n += o.callCount()
	}
	return n
}

func (d *device) qp(num uint32) *qp {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.qps[num]
}

// errnoOf is the error of a verbs call that returns an errno.
func errnoOf(rc C.int) error {
	if rc < 0 {
		rc = -rc
	}
	return syscall.Errno(rc)
}

// errOr is the errno a failed call left (cgo's second result), EIO if it left none.
func errOr(err error) error {
	if err == nil || err == syscall.Errno(0) {
		return syscall.EIO
	}
	return err
}
