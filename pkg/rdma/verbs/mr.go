//go:build verbs

package verbs

// #include "glue.h"
import "C"

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

type pd struct {
	dev *device
	pd  *C.struct_ibv_pd

	mu    sync.Mutex
	freed bool
	regs  []*mr // registered regions, for Map to find the one under a buffer
	// starts indexes regs by start address: Map's common case, a buffer that begins a
	// region of its own (a ublk tag's buffer), is then found without the scan.
	starts map[uintptr]*mr
	byKey  map[uint32]*mr // memory windows by their current key, for LOCAL_INV and SEND_WITH_INV
}

var _ rdma.PD = (*pd)(nil)

func (p *pd) Device() rdma.Device { return p.dev }

const accessAll = rdma.AccessLocalWrite | rdma.AccessRemoteWrite | rdma.AccessRemoteRead

func ibvAccess(a rdma.Access) C.int {
	var f C.int
	if a&rdma.AccessLocalWrite != 0 {
		f |= C.IBV_ACCESS_LOCAL_WRITE
	}
	if a&rdma.AccessRemoteWrite != 0 {
		f |= C.IBV_ACCESS_REMOTE_WRITE
	}
	if a&rdma.AccessRemoteRead != 0 {
		f |= C.IBV_ACCESS_REMOTE_READ
	}
	return f
}

// RegMR registers memory from rdma.Alloc (ibv_reg_mr). Go heap memory is refused: the
// HCA would hold it while the garbage collector knows nothing of that.
func (p *pd) RegMR(buf []byte, access rdma.Access) (rdma.MR, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("%w: MR length 0", rdma.ErrInvalid)
	}
	if !rdma.Allocated(buf) {
		return nil, fmt.Errorf("%w: verbs registers only memory from rdma.Alloc (outside the Go heap)", rdma.ErrInvalid)
	}
	return p.reg(buf, access, false, true)
}

// AllocMR maps and registers length bytes; Dereg unmaps them.
func (p *pd) AllocMR(length int, access rdma.Access) (rdma.MR, error) {
	buf, err := rdma.Alloc(length)
	if err != nil {
		return nil, err
	}
	m, err := p.reg(buf, access, true, true)
	if err != nil {
		_ = rdma.Free(buf)
	}
	return m, err
}

// reg registers buf; listed regions are the ones Map may find memory in (a window's own
// region is not: Map looks for the caller's registrations, and on every READ).
func (p *pd) reg(buf []byte, access rdma.Access, owned, listed bool) (*mr, error) {
	if access&^accessAll != 0 {
		return nil, fmt.Errorf("%w: access %#x", rdma.ErrInvalid, uint32(access))
	}
	if access&rdma.AccessRemoteWrite != 0 && access&rdma.AccessLocalWrite == 0 {
		return nil, fmt.Errorf("%w: REMOTE_WRITE without LOCAL_WRITE", rdma.ErrInvalid)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freed {
		return nil, rdma.ErrClosed
	}
	f := ibvAccess(access)
	if p.dev.mw {
		// Memory windows are bound over registered regions (fast registration).
		f |= C.IBV_ACCESS_MW_BIND
	}
	r, err := C.ibv_reg_mr(p.pd, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), f)
	if r == nil {
		return nil, fmt.Errorf("verbs: ibv_reg_mr of %d bytes: %w", len(buf), errOr(err))
	}
	m := &mr{pd: p, mr: r, buf: buf, owned: owned, access: access}
	m.valid.Store(true)
	if listed {
		p.regs = append(p.regs, m)
		if p.starts == nil {
			p.starts = map[uintptr]*mr{}
		}
		p.starts[uintptr(unsafe.Pointer(&buf[0]))] = m
	}
	return m, nil
}

// RegFileMR is refused: rdma-core registers files only as dma-bufs, which a page-cache file
// is not. Callers send from memory instead.
func (p *pd) RegFileMR(f *os.File, off int64, length int, access rdma.Access) (rdma.MR, error) {
	return nil, fmt.Errorf("%w: verbs has no file regions (ibv_reg_dmabuf_mr takes dma-bufs, not files)", rdma.ErrInvalid)
}

