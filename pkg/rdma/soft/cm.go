package soft

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/sockread"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// userTimeout is TCP_USER_TIMEOUT on every QP socket: data unacknowledged by the peer's TCP
// for this long fails the connection, as an HCA's transport retries run out.
const userTimeout = 20 * time.Second

// connID is a connection identifier: before establishment it holds the resolved addresses and
// the QP; after it the QP owns the connection.
type connID struct {
	prov   *Provider
	dev    *device
	local  netip.AddrPort
	remote netip.AddrPort

	mu        sync.Mutex
	qp        *qp
	conn      net.Conn // set for an incoming request until it is answered
	br        *sockread.Reader
	answered  bool
	started   bool
	destroyed bool
	expire    *time.Timer
	// free gives back the listener's pending slot of an incoming request, once (nil for an
	// outgoing identifier).
	free func()
	// subject is the peer certificate's subject, with TLS.
	subject string
}

// PeerSubject is the subject of the peer's certificate ("" without TLS): rdma.Authenticated.
func (c *connID) PeerSubject() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.subject
}

// subjectOf is the subject of the certificate a TLS peer presented.
func subjectOf(tc *tls.Conn) string {
	if pc := tc.ConnectionState().PeerCertificates; len(pc) > 0 {
		return pc[0].Subject.String()
	}
	return ""
}

// freeSlot gives back the request's pending slot (when it is answered or dropped).
func (c *connID) freeSlot() {
	if c.free != nil {
		c.free()
	}
}

var _ rdma.ConnID = (*connID)(nil)

func (c *connID) Device() rdma.Device        { return c.dev }
func (c *connID) Port() int                  { return 1 }
func (c *connID) LocalAddr() netip.AddrPort  { c.mu.Lock(); defer c.mu.Unlock(); return c.local }
func (c *connID) RemoteAddr() netip.AddrPort { c.mu.Lock(); defer c.mu.Unlock(); return c.remote }

func (c *connID) QP() rdma.QP {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.qp == nil {
		return nil
	}
	return c.qp
}

func (c *connID) CreateQP(p rdma.PD, attr rdma.QPInitAttr) (rdma.QP, error) {
	sp, ok := p.(*pd)
	if !ok {
		return nil, fmt.Errorf("%w: not a soft PD", rdma.ErrInvalid)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.destroyed {
		return nil, rdma.ErrClosed
	}
	if c.qp != nil {
		return nil, fmt.Errorf("%w: identifier already has a QP", rdma.ErrInvalid)
	}
	q, err := newQP(c.dev, sp, attr)
	if err != nil {
		return nil, err
	}
	c.qp = q
	return q, nil
}

// ResolveAddr binds an identifier to the device that routes to dst. With src unset, the
// kernel's route picks the source, as rdma_resolve_addr does.
func (p *Provider) ResolveAddr(ctx context.Context, src netip.Addr, dst netip.AddrPort) (rdma.ConnID, error) {
	if !dst.IsValid() || dst.Addr().IsUnspecified() {
		return nil, fmt.Errorf("%w: destination %v", rdma.ErrInvalid, dst)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if src.IsValid() && !src.IsUnspecified() {
		src = src.Unmap()
		if src.Is4() != dst.Addr().Is4() {
			return nil, fmt.Errorf("%w: source %v and destination %v differ in family", rdma.ErrAddrError, src, dst.Addr())
		}
	} else {
		// A connected UDP socket asks the routing table for the source; nothing is sent.
		u, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
		if err != nil {
			return nil, fmt.Errorf("%w: route to %v: %v", rdma.ErrAddrError, dst, err)
		}
		src = u.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
		_ = u.Close()
	}
	dev, err := p.deviceFor(src)
	if err != nil {
		return nil, err
	}
	return &connID{prov: p, dev: dev, local: netip.AddrPortFrom(src, 0), remote: dst}, nil
}

// deadline returns ctx's deadline, or now + the default connect timeout.
func deadline(ctx context.Context) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d
	}
	return time.Now().Add(rdma.DefaultConnectTimeout)
}

// tuneConn sets the socket options every QP connection uses.
func tuneConn(c net.Conn) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	_ = tc.SetNoDelay(true)
	if raw, err := tc.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(userTimeout/time.Millisecond))
		})
	}
}

// writeCM writes one CM frame with its private data.
func writeCM(c net.Conn, op frameOp, data []byte) error {
	var b [hdrLen + rdma.MaxPrivateData]byte
	h := frameHdr{op: op, len: uint32(len(data)), imm: protoVersion, addr: cmMagic}
	if op == fConnRTU {
		h = frameHdr{op: op}
	}
	h.encode(b[:])
	n := copy(b[hdrLen:], data)
	_, err := c.Write(b[:hdrLen+n])
	return err
}

