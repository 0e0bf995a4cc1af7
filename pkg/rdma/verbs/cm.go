//go:build verbs

package verbs

// #include "glue.h"
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// rdAtoms is how many RDMA READs a connection lets each side have outstanding
// (responder_resources and initiator_depth).
const rdAtoms = 16

// channel is an rdma_cm event channel whose descriptor (a duplicate, non-blocking) waits in
// Go's poller; one goroutine reads it and hands each event on.
type channel struct {
	ch   *C.struct_rdma_event_channel
	fd   *os.File
	rc   syscall.RawConn
	stop chan struct{}
	done chan struct{}
}

func newChannel() (*channel, error) {
	ch, err := C.rdma_create_event_channel()
	if ch == nil {
		return nil, fmt.Errorf("verbs: rdma_create_event_channel: %w", errOr(err))
	}
	c := &channel{ch: ch, stop: make(chan struct{}), done: make(chan struct{})}
	if c.fd, c.rc, err = pollable(C.rtrs_ch_fd(ch), "rdma_event_channel"); err != nil {
		C.rdma_destroy_event_channel(ch)
		return nil, err
	}
	return c, nil
}

// pollable makes a library's descriptor non-blocking and returns a duplicate of it that waits
// in Go's poller (the library keeps and closes its own).
func pollable(fd C.int, name string) (*os.File, syscall.RawConn, error) {
	if rc := C.rtrs_set_nonblock(fd); rc != 0 {
		return nil, nil, fmt.Errorf("verbs: %s: %w", name, syscall.Errno(-rc))
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("verbs: %s: %w", name, err)
	}
	f := os.NewFile(uintptr(dup), name)
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return nil, nil, err
	}
	return f, rc, nil
}

// newID creates an identifier on an event channel of its own.
func newID() (*channel, *C.struct_rdma_cm_id, error) {
	ch, err := newChannel()
	if err != nil {
		return nil, nil, err
	}
	var id *C.struct_rdma_cm_id
	if rc, err := C.rdma_create_id(ch.ch, &id, nil, C.RDMA_PS_TCP); rc != 0 {
		ch.close()
		return nil, nil, fmt.Errorf("verbs: rdma_create_id: %w", errOr(err))
	}
	return ch, id, nil
}

// run calls fn with each event until halt.
func (c *channel) run(fn func(*C.struct_gev)) {
	go func() {
		defer close(c.done)
		var ev C.struct_gev
		for {
			var cerr error
			err := c.rc.Read(func(uintptr) bool {
				rc := C.rtrs_get_cm_event(c.ch, &ev)
				if rc < 0 {
					cerr = syscall.Errno(-rc)
				}
				return rc != 0
			})
			select {
			case <-c.stop:
				return
			default:
			}
			if err != nil || cerr != nil {
				return
			}
			fn(&ev)
		}
	}()
}

// halt stops the reader and waits for it.
func (c *channel) halt() {
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	_ = c.fd.SetReadDeadline(time.Now())
	<-c.done
}

// close releases the channel; every identifier on it must be destroyed.
func (c *channel) close() {
	_ = c.fd.Close()
	C.rdma_destroy_event_channel(c.ch)
}

// event is a CM event as the waiting call sees it.
type event struct {
	typ    rdma.CMEventType
	status int
	pdata  []byte
}

// connID is an rdma_cm_id with its own event channel.
type connID struct {
	prov *Provider
	ch   *channel
	id   *C.struct_rdma_cm_id
	dev  *device

	evs    chan event        // events during setup, for the call that waits for them
	events chan rdma.CMEvent // after establishment: DISCONNECTED; closed by Destroy

	mu          sync.Mutex
	qp          *qp
	established bool
	gone        bool // disconnected: reported once
	destroyed   bool
	dead        chan struct{} // closed by Destroy: a call waiting for a setup event ends
}

var _ rdma.ConnID = (*connID)(nil)

func (p *Provider) newConnID(ch *channel, id *C.struct_rdma_cm_id) *connID {
	c := &connID{prov: p, ch: ch, id: id, evs: make(chan event, 8), events: make(chan rdma.CMEvent, 1), dead: make(chan struct{})}
	ch.run(c.onEvent)
	return c
}