// AllocFastRegMR allocates a memory window: type 2 (QP-bound, remotely invalidated) with
// rdma.FastRegRemoteInv, type 1 (every QP of the PD) without.
func (p *pd) AllocFastRegMR(maxLen int, flags rdma.FastRegFlags) (rdma.MR, error) {
	if maxLen <= 0 {
		return nil, fmt.Errorf("%w: fast-reg MR of %d bytes", rdma.ErrInvalid, maxLen)
	}
	if flags&^rdma.FastRegRemoteInv != 0 {
		return nil, fmt.Errorf("%w: fast-reg flags %#x", rdma.ErrInvalid, uint8(flags))
	}
	if !p.dev.mw {
		return nil, fmt.Errorf("%w: %s has no memory windows, which fast registration needs", rdma.ErrInvalid, p.dev.name)
	}
	typ := uint32(C.IBV_MW_TYPE_1)
	if flags&rdma.FastRegRemoteInv != 0 {
		typ = C.IBV_MW_TYPE_2
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freed {
		return nil, rdma.ErrClosed
	}
	w, err := C.ibv_alloc_mw(p.pd, typ)
	if w == nil {
		return nil, fmt.Errorf("verbs: ibv_alloc_mw: %w", errOr(err))
	}
	m := &mr{pd: p, mw: w, maxLen: maxLen, type2: typ == C.IBV_MW_TYPE_2}
	m.key.Store(uint32(C.rtrs_mw_rkey(w)))
	return m, nil
}

func (p *pd) Dealloc() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freed {
		return rdma.ErrClosed
	}
	if rc := C.ibv_dealloc_pd(p.pd); rc != 0 {
		return fmt.Errorf("verbs: ibv_dealloc_pd: %w", errnoOf(rc))
	}
	p.freed = true
	return nil
}

// release lets go of the type 2 windows bound to q, before q is destroyed: a bound window
// holds its QP, and rxe's destroy waits for it (for a minute, then fails). The QP is in error,
// where no invalidation would execute, so each such window is replaced by a fresh one: its key
// is dead with the QP anyway.
func (p *pd) release(q *qp) {
	p.mu.Lock()
	var ws []*mr
	for _, m := range p.byKey {
		ws = append(ws, m)
	}
	p.mu.Unlock()
	for _, m := range ws {
		m.mu.Lock()
		if m.boundQP != q || m.dereg {
			m.mu.Unlock()
			continue
		}
		old := m.key.Load()
		w, _ := C.ibv_alloc_mw(p.pd, C.IBV_MW_TYPE_2)
		if w != nil {
			C.ibv_dealloc_mw(m.mw)
			m.mw = w
		}
		m.boundQP = nil
		m.valid.Store(false)
		key := uint32(C.rtrs_mw_rkey(m.mw))
		m.key.Store(key)
		m.mu.Unlock()
		p.rekey(m, old, key)
	}
}

// under returns the registered region of p holding buf.
func (p *pd) under(buf []byte) *mr {
	a := uintptr(unsafe.Pointer(&buf[0]))
	p.mu.Lock()
	defer p.mu.Unlock()
	if m := p.starts[a]; m != nil && len(buf) <= len(m.buf) {
		return m
	}
	for _, m := range p.regs {
		b := uintptr(unsafe.Pointer(&m.buf[0]))
		if a >= b && a-b <= uintptr(len(m.buf)) && uintptr(len(buf)) <= uintptr(len(m.buf))-(a-b) {
			return m
		}
	}
	return nil
}

// rekey records a window's new key.
func (p *pd) rekey(m *mr, old, key uint32) {
	p.mu.Lock()
	if p.byKey == nil {
		p.byKey = map[uint32]*mr{}
	}
	if p.byKey[old] == m {
		delete(p.byKey, old)
	}
	p.byKey[key] = m
	p.mu.Unlock()
}

func (p *pd) window(key uint32) *mr {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.byKey[key]
}

// mr is a registered region (mr set) or a memory window standing for a fast-registration
// region (mw set).
type mr struct {
	pd     *pd
	mr     *C.struct_ibv_mr
	mw     *C.struct_ibv_mw
	maxLen int
	type2  bool
	owned  bool // memory from AllocMR, unmapped at Dereg

	// A window's state as posted: key, validity, and what it is bound over. A consumer
	// that needs the key dead or alive waits for the work request's completion (the device
	// executes it later: SyncLocalOps is false).
	key   atomic.Uint32
	valid atomic.Bool
	mu    sync.Mutex
	buf   []byte
	base  *mr // the region a window is bound over: own, or a caller's
	// own is the region the window registered for itself, kept while a caller's region
	// serves, so that maps switching between the two do not register and deregister.
	own *mr
	// boundQP: the QP a valid type 2 window is bound to, which holds the QP (rxe waits for
	// the window before it destroys the QP).
	boundQP *qp
	access  rdma.Access
	dereg   bool
}

var _ rdma.MR = (*mr)(nil)

func (m *mr) LKey() uint32 {
	if m.mr != nil {
		return uint32(m.mr.lkey)
	}
	return m.key.Load()
}