// readCM reads one CM frame.
func readCM(br *sockread.Reader) (frameHdr, []byte, error) {
	var hb [hdrLen]byte
	if err := br.ReadFull(hb[:]); err != nil {
		return frameHdr{}, nil, err
	}
	h, err := decodeHdr(hb[:])
	if err != nil {
		return h, nil, err
	}
	switch h.op {
	case fConnReq, fConnAcc, fConnRej:
		if h.imm != protoVersion {
			return h, nil, fmt.Errorf("%w: protocol version %d, want %d", errFrame, h.imm, protoVersion)
		}
	case fConnRTU:
	default:
		return h, nil, fmt.Errorf("%w: %v during connection setup", errFrame, h.op)
	}
	data := make([]byte, h.len)
	if err := br.ReadFull(data); err != nil {
		return h, nil, err
	}
	return h, data, nil
}

// mapDialErr turns a TCP connect failure into the CM outcome a verbs consumer sees.
func mapDialErr(err error) error {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return &rdma.RejectError{NoListener: true}
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return fmt.Errorf("%w: %v", rdma.ErrUnreachable, err)
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return fmt.Errorf("%w: %v", rdma.ErrAddrError, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT), isTimeout(err):
		return fmt.Errorf("%w: %v", rdma.ErrTimeout, err)
	}
	return err
}

// ctxErr reports a failed handshake step: a cancelled context as itself, a deadline as
// ErrTimeout (the CM's ETIMEDOUT), anything else mapped by mapDialErr.
func ctxErr(ctx context.Context, err error) error {
	if errors.Is(ctx.Err(), context.Canceled) {
		return ctx.Err()
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %v", rdma.ErrTimeout, err)
	}
	return mapDialErr(err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (c *connID) Connect(ctx context.Context, p rdma.ConnParam) ([]byte, error) {
	if len(p.PrivateData) > rdma.MaxPrivateData {
		return nil, fmt.Errorf("%w: %d bytes of private data (at most %d)", rdma.ErrInvalid, len(p.PrivateData), rdma.MaxPrivateData)
	}
	c.mu.Lock()
	q, started, destroyed := c.qp, c.started, c.destroyed
	c.started = true
	c.mu.Unlock()
	switch {
	case destroyed:
		return nil, rdma.ErrClosed
	case q == nil:
		return nil, fmt.Errorf("%w: connect without a QP", rdma.ErrInvalid)
	case started:
		return nil, fmt.Errorf("%w: identifier already connecting or connected", rdma.ErrInvalid)
	}
	dl := deadline(ctx)
	dctx, cancel := context.WithDeadline(ctx, dl)
	defer cancel()
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(c.local)}
	conn, err := d.DialContext(dctx, "tcp", c.remote.String())
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	tuneConn(conn)
	// Closing the socket is how a cancelled context interrupts the handshake.
	raw := conn
	stop := context.AfterFunc(dctx, func() { _ = raw.SetDeadline(time.Now()) })
	defer stop()
	_ = conn.SetDeadline(dl)
	fail := func(err error) ([]byte, error) {
		_ = conn.Close()
		return nil, ctxErr(ctx, err)
	}
	if cfg := c.prov.opts.TLS; cfg != nil {
		cfg = cfg.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName = c.remote.Addr().String()
		}
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(dctx); err != nil {
			return fail(fmt.Errorf("soft-rdma: TLS with %v: %w", c.remote, err))
		}
		conn = tc
		c.mu.Lock()
		c.subject = subjectOf(tc)
		c.mu.Unlock()
	}
	if err := writeCM(conn, fConnReq, p.PrivateData); err != nil {
		return fail(err)
	}
	br := sockread.New(conn, c.prov.opts.ReadBufSize)
	h, data, err := readCM(br)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			err = fmt.Errorf("soft-rdma: peer closed during connection setup: %w", syscall.ECONNRESET)
		}
		return fail(err)
	}
	switch h.op {
	case fConnRej:
		_ = conn.Close()
		return nil, &rdma.RejectError{PrivateData: data}
	case fConnAcc:
	default:
		return fail(fmt.Errorf("%w: %v in answer to a connect request", errFrame, h.op))
	}
	if err := writeCM(conn, fConnRTU, nil); err != nil {
		return fail(err)
	}
	if !stop() {
		return fail(ctx.Err())
	}
	_ = conn.SetDeadline(time.Time{})
	c.mu.Lock()
	c.local = raw.LocalAddr().(*net.TCPAddr).AddrPort()
	c.local = netip.AddrPortFrom(c.local.Addr().Unmap(), c.local.Port())
	if err := c.startLocked(q, conn, br, p.RNRRetryCount); err != nil {
		c.mu.Unlock()
		return nil, err
	}
	c.mu.Unlock()
	return data, nil
}