func (c *connID) onEvent(ev *C.struct_gev) {
	e := event{typ: rdma.CMEventType(ev._type), status: int(ev.status)}
	if n := int(ev.pdata_len); n > 0 {
		e.pdata = C.GoBytes(unsafe.Pointer(&ev.pdata[0]), C.int(n))
	}
	c.mu.Lock()
	up := c.established
	c.mu.Unlock()
	if up {
		switch e.typ {
		case rdma.EventDisconnected, rdma.EventDeviceRemoval:
			// The peer's DREQ is answered at once (a DREP), so that its side ends without
			// waiting for the CM's timeouts, as the kernel's ULPs answer from their handler.
			// Outside c.mu (onID): Destroy halts this reader before it frees the identifier.
			C.rdma_disconnect(c.id)
			c.disconnected(nil)
		}
		return
	}
	select {
	case c.evs <- e:
	default: // nobody waits for a flood of setup events
	}
}

// disconnected moves the QP to error (outstanding work flushes) and reports the event once.
func (c *connID) disconnected(err error) {
	c.mu.Lock()
	q, skip := c.qp, c.gone || c.destroyed
	c.gone = true
	c.mu.Unlock()
	if skip {
		return
	}
	if q != nil {
		q.ToError()
	}
	c.mu.Lock()
	if !c.destroyed {
		c.events <- rdma.CMEvent{Type: rdma.EventDisconnected, Err: err} // room for one, sent once
	}
	c.mu.Unlock()
}

// wait waits for one of the wanted events; another event ends the wait with an error.
func (c *connID) wait(ctx context.Context, want rdma.CMEventType) (event, error) {
	select {
	case e := <-c.evs:
		if e.typ == want {
			return e, nil
		}
		return e, fmt.Errorf("verbs: %v while waiting for %v (status %d)", e.typ, want, e.status)
	case <-c.dead:
		return event{}, fmt.Errorf("verbs: waiting for %v: %w", want, rdma.ErrClosed)
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return event{}, fmt.Errorf("verbs: waiting for %v: %w", want, rdma.ErrTimeout)
		}
		return event{}, ctx.Err()
	}
}

func withDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, rdma.DefaultConnectTimeout)
}

func timeoutMS(ctx context.Context) C.int {
	dl, _ := ctx.Deadline()
	ms := time.Until(dl).Milliseconds()
	return C.int(max(1, min(ms, 60000)))
}

// sockaddr lays out a socket address as the kernel does.
func sockaddr(ap netip.AddrPort) ([]byte, error) {
	a := ap.Addr().Unmap()
	if a.Is4() {
		b := make([]byte, unix.SizeofSockaddrInet4)
		binary.NativeEndian.PutUint16(b[0:], unix.AF_INET)
		binary.BigEndian.PutUint16(b[2:], ap.Port())
		ip := a.As4()
		copy(b[4:], ip[:])
		return b, nil
	}
	if a.Is6() {
		b := make([]byte, unix.SizeofSockaddrInet6)
		binary.NativeEndian.PutUint16(b[0:], unix.AF_INET6)
		binary.BigEndian.PutUint16(b[2:], ap.Port())
		ip := a.As16()
		copy(b[8:], ip[:])
		return b, nil
	}
	return nil, fmt.Errorf("%w: address %v", rdma.ErrInvalid, ap)
}

// addrOf reads a socket address the library holds.
func addrOf(sa *C.struct_sockaddr) netip.AddrPort {
	if sa == nil {
		return netip.AddrPort{}
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(sa)), unix.SizeofSockaddrInet6)
	port := binary.BigEndian.Uint16(b[2:])
	switch binary.NativeEndian.Uint16(b[0:]) {
	case unix.AF_INET:
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), port)
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])).Unmap(), port)
	}
	return netip.AddrPort{}
}