func (m *mr) RKey() uint32 {
	if m.mr != nil {
		return uint32(m.mr.rkey)
	}
	return m.key.Load()
}

func (m *mr) Addr() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.buf) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&m.buf[0])))
}

func (m *mr) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.buf)
}

func (m *mr) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.buf
}

func (m *mr) Access() rdma.Access {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.access
}

func (m *mr) Valid() bool { return m.valid.Load() }

// Map points a window at buf, which must lie in a region of the same PD registered with
// local write. The window covers buf at buf's own address; iova is not used.
func (m *mr) Map(buf []byte, iova uint64) error {
	if m.mw == nil {
		return fmt.Errorf("%w: map of a registered MR (only fast-reg MRs map memory)", rdma.ErrInvalid)
	}
	if len(buf) == 0 || len(buf) > m.maxLen {
		return fmt.Errorf("%w: map of %d bytes into an MR of at most %d", rdma.ErrInvalid, len(buf), m.maxLen)
	}
	under := m.pd.under(buf)
	if under == nil || under.access&rdma.AccessLocalWrite == 0 {
		return fmt.Errorf("%w: map of memory outside every region of the PD registered with local write", rdma.ErrInvalid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.dereg:
		return rdma.ErrClosed
	case m.valid.Load():
		return fmt.Errorf("%w: map of a valid MR (invalidate it first)", rdma.ErrInvalid)
	}
	// rxe checks an access through a window against the region the window is bound over,
	// not against the window's own range. So each window is bound over a region that starts
	// where it maps and spans at most its maximum length: a key then reaches no further than
	// that, whatever the device. A caller's region of that shape is taken as it is (a ublk
	// tag's buffer, registered once); otherwise the window registers one of its own, kept
	// while later maps fit in it (RTRS maps each window at the same place every time).
	a := uintptr(unsafe.Pointer(&buf[0]))
	ub := uintptr(unsafe.Pointer(&under.buf[0]))
	if ub == a && len(under.buf) <= m.maxLen {
		m.base, m.buf = under, buf
		return nil
	}
	if m.own != nil {
		if b := uintptr(unsafe.Pointer(&m.own.buf[0])); a != b || len(buf) > len(m.own.buf) {
			if err := m.dropBase(false); err != nil {
				return err
			}
		}
	}
	if m.own == nil {
		n := min(m.maxLen, len(under.buf)-int(a-ub))
		own, err := m.pd.reg(unsafe.Slice(&buf[0], n), rdma.AccessLocalWrite, false, false)
		if err != nil {
			return err
		}
		m.own = own
	}
	m.base, m.buf = m.own, buf
	return nil
}

// dropBase deregisters the window's own region; a caller's region it is bound over stays
// the caller's. all: the window goes, so it lets go of a caller's region too.
func (m *mr) dropBase(all bool) error {
	if m.own != nil {
		if err := m.own.Dereg(); err != nil {
			return err
		}
		if m.base == m.own {
			m.base = nil
		}
		m.own = nil
	}
	if all {
		m.base = nil
	}
	return nil
}

func (m *mr) Dereg() error {
	m.mu.Lock()
	if m.dereg {
		m.mu.Unlock()
		return rdma.ErrClosed
	}
	m.dereg = true
	m.valid.Store(false)
	m.mu.Unlock()
	p := m.pd
	if m.mw != nil {
		p.mu.Lock()
		if p.byKey[m.key.Load()] == m {
			delete(p.byKey, m.key.Load())
		}
		p.mu.Unlock()
		if rc := C.ibv_dealloc_mw(m.mw); rc != 0 {
			return fmt.Errorf("verbs: ibv_dealloc_mw: %w", errnoOf(rc))
		}
		return m.dropBase(true)
	}
	// A region a window is still bound over is refused (rxe: EINVAL): it stays as it was,
	// listed and valid, for a later Dereg once the window is gone.
	p.mu.Lock()
	if rc := C.ibv_dereg_mr(m.mr); rc != 0 {
		p.mu.Unlock()
		m.mu.Lock()
		m.dereg = false
		m.valid.Store(true)
		m.mu.Unlock()
		return fmt.Errorf("verbs: ibv_dereg_mr: %w", errnoOf(rc))
	}
	for i, r := range p.regs {
		if r == m {
			p.regs = append(p.regs[:i], p.regs[i+1:]...)
			break
		}
	}
	if a := uintptr(unsafe.Pointer(&m.buf[0])); p.starts[a] == m {
		delete(p.starts, a)
	}
	p.mu.Unlock()
	if m.owned {
		return rdma.Free(m.buf)
	}
	return nil
}