// startLocked runs the QP over the established connection unless the identifier was
// destroyed meanwhile (the connection is closed then); c.mu is held, so Destroy either comes
// first and is seen here, or comes after and finds the QP running, with goroutines to stop
// and wait for.
func (c *connID) startLocked(q *qp, conn net.Conn, br *sockread.Reader, rnrRetry uint8) error {
	if c.destroyed {
		_ = conn.Close()
		return rdma.ErrClosed
	}
	q.start(conn, br, rnrRetry)
	return nil
}

func (c *connID) Accept(ctx context.Context, p rdma.ConnParam) error {
	if len(p.PrivateData) > rdma.MaxPrivateData {
		return fmt.Errorf("%w: %d bytes of private data (at most %d)", rdma.ErrInvalid, len(p.PrivateData), rdma.MaxPrivateData)
	}
	conn, br, q, err := c.answer(true)
	if err != nil {
		return err
	}
	defer c.freeSlot()
	dl := deadline(ctx)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	_ = conn.SetDeadline(dl)
	if err := writeCM(conn, fConnAcc, p.PrivateData); err != nil {
		_ = conn.Close()
		return mapDialErr(err)
	}
	h, _, err := readCM(br)
	if err == nil && h.op != fConnRTU {
		err = fmt.Errorf("%w: %v instead of RTU", errFrame, h.op)
	}
	if err == nil && !stop() {
		err = ctx.Err()
	}
	if err != nil {
		_ = conn.Close()
		return ctxErr(ctx, err)
	}
	_ = conn.SetDeadline(time.Time{})
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.startLocked(q, conn, br, p.RNRRetryCount)
}

func (c *connID) Reject(data []byte) error {
	if len(data) > rdma.MaxPrivateData {
		return fmt.Errorf("%w: %d bytes of private data (at most %d)", rdma.ErrInvalid, len(data), rdma.MaxPrivateData)
	}
	conn, _, _, err := c.answer(false)
	if err != nil {
		return err
	}
	defer c.freeSlot()
	_ = conn.SetWriteDeadline(time.Now().Add(discWriteTimeout))
	err = writeCM(conn, fConnRej, data)
	_ = conn.Close()
	return err
}

// answer claims an incoming request for accept or reject, once.
func (c *connID) answer(needQP bool) (net.Conn, *sockread.Reader, *qp, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.destroyed:
		return nil, nil, nil, rdma.ErrClosed
	case c.conn == nil:
		return nil, nil, nil, fmt.Errorf("%w: not an incoming connection request", rdma.ErrInvalid)
	case c.answered:
		return nil, nil, nil, fmt.Errorf("%w: request already answered", rdma.ErrInvalid)
	case needQP && c.qp == nil:
		return nil, nil, nil, fmt.Errorf("%w: accept without a QP", rdma.ErrInvalid)
	}
	c.answered = true
	c.started = needQP
	if c.expire != nil {
		c.expire.Stop()
	}
	return c.conn, c.br, c.qp, nil
}

func (c *connID) Events() <-chan rdma.CMEvent {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.qp == nil {
		return nil
	}
	return c.qp.events
}

func (c *connID) Disconnect() error {
	c.mu.Lock()
	q, started := c.qp, c.started
	c.mu.Unlock()
	if q == nil || !started {
		return fmt.Errorf("%w: disconnect of an identifier that is not connected", rdma.ErrInvalid)
	}
	q.ToError()
	return nil
}

func (c *connID) Destroy() error {
	c.mu.Lock()
	if c.destroyed {
		c.mu.Unlock()
		return rdma.ErrClosed
	}
	c.destroyed = true
	q, pending := c.qp, c.conn != nil && !c.answered
	conn := c.conn
	if c.expire != nil {
		c.expire.Stop()
	}
	c.mu.Unlock()
	if pending {
		_ = conn.Close()
		c.freeSlot()
	}
	if q == nil {
		return nil
	}
	q.ToError()
	q.mu.Lock()
	qc := q.conn
	q.mu.Unlock()
	if qc != nil {
		_ = qc.Close()
	}
	q.wg.Wait()
	return nil
}

// listener accepts TCP connections and turns each CONN_REQ into a connection request.
type listener struct {
	prov *Provider
	ln   *net.TCPListener
	addr netip.AddrPort
	reqs chan *rdma.ConnRequest
	done chan struct{}
	wg   sync.WaitGroup
	once sync.Once
	log  *log.Entry

	// Unfinished incoming connections, in all and per peer address (Options.MaxPending).
	mu      sync.Mutex
	pending int
	perAddr map[netip.Addr]int
}

// refusals reports refused connections and exhaustion once per cause (log.Limiter).
var refusals log.Limiter