// ResolveAddr resolves dst (and src, when valid) to a device and a route.
func (p *Provider) ResolveAddr(ctx context.Context, src netip.Addr, dst netip.AddrPort) (rdma.ConnID, error) {
	ctx, cancel := withDeadline(ctx)
	defer cancel()
	dsa, err := sockaddr(dst)
	if err != nil {
		return nil, err
	}
	var ssa []byte
	if src.IsValid() && !src.IsUnspecified() {
		if ssa, err = sockaddr(netip.AddrPortFrom(src, 0)); err != nil {
			return nil, err
		}
	}
	ch, id, err := newID()
	if err != nil {
		return nil, err
	}
	c := p.newConnID(ch, id)
	fail := func(err error) (rdma.ConnID, error) {
		_ = c.Destroy()
		return nil, err
	}
	var sp *C.struct_sockaddr
	if ssa != nil {
		sp = (*C.struct_sockaddr)(unsafe.Pointer(&ssa[0]))
	}
	if rc, err := C.rdma_resolve_addr(id, sp, (*C.struct_sockaddr)(unsafe.Pointer(&dsa[0])), timeoutMS(ctx)); rc != 0 {
		return fail(fmt.Errorf("verbs: rdma_resolve_addr %v: %w: %w", dst, rdma.ErrAddrError, errOr(err)))
	}
	if _, err := c.wait(ctx, rdma.EventAddrResolved); err != nil {
		return fail(fmt.Errorf("verbs: resolving %v: %w: %w", dst, rdma.ErrAddrError, err))
	}
	if rc, err := C.rdma_resolve_route(id, timeoutMS(ctx)); rc != 0 {
		return fail(fmt.Errorf("verbs: rdma_resolve_route %v: %w: %w", dst, rdma.ErrUnreachable, errOr(err)))
	}
	if _, err := c.wait(ctx, rdma.EventRouteResolved); err != nil {
		return fail(fmt.Errorf("verbs: route to %v: %w: %w", dst, rdma.ErrUnreachable, err))
	}
	if c.dev, err = p.deviceOf(C.rtrs_id_verbs(id)); err != nil {
		return fail(err)
	}
	return c, nil
}

// onID runs f, a C call on the identifier, unless it has been destroyed (ErrClosed): c.mu
// is held across it, and Destroy marks the identifier under c.mu before it frees it, so
// another goroutine's Destroy cannot free the identifier under the call.
func (c *connID) onID(f func() error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.destroyed {
		return rdma.ErrClosed
	}
	return f()
}

func (c *connID) Device() rdma.Device { return c.dev }

func (c *connID) Port() (port int) {
	_ = c.onID(func() error { port = int(C.rtrs_id_port(c.id)); return nil })
	return port
}

func (c *connID) LocalAddr() (a netip.AddrPort) {
	_ = c.onID(func() error { a = addrOf(C.rdma_get_local_addr(c.id)); return nil })
	return a
}

func (c *connID) RemoteAddr() (a netip.AddrPort) {
	_ = c.onID(func() error { a = addrOf(C.rdma_get_peer_addr(c.id)); return nil })
	return a
}