// admit takes a pending slot for a connection from peer; the returned function gives it back
// (once). It returns nil, having logged why, when a bound is reached.
func (l *listener) admit(peer netip.AddrPort) func() {
	o := l.prov.opts
	a := rdma.AddrGroup(peer.Addr())
	l.mu.Lock()
	if l.pending >= o.MaxPending {
		l.mu.Unlock()
		refusals.Warn(l.log, "pending connections", peer.String(), fmt.Sprintf("%d unfinished connections (the listener's bound)", o.MaxPending))
		return nil
	}
	if l.perAddr[a] >= o.MaxPendingPerAddr {
		l.mu.Unlock()
		refusals.Warn(l.log, "pending connections per address", peer.String(), fmt.Sprintf("%d unfinished connections from this address (the bound per address)", o.MaxPendingPerAddr))
		return nil
	}
	l.pending++
	l.perAddr[a]++
	l.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			l.pending--
			if l.perAddr[a]--; l.perAddr[a] == 0 {
				delete(l.perAddr, a)
			}
			l.mu.Unlock()
		})
	}
}

// Listen listens on addr; "[::]:port" takes IPv4 and IPv6.
func (p *Provider) Listen(addr netip.AddrPort, backlog int) (rdma.Listener, error) {
	if backlog <= 0 {
		backlog = 64
	}
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(addr))
	if err != nil {
		return nil, fmt.Errorf("soft-rdma: listen on %v: %w", addr, err)
	}
	l := &listener{prov: p, ln: ln, addr: ln.Addr().(*net.TCPAddr).AddrPort(), reqs: make(chan *rdma.ConnRequest, backlog), done: make(chan struct{}),
		perAddr: map[netip.Addr]int{}}
	l.log = log.L.WithFields(log.Fields{"component": "soft-rdma", "listen": l.addr.String()})
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

func (l *listener) Addr() netip.AddrPort { return l.addr }

func (l *listener) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			// Out of descriptors and the like: back off instead of spinning.
			refusals.Warn(l.log, "accept failed", "", err.Error())
			select {
			case <-l.done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		free := l.admit(netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port()))
		if free == nil {
			_ = c.Close()
			continue
		}
		l.wg.Add(1)
		go l.handshake(c, free)
	}
}

// handshake reads a connection request and hands it to Accept's caller.
func (l *listener) handshake(c net.Conn, free func()) {
	defer l.wg.Done()
	tuneConn(c)
	// The request must come within the handshake timeout; then the user has the CM's
	// request timer to answer it.
	_ = c.SetDeadline(time.Now().Add(l.prov.opts.HandshakeTimeout))
	dl := time.Now().Add(rdma.DefaultConnectTimeout)
	raw, subject := c, ""
	if cfg := l.prov.opts.TLS; cfg != nil {
		tc := tls.Server(c, cfg)
		if err := tc.Handshake(); err != nil {
			refusals.Warn(l.log, "TLS", c.RemoteAddr().String(), "TLS handshake: "+err.Error())
			_ = c.Close()
			free()
			return
		}
		c, subject = tc, subjectOf(tc)
	}
	br := sockread.New(c, l.prov.opts.ReadBufSize)
	h, data, err := readCM(br)
	if err == nil && h.op != fConnReq {
		err = fmt.Errorf("%w: %v instead of a connection request", errFrame, h.op)
	}
	if err != nil {
		refusals.Warn(l.log, "handshake", c.RemoteAddr().String(), "no connection request: "+err.Error())
		_ = c.Close()
		free()
		return
	}
	_ = c.SetDeadline(dl)
	local := raw.LocalAddr().(*net.TCPAddr).AddrPort()
	remote := raw.RemoteAddr().(*net.TCPAddr).AddrPort()
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	remote = netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
	dev, err := l.prov.deviceFor(local.Addr())
	if err != nil {
		refusals.Warn(l.log, "no device", remote.String(), err.Error())
		_ = c.Close()
		free()
		return
	}
	id := &connID{prov: l.prov, dev: dev, local: local, remote: remote, conn: c, br: br, free: free, subject: subject}
	// A request nobody answers in time is dropped, as the CM's REQ timer would.
	id.expire = time.AfterFunc(time.Until(dl), func() {
		id.mu.Lock()
		drop := !id.answered && !id.destroyed
		id.answered = true
		id.mu.Unlock()
		if drop {
			_ = c.Close()
			free()
		}
	})
	select {
	case l.reqs <- &rdma.ConnRequest{ID: id, PrivateData: data}:
	case <-l.done:
		id.expire.Stop()
		_ = c.Close()
		free()
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

// Close stops listening; requests not yet accepted are dropped. Established connections are
// not affected.
func (l *listener) Close() error {
	err := rdma.ErrClosed
	l.once.Do(func() {
		close(l.done)
		err = l.ln.Close()
		l.wg.Wait()
		for {
			select {
			case r := <-l.reqs:
				_ = r.ID.Destroy()
			default:
				return
			}
		}
	})
	return err
}