func (c *connID) CreateQP(p rdma.PD, attr rdma.QPInitAttr) (rdma.QP, error) {
	vp, ok := p.(*pd)
	scq, ok1 := attr.SendCQ.(*cq)
	rcq, ok2 := attr.RecvCQ.(*cq)
	if !ok || !ok1 || !ok2 || vp.dev != c.dev || scq.dev != c.dev || rcq.dev != c.dev {
		return nil, fmt.Errorf("%w: PD and CQs must be of the identifier's device", rdma.ErrInvalid)
	}
	if attr.MaxSendWR <= 0 || attr.MaxRecvWR <= 0 {
		return nil, fmt.Errorf("%w: queue sizes %d/%d", rdma.ErrInvalid, attr.MaxSendWR, attr.MaxRecvWR)
	}
	ssge, rsge := max(attr.MaxSendSGE, 1), max(attr.MaxRecvSGE, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.destroyed {
		return nil, rdma.ErrClosed
	}
	if c.qp != nil {
		return nil, fmt.Errorf("%w: the identifier has a QP", rdma.ErrInvalid)
	}
	if rc := C.rtrs_create_qp(c.id, vp.pd, scq.cq, rcq.cq, C.int(attr.MaxSendWR), C.int(attr.MaxRecvWR),
		C.int(ssge), C.int(rsge)); rc != 0 {
		return nil, fmt.Errorf("verbs: rdma_create_qp (%d/%d WRs): %w", attr.MaxSendWR, attr.MaxRecvWR, errnoOf(rc))
	}
	// The queues hold what was asked for (the records are that long); a device that gives
	// more is not relied on.
	q := newQP(c, vp, C.rtrs_id_qp(c.id), attr.MaxSendWR, attr.MaxRecvWR, ssge, rsge)
	c.qp = q
	c.dev.addQP(q)
	return q, nil
}

func (c *connID) QP() rdma.QP {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.qp == nil {
		return nil
	}
	return c.qp
}

func (c *connID) Connect(ctx context.Context, p rdma.ConnParam) ([]byte, error) {
	if len(p.PrivateData) > rdma.MaxPrivateData {
		return nil, fmt.Errorf("%w: %d bytes of private data", rdma.ErrInvalid, len(p.PrivateData))
	}
	ctx, cancel := withDeadline(ctx)
	defer cancel()
	var pdp unsafe.Pointer
	if len(p.PrivateData) > 0 {
		pdp = C.CBytes(p.PrivateData)
		defer C.free(pdp)
	}
	retry := p.RetryCount
	if retry == 0 {
		retry = 7
	}
	if err := c.onID(func() error {
		if rc := C.rtrs_connect(c.id, pdp, C.int(len(p.PrivateData)), C.int(min(p.RNRRetryCount, 7)), C.int(min(retry, 7)), rdAtoms); rc != 0 {
			return fmt.Errorf("verbs: rdma_connect: %w", errnoOf(rc))
		}
		return nil
	}); err != nil {
		return nil, err
	}
	e, err := c.wait(ctx, rdma.EventEstablished)
	if err == nil {
		c.up()
		return e.pdata, nil
	}
	switch e.typ {
	case rdma.EventRejected:
		// The IB CM's reason 8 is an invalid service ID: nobody listens there.
		if e.status == 8 {
			return nil, &rdma.RejectError{NoListener: true}
		}
		return nil, &rdma.RejectError{PrivateData: e.pdata}
	case rdma.EventUnreachable, rdma.EventConnectError:
		return nil, fmt.Errorf("verbs: connecting to %v: %w: %v (status %d)", c.RemoteAddr(), rdma.ErrUnreachable, e.typ, e.status)
	}
	return nil, err
}

func (c *connID) up() {
	c.mu.Lock()
	c.established = true
	c.mu.Unlock()
	// An event that came between the wait and the flag above.
	for {
		select {
		case e := <-c.evs:
			if e.typ == rdma.EventDisconnected || e.typ == rdma.EventDeviceRemoval {
				c.disconnected(nil)
			}
		default:
			return
		}
	}
}

func (c *connID) Accept(ctx context.Context, p rdma.ConnParam) error {
	if len(p.PrivateData) > rdma.MaxPrivateData {
		return fmt.Errorf("%w: %d bytes of private data", rdma.ErrInvalid, len(p.PrivateData))
	}
	ctx, cancel := withDeadline(ctx)
	defer cancel()
	var pdp unsafe.Pointer
	if len(p.PrivateData) > 0 {
		pdp = C.CBytes(p.PrivateData)
		defer C.free(pdp)
	}
	if err := c.onID(func() error {
		if rc := C.rtrs_accept(c.id, pdp, C.int(len(p.PrivateData)), C.int(min(p.RNRRetryCount, 7)), rdAtoms); rc != 0 {
			return fmt.Errorf("verbs: rdma_accept: %w", errnoOf(rc))
		}
		return nil
	}); err != nil {
		return err
	}
	if _, err := c.wait(ctx, rdma.EventEstablished); err != nil {
		return err
	}
	c.up()
	return nil
}

func (c *connID) Reject(privateData []byte) error {
	if len(privateData) > rdma.MaxPrivateData {
		return fmt.Errorf("%w: %d bytes of private data", rdma.ErrInvalid, len(privateData))
	}
	var pdp unsafe.Pointer
	if len(privateData) > 0 {
		pdp = C.CBytes(privateData)
		defer C.free(pdp)
	}
	// ErrClosed once destroyed: rdma_reject then would touch freed memory.
	return c.onID(func() error {
		if rc, err := C.rdma_reject(c.id, pdp, C.uint8_t(len(privateData))); rc != 0 {
			return fmt.Errorf("verbs: rdma_reject: %w", errOr(err))
		}
		return nil
	})
}

func (c *connID) Events() <-chan rdma.CMEvent { return c.events }

func (c *connID) Disconnect() error {
	return c.onID(func() error {
		if c.qp != nil {
			c.qp.ToError()
		}
		if rc, err := C.rdma_disconnect(c.id); rc != 0 {
			return fmt.Errorf("verbs: rdma_disconnect: %w", errOr(err))
		}
		return nil
	})
}

func (c *connID) Destroy() error {
	c.mu.Lock()
	if c.destroyed {
		c.mu.Unlock()
		return rdma.ErrClosed
	}
	c.destroyed = true
	close(c.dead)
	q, up := c.qp, c.established
	c.mu.Unlock()
	// The event reader first: it may answer a DREQ, which must not meet a QP going away.
	c.ch.halt()
	if up {
		C.rdma_disconnect(c.id)
	}
	if q != nil {
		q.ToError()
		c.dev.removeQP(q)
		q.pd.release(q)
		q.destroy()
		C.rdma_destroy_qp(c.id)
	}
	var err error
	if rc, cerr := C.rdma_destroy_id(c.id); rc != 0 {
		err = fmt.Errorf("verbs: rdma_destroy_id: %w", errOr(cerr))
	}
	c.ch.close()
	// Whoever waits for events learns the identifier is gone.
	c.mu.Lock()
	close(c.events)
	c.mu.Unlock()
	return err
}

// listener is a listening rdma_cm_id; its reader turns connection requests into identifiers
// on channels of their own.
type listener struct {
	prov *Provider
	ch   *channel
	id   *C.struct_rdma_cm_id
	addr netip.AddrPort
	reqs chan *rdma.ConnRequest
	done chan struct{} // closed by Close

	mu     sync.Mutex
	closed bool
}

// Listen binds and listens (rdma_bind_addr + rdma_listen); port 0 takes a free port.
func (p *Provider) Listen(addr netip.AddrPort, backlog int) (rdma.Listener, error) {
	sa, err := sockaddr(addr)
	if err != nil {
		return nil, err
	}
	backlog = max(backlog, 1)
	ch, id, err := newID()
	if err != nil {
		return nil, err
	}
	fail := func(err error) (rdma.Listener, error) {
		C.rdma_destroy_id(id)
		ch.close()
		return nil, err
	}
	if rc, err := C.rdma_bind_addr(id, (*C.struct_sockaddr)(unsafe.Pointer(&sa[0]))); rc != 0 {
		return fail(fmt.Errorf("verbs: rdma_bind_addr %v: %w", addr, errOr(err)))
	}
	if rc, err := C.rdma_listen(id, C.int(backlog)); rc != 0 {
		return fail(fmt.Errorf("verbs: rdma_listen %v: %w", addr, errOr(err)))
	}
	l := &listener{prov: p, ch: ch, id: id, reqs: make(chan *rdma.ConnRequest, backlog), done: make(chan struct{})}
	l.addr = netip.AddrPortFrom(addr.Addr(), addrOf(C.rdma_get_local_addr(id)).Port())
	ch.run(l.onEvent)
	return l, nil
}

func (l *listener) onEvent(ev *C.struct_gev) {
	if rdma.CMEventType(ev._type) != rdma.EventConnectRequest {
		return
	}
	id := ev.id
	var pdata []byte
	if n := int(ev.pdata_len); n > 0 {
		pdata = C.GoBytes(unsafe.Pointer(&ev.pdata[0]), C.int(n))
	}
	refuse := func() {
		C.rdma_reject(id, nil, 0)
		C.rdma_destroy_id(id)
	}
	ch, err := newChannel()
	if err != nil {
		refuse()
		return
	}
	if rc := C.rdma_migrate_id(id, ch.ch); rc != 0 {
		ch.close()
		refuse()
		return
	}
	c := l.prov.newConnID(ch, id)
	if c.dev, err = l.prov.deviceOf(C.rtrs_id_verbs(id)); err != nil {
		_ = c.Reject(nil)
		_ = c.Destroy()
		return
	}
	select {
	case l.reqs <- &rdma.ConnRequest{ID: c, PrivateData: pdata}:
	default:
		// The backlog is full: refused, as a full listen queue refuses.
		_ = c.Reject(nil)
		_ = c.Destroy()
	}
}

func (l *listener) Accept(ctx context.Context) (*rdma.ConnRequest, error) {
	select {
	case r := <-l.reqs:
		return r, nil
	case <-l.done:
		return nil, rdma.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *listener) Addr() netip.AddrPort { return l.addr }

func (l *listener) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return rdma.ErrClosed
	}
	l.closed = true
	l.mu.Unlock()
	close(l.done)
	l.ch.halt()
	C.rdma_destroy_id(l.id)
	l.ch.close()
	// Requests nobody took are refused.
	for {
		select {
		case r := <-l.reqs:
			_ = r.ID.Reject(nil)
			_ = r.ID.Destroy()
		default:
			return nil
		}
	}
}
