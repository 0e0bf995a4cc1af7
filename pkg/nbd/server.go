package nbd

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rtrs-go/rtrs/internal/lib/membudget"
	"github.com/rtrs-go/rtrs/internal/lib/sockread"
	"github.com/rtrs-go/rtrs/pkg/log"
	"golang.org/x/sys/unix"
)

// Device is what an export serves: whole-block IO with a context (rnbd.Device is one).
type Device interface {
	Size() int64
	BlockSize() int
	ReadAtContext(ctx context.Context, p []byte, off int64) error
	WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error
	Flush(ctx context.Context) error
	Discard(ctx context.Context, off, n int64) error
	// WriteZeroes zeroes the range; noUnmap (NBD_CMD_FLAG_NO_HOLE) keeps it allocated.
	WriteZeroes(ctx context.Context, off, n int64, noUnmap bool) error
}

// RangeOps is implemented by a Device that takes DISCARD or WRITE_ZEROES only where its
// backend does (rnbd.Device: what the RNBD server announced). Without it a writable export
// advertises both.
type RangeOps interface {
	CanDiscard() bool
	CanWriteZeroes() bool
}

// Holder is a Device that counts its openers (rnbd.Device): a socket client is one from the
// option that chose the export (NBD_OPT_GO, NBD_OPT_EXPORT_NAME) to the end of its
// connection, so that a normal unmap of the device is refused while a client uses it; an
// unmap that goes through all the same calls revoke, which closes the connection.
// Attachments to the kernel's NBD driver are not openers: their front end answers for them.
type Holder interface {
	Hold(who string, revoke func()) (release func(), err error)
}

// Export is one named device.
type Export struct {
	Name        string
	Description string
	Dev         Device
	ReadOnly    bool
}

// Options configure a server.
type Options struct {
	// Exports lists the exports now; it is called for every lookup, so exports may come and go.
	Exports func() []Export
	// MaxInflight bounds the requests served at once per connection (default 128).
	MaxInflight int
	// HandshakeTimeout bounds the option phase (default 30 s).
	HandshakeTimeout time.Duration
	// MaxConns bounds the connections served at once per listener (default 256), so that
	// the clients of one (a TCP port any local user may reach) cannot keep those of another
	// (the unix socket, root's) out; MaxConnsPerAddr bounds those from one TCP peer address
	// (default 32). Past them a new connection is closed at once.
	MaxConns        int
	MaxConnsPerAddr int
	// MaxConnMemory bounds the bytes of request and reply data a connection holds at once
	// (default 64 MiB, at least MaxRequest); MaxMemory those of all connections (default
	// 1 GiB). A request waits for its bytes before its payload is read.
	MaxConnMemory, MaxMemory int64
	// MaxArenaMemory bounds the memory of all connections' arenas: request data memory of a
	// BufferDevice, MaxInflight regions of its MaxIO each, registered with the HCA and
	// resident (default 128 MiB; negative: no arenas). A connection that would pass it
	// serves its data from the pools, through the transport's stage (logged, at most once a
	// minute).
	MaxArenaMemory int64
	// ReplyTimeout bounds how long a reply may wait for the client to take it (default
	// 30 s); a client that takes none for that long is disconnected.
	ReplyTimeout time.Duration
}

// budget counts bytes held against a bound.
type budget struct {
	mu      sync.Mutex
	free    int64
	waiters int
	wake    chan struct{} // closed (and replaced) when bytes come back to a waiter
}

func newBudget(n int64) *budget { return &budget{free: n, wake: make(chan struct{})} }

// tryAcquire takes n bytes if they are free.
func (b *budget) tryAcquire(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.free < n {
		return false
	}
	b.free -= n
	return true
}

// acquire waits for n bytes (no more than the bound); false if dead or stop is closed first.
func (b *budget) acquire(n int64, dead, stop <-chan struct{}) bool {
	for {
		b.mu.Lock()
		if b.free >= n {
			b.free -= n
			b.mu.Unlock()
			return true
		}
		w := b.wake
		b.waiters++
		b.mu.Unlock()
		ok := true
		select {
		case <-w:
		case <-dead:
			ok = false
		case <-stop:
			ok = false
		}
		b.mu.Lock()
		b.waiters--
		b.mu.Unlock()
		if !ok {
			return false
		}
	}
}

func (b *budget) release(n int64) {
	b.mu.Lock()
	b.free += n
	if b.waiters > 0 {
		close(b.wake)
		b.wake = make(chan struct{})
	}
	b.mu.Unlock()
}

// Server serves exports to NBD clients on any number of listeners.
type Server struct {
	opts Options
	log  *log.Entry
	ctx  context.Context
	stop context.CancelFunc

	mem *budget // request and reply data held, over all connections

	mu      sync.Mutex
	lns     map[net.Listener]struct{}
	conns   map[net.Conn]struct{}
	perAddr map[netip.Addr]int
	perLn   map[net.Listener]int // connections of each listener (MaxConns)
	wg      sync.WaitGroup

	refusals log.Limiter
	arenaMem *membudget.Budget // the connections' arenas (MaxArenaMemory)
	blocks   sync.Map          // export name → *sync.RWMutex (conn.blocks)
	// draining: Close has begun; requests read from then on are answered ESHUTDOWN and
	// options ERR_SHUTDOWN, while those in flight (inflight, over all connections) finish.
	draining atomic.Bool
	inflight atomic.Int64
}

// NewServer returns a server; Serve starts it on a listener.
func NewServer(opts Options) *Server {
	if opts.MaxInflight <= 0 {
		opts.MaxInflight = 128
	}
	if opts.MaxConnMemory <= 0 {
		opts.MaxConnMemory = 64 << 20
	}
	if opts.MaxMemory <= 0 {
		opts.MaxMemory = 1 << 30
	}
	if opts.MaxArenaMemory == 0 {
		opts.MaxArenaMemory = 128 << 20
	}
	opts.MaxConnMemory = max(opts.MaxConnMemory, MaxRequest)
	opts.MaxMemory = max(opts.MaxMemory, opts.MaxConnMemory)
	if opts.ReplyTimeout <= 0 {
		opts.ReplyTimeout = 30 * time.Second
	}
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = 30 * time.Second
	}
	if opts.MaxConns <= 0 {
		opts.MaxConns = 256
	}
	if opts.MaxConnsPerAddr <= 0 {
		opts.MaxConnsPerAddr = 32
	}
	s := &Server{opts: opts, log: log.G(context.Background()).WithField("component", "nbd"), mem: newBudget(opts.MaxMemory), arenaMem: membudget.New(opts.MaxArenaMemory),
		lns: map[net.Listener]struct{}{}, conns: map[net.Conn]struct{}{}, perAddr: map[netip.Addr]int{}, perLn: map[net.Listener]int{}}
	s.ctx, s.stop = context.WithCancel(context.Background())
	return s
}

// Serve accepts connections on ln until Close; it returns nil after Close.
func (s *Server) Serve(ln net.Listener) error { return s.serve(ln, nil) }

// ServeTLS serves on ln to clients that start TLS (NBD_OPT_STARTTLS) with cfg before any
// other option; the others are refused (NBD_REP_ERR_TLS_REQD). Give cfg ClientCAs and
// ClientAuth to require client certificates.
func (s *Server) ServeTLS(ln net.Listener, cfg *tls.Config) error {
	if cfg == nil {
		return errors.New("nbd: ServeTLS without a TLS configuration")
	}
	return s.serve(ln, cfg)
}

func (s *Server) serve(ln net.Listener, tlsCfg *tls.Config) error {
	s.mu.Lock()
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		return ln.Close()
	}
	s.lns[ln] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil || s.draining.Load() {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Out of descriptors and the like: back off and go on; the listener must
			// outlive a flood.
			s.refusals.Warn(s.log, "accept failed", ln.Addr().String(), err.Error())
			select {
			case <-s.ctx.Done():
				return nil
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		var peer netip.Addr
		if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			peer = peerGroup(ta.AddrPort().Addr())
		}
		s.mu.Lock()
		if s.ctx.Err() != nil {
			s.mu.Unlock()
			c.Close()
			return nil
		}
		if s.perLn[ln] >= s.opts.MaxConns || peer.IsValid() && s.perAddr[peer] >= s.opts.MaxConnsPerAddr {
			s.mu.Unlock()
			s.refusals.Warn(s.log, "connections", c.RemoteAddr().String(), fmt.Sprintf("NBD connections at the bound (%d on %s, %d per address)", s.opts.MaxConns, ln.Addr(), s.opts.MaxConnsPerAddr))
			c.Close()
			continue
		}
		s.conns[c] = struct{}{}
		s.perLn[ln]++
		if peer.IsValid() {
			s.perAddr[peer]++
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveConn(c, tlsCfg)
			s.mu.Lock()
			delete(s.conns, c)
			if s.perLn[ln]--; s.perLn[ln] <= 0 {
				delete(s.perLn, ln)
			}
			if peer.IsValid() {
				if s.perAddr[peer]--; s.perAddr[peer] <= 0 {
					delete(s.perAddr, peer)
				}
			}
			s.mu.Unlock()
			c.Close()
		}()
	}
}

// peerGroup is what MaxConnsPerAddr counts a TCP client as: an IPv6 one by its /64, which one
// host picks source addresses from, and loopback as one address, since any local user can
// connect from each of 127.0.0.1 to 127.255.255.254 (one user filled the listener from nine).
func peerGroup(a netip.Addr) netip.Addr {
	a = a.Unmap()
	switch {
	case a.IsLoopback():
		return netip.IPv4Unspecified()
	case a.Is6():
		p, _ := a.Prefix(64)
		return p.Addr()
	}
	return a
}

// Close stops the listeners and shuts the connections down in order, as the spec asks: the
// requests in flight are answered first (for up to drainWait), those read meanwhile get
// ESHUTDOWN and options ERR_SHUTDOWN; then every connection ends and Close waits for their
// requests, up to closeWait: a request its device never answers (a server that answers its
// heartbeats but not the IO) would hold a daemon's stop for ever. Those are left to end when
// their device's session closes.
func (s *Server) Close() {
	s.mu.Lock()
	s.draining.Store(true)
	for ln := range s.lns {
		ln.Close()
	}
	s.mu.Unlock()
	for t0 := time.Now(); s.inflight.Load() > 0 && time.Since(t0) < drainWait; {
		time.Sleep(5 * time.Millisecond)
	}
	s.mu.Lock()
	s.stop()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.log.Warnf("nbd: closed with requests unanswered by their devices after %v; they end when their sessions close", closeWait)
	}
}

// drainWait bounds how long Close lets the requests in flight finish before it ends the
// connections; closeWait how long it then waits for them.
var drainWait, closeWait = 5 * time.Second, 10 * time.Second

func (s *Server) lookup(name string) (Export, bool) {
	exps := s.opts.Exports()
	for _, e := range exps {
		if e.Name == name {
			return e, true
		}
	}
	if name == "" && len(exps) == 1 {
		return exps[0], true // the default export, when there is only one
	}
	return Export{}, false
}

type conn struct {
	s   *Server
	c   net.Conn
	r   *sockread.Reader
	exp Export

	inflight sync.WaitGroup // requests read and not yet answered
	sem      chan struct{}  // one slot per request in flight
	mem      *budget        // their data held
	dead     chan struct{}  // closed with the socket (kill)
	killOnce sync.Once
	nc       net.Conn // the socket under c (which TLS may wrap)
	kernel   bool     // the kernel's nbd (ServeTransmission): outside the server's budget
	chunk    net.Buffers
	// The device's memory for request data (BufferDevice), taken by the transmission's
	// goroutine at the first read or write (a connection that only looks takes none); nil:
	// the pools.
	bufDev BufferDevice
	ar     atomic.Pointer[arena]

	qmu      sync.Mutex // the reply queue
	pending  []pendingReply
	gathered atomic.Bool // replies queued by gather wait for the hook
	spare    []pendingReply
	writing  bool

	// The writer's (one at a time, under writing).
	hdrs  []byte
	iovs  net.Buffers // the batch's buffers
	bufs  net.Buffers // what of them is still to write
	werr  error
	raw   syscall.RawConn // for writes that must not wait; nil if nc is no socket
	iov   []syscall.Iovec
	wn    int
	wleft int // what a blocking write's deadline still covers
	we    syscall.Errno
	wfn   func(fd uintptr) bool

	// bsAgreed: the client asked for NBD_INFO_BLOCK_SIZE in GO (or is the kernel's, told
	// the size at the attach), so it sends whole blocks; any other may send any byte range
	// (the spec's minimum block size of 1), served by read-modify-write. blocks is the
	// export's lock: writes in whole blocks share it, a read-modify-write holds it alone,
	// so a write into the rest of a block it rewrites is not lost.
	bsAgreed bool
	blocks   *sync.RWMutex
	tf       uint16 // the transmission flags the client was told (tflags at use)
	bs       uint64 // the export's logical block size

	tlsCfg *tls.Config // set on a listener that requires TLS
	letGo  func()      // lets go of the export's device (Holder), once chosen
	inTLS  bool
}

// newConn prepares a connection for the handshake or the transmission phase.
func (s *Server) newConn(nc net.Conn) *conn {
	c := &conn{s: s, c: nc, nc: nc, r: sockread.New(nc, 64<<10), dead: make(chan struct{})}
	// Room for a few whole 1 MiB replies where net.core.wmem_max allows, so that a large
	// read reply leaves in one write instead of a write per 200 KiB and a wait between each.
	if wb, ok := nc.(interface{ SetWriteBuffer(int) error }); ok {
		_ = wb.SetWriteBuffer(4 << 20)
	}
	if sc, ok := nc.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			c.raw = raw
			c.wfn = c.writevOnce
		}
	}
	return c
}

func (s *Server) serveConn(nc net.Conn, tlsCfg *tls.Config) {
	c := s.newConn(nc)
	c.tlsCfg = tlsCfg
	defer func() {
		if c.letGo != nil {
			c.letGo()
		}
	}()
	lg := s.log.WithField("client", nc.RemoteAddr().String())
	_ = nc.SetDeadline(time.Now().Add(s.opts.HandshakeTimeout))
	ok, err := c.handshake()
	if err != nil || !ok {
		if err != nil && !errors.Is(err, io.EOF) {
			// Refusals (TLS, an unknown export, a bad option, the handshake's time) are
			// logged with the peer, rate-limited per cause: the peer chooses how often.
			s.refusals.Warn(s.log, "handshake refused", nc.RemoteAddr().String(), clip(err.Error()))
		}
		return
	}
	_ = nc.SetDeadline(time.Time{})
	lg.Debugf("serving %q", c.exp.Name)
	err = c.transmit()
	if err != nil && !clientGone(err) && s.ctx.Err() == nil {
		s.refusals.Warn(s.log, "connection ended", nc.RemoteAddr().String(), clip(err.Error()))
	}
	if tc, ok := c.c.(*tls.Conn); ok && err == nil {
		// After DISC the spec has TLS shut down before the socket closes: close_notify,
		// bounded, as the client may not read it.
		_ = tc.SetWriteDeadline(time.Now().Add(time.Second))
		_ = tc.CloseWrite()
	}
}

// use makes e the connection's export; bsAgreed says whether the client agreed to its
// block size.
func (c *conn) use(e Export, bsAgreed bool) {
	c.exp, c.bsAgreed = e, bsAgreed
	c.tf, c.bs = c.tflags(), uint64(e.Dev.BlockSize())
	l, _ := c.s.blocks.LoadOrStore(e.Name, new(sync.RWMutex))
	c.blocks = l.(*sync.RWMutex)
}

// hold makes the connection an opener of e's device (Holder), until it ends.
func (c *conn) hold(e Export) error {
	h, ok := e.Dev.(Holder)
	if !ok {
		return nil
	}
	release, err := h.Hold(clientName(c.nc), c.kill)
	if err != nil {
		return err
	}
	if c.letGo != nil {
		c.letGo() // an export chosen before (the handshake ends at the first, so far)
	}
	c.letGo = release
	return nil
}

// clientName names a socket client for an unmap's refusal: its address over TCP, its pid
// over a Unix socket.
func clientName(nc net.Conn) string {
	if uc, ok := nc.(*net.UnixConn); ok {
		if rc, err := uc.SyscallConn(); err == nil {
			var cred *unix.Ucred
			_ = rc.Control(func(fd uintptr) {
				cred, _ = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
			})
			if cred != nil {
				// nbd-client hands its socket to the kernel and exits: the pid may be gone,
				// the /dev/nbdX it set up (whose pid file says so) stays until nbd-client -d.
				return fmt.Sprintf("NBD client pid %d at connect", cred.Pid)
			}
		}
		return "NBD client"
	}
	return "NBD client " + nc.RemoteAddr().String()
}

// clip bounds a peer's words in a log line.
func clip(s string) string {
	if len(s) > 200 {
		return strings.ToValidUTF8(s[:200], "") + "…"
	}
	return s
}

// clientGone says err is the client closing its end, not worth a warning.
func clientGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// handshake runs the fixed-newstyle negotiation; ok says an export was chosen.
func (c *conn) handshake() (bool, error) {
	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:], nbdMagic)
	binary.BigEndian.PutUint64(hello[8:], optMagic)
	binary.BigEndian.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.c.Write(hello[:]); err != nil {
		return false, err
	}
	var cf [4]byte
	if err := c.r.ReadFull(cf[:]); err != nil {
		return false, err
	}
	clientFlags := binary.BigEndian.Uint32(cf[:])
	if clientFlags&^(flagFixedNewstyle|flagNoZeroes) != 0 {
		return false, fmt.Errorf("nbd: client flags %#x", clientFlags)
	}
	if c.tlsCfg != nil && clientFlags&flagFixedNewstyle == 0 {
		// Such a client cannot be told TLS is required (the spec forbids the reply to it),
		// and this listener serves nothing in clear.
		return false, errors.New("nbd: a client without fixed newstyle on a listener that requires TLS")
	}
	noZeroes := clientFlags&flagNoZeroes != 0
	for {
		var h [16]byte
		if err := c.r.ReadFull(h[:]); err != nil {
			return false, err
		}
		if binary.BigEndian.Uint64(h[:]) != optMagic {
			return false, errors.New("nbd: bad option magic")
		}
		opt, n := binary.BigEndian.Uint32(h[8:]), binary.BigEndian.Uint32(h[12:])
		// Data past maxOptLen is skipped unread and the option refused below, so the stream
		// stays in step; past maxOptSkip the connection ends (a peer sending that much is
		// no client).
		tooBig := n > maxOptLen
		var data []byte
		if tooBig {
			if n > maxOptSkip || opt == optExportName {
				return false, fmt.Errorf("nbd: option %d of %d bytes", opt, n)
			}
			if err := c.skip(int64(n)); err != nil {
				return false, err
			}
		} else {
			data = make([]byte, n)
			if err := c.r.ReadFull(data); err != nil {
				return false, err
			}
		}
		if c.s.draining.Load() && opt != optAbort {
			if opt == optExportName {
				return false, errors.New("nbd: EXPORT_NAME while shutting down") // it has no error reply
			}
			if err := c.optReply(opt, repErrShutdown, []byte("the server is shutting down")); err != nil {
				return false, err
			}
			continue
		}
		if c.tlsCfg != nil && !c.inTLS && opt != optStartTLS && opt != optAbort {
			if opt == optExportName {
				return false, errors.New("nbd: EXPORT_NAME before STARTTLS on a listener that requires TLS")
			}
			if err := c.optReply(opt, repErrTLSReqd, []byte("TLS required: send NBD_OPT_STARTTLS first")); err != nil {
				return false, err
			}
			continue
		}
		if tooBig && opt != optStartTLS { // STARTTLS with data is ERR_INVALID, below
			rep := uint32(repErrUnsup)
			switch opt {
			case optList, optInfo, optGo, optAbort:
				rep = repErrTooBig
			}
			if err := c.optReply(opt, rep, []byte("option data too large")); err != nil {
				return false, err
			}
			continue
		}
		switch opt {
		case optStartTLS:
			if err := c.startTLS(n); err != nil {
				return false, err
			}
		case optExportName:
			e, ok := c.s.lookup(string(data))
			if !ok {
				return false, fmt.Errorf("nbd: no export %q", data)
			}
			if err := c.hold(e); err != nil {
				return false, err // this option has no error reply
			}
			c.use(e, false)
			b := make([]byte, 10, 134)
			binary.BigEndian.PutUint64(b, uint64(e.Dev.Size()))
			binary.BigEndian.PutUint16(b[8:], c.tflags())
			if !noZeroes {
				b = b[:134]
			}
			_, err := c.c.Write(b)
			return err == nil, err
		case optAbort:
			_ = c.optReply(opt, repAck, nil)
			return false, nil
		case optList:
			if n != 0 {
				if err := c.optReply(opt, repErrInval, nil); err != nil {
					return false, err
				}
				continue
			}
			for _, e := range c.s.opts.Exports() {
				b := binary.BigEndian.AppendUint32(nil, uint32(len(e.Name)))
				b = append(append(b, e.Name...), e.Description...)
				if err := c.optReply(opt, repServer, b); err != nil {
					return false, err
				}
			}
			if err := c.optReply(opt, repAck, nil); err != nil {
				return false, err
			}
		case optInfo, optGo:
			done, err := c.infoGo(opt, data)
			if err != nil || done {
				return done, err
			}
		default: // STRUCTURED_REPLY, meta contexts, extended headers, ...
			if err := c.optReply(opt, repErrUnsup, nil); err != nil {
				return false, err
			}
		}
	}
}

// skip reads and drops n bytes of option data.
func (c *conn) skip(n int64) error {
	var b [4096]byte
	for n > 0 {
		k := min(n, int64(len(b)))
		if err := c.r.ReadFull(b[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// startTLS answers NBD_OPT_STARTTLS (n: its data length): on a listener with TLS the
// connection continues inside a TLS session; elsewhere the option is unsupported.
func (c *conn) startTLS(n uint32) error {
	switch {
	case c.tlsCfg == nil:
		return c.optReply(optStartTLS, repErrUnsup, nil)
	case c.inTLS || n != 0:
		return c.optReply(optStartTLS, repErrInval, nil)
	case c.r.Buffered() > 0:
		return errors.New("nbd: data after STARTTLS before the TLS handshake")
	}
	if err := c.optReply(optStartTLS, repAck, nil); err != nil {
		return err
	}
	tc := tls.Server(c.c, c.tlsCfg)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("nbd: TLS handshake: %w", err)
	}
	// From here every byte goes through the TLS session: no raw socket writes.
	c.c, c.r, c.raw, c.inTLS = tc, sockread.New(tc, 64<<10), nil, true
	return nil
}

func (c *conn) tflags() uint16 {
	f := uint16(tflagHasFlags | tflagSendFlush | tflagSendFUA | tflagCanMultiConn)
	if c.exp.ReadOnly {
		return f | tflagReadOnly
	}
	ro, ok := c.exp.Dev.(RangeOps)
	if !ok || ro.CanDiscard() {
		f |= tflagSendTrim
	}
	if !ok || ro.CanWriteZeroes() {
		f |= tflagWriteZeroes
	}
	return f
}

// infoGo answers NBD_OPT_INFO and NBD_OPT_GO; done is true when GO chose an export.
func (c *conn) infoGo(opt uint32, data []byte) (bool, error) {
	be := binary.BigEndian
	if len(data) < 6 {
		return false, c.optReply(opt, repErrInval, nil)
	}
	nl := int(be.Uint32(data))
	if nl > len(data)-6 {
		return false, c.optReply(opt, repErrInval, nil)
	}
	name := string(data[4 : 4+nl])
	nreq := int(be.Uint16(data[4+nl:]))
	if len(data) != 6+nl+2*nreq {
		return false, c.optReply(opt, repErrInval, nil)
	}
	e, ok := c.s.lookup(name)
	if !ok {
		return false, c.optReply(opt, repErrUnknwn, []byte("no such export"))
	}
	reqs := map[uint16]bool{}
	for i := 0; i < nreq; i++ {
		reqs[be.Uint16(data[6+nl+2*i:])] = true
	}
	if opt == optGo {
		if err := c.hold(e); err != nil {
			c.s.refusals.Warn(c.s.log, "export refused", clientName(c.nc), clip(err.Error()))
			return false, c.optReply(opt, repErrUnknwn, []byte(clip(err.Error())))
		}
	}
	prev := c.exp
	c.exp = e
	b := be.AppendUint16(nil, infoExport)
	b = be.AppendUint64(b, uint64(e.Dev.Size()))
	b = be.AppendUint16(b, c.tflags())
	if err := c.optReply(opt, repInfo, b); err != nil {
		return false, err
	}
	if reqs[infoName] {
		if err := c.optReply(opt, repInfo, append(be.AppendUint16(nil, infoName), e.Name...)); err != nil {
			return false, err
		}
	}
	if reqs[infoDescription] && e.Description != "" {
		if err := c.optReply(opt, repInfo, append(be.AppendUint16(nil, infoDescription), e.Description...)); err != nil {
			return false, err
		}
	}
	bs := uint32(e.Dev.BlockSize())
	b = be.AppendUint16(nil, infoBlockSize)
	b = be.AppendUint32(b, bs)
	b = be.AppendUint32(b, max(bs, 4096))
	b = be.AppendUint32(b, MaxRequest)
	if err := c.optReply(opt, repInfo, b); err != nil {
		return false, err
	}
	if err := c.optReply(opt, repAck, nil); err != nil {
		return false, err
	}
	if opt == optInfo {
		c.exp = prev
		return false, nil
	}
	c.use(e, reqs[infoBlockSize])
	return true, nil
}

func (c *conn) optReply(opt, typ uint32, data []byte) error {
	b := make([]byte, 20, 20+len(data))
	binary.BigEndian.PutUint64(b, optReplyMagic)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(data)))
	_, err := c.c.Write(append(b, data...))
	return err
}

// AsyncDevice is a Device that can also start reads and writes without a goroutine per
// request; done is called once, from any goroutine, and must not block.
type AsyncDevice interface {
	ReadAsync(ctx context.Context, p []byte, off int64, done func(error))
	WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error))
}

// PluggingDevice can gather the requests started between Plug and Unplug and send them
// together; the server plugs while more requests are already buffered from the client.
type PluggingDevice interface {
	Plug()
	Unplug()
}

// BatchingDevice is an AsyncDevice that runs a hook after every batch of done callbacks
// (and after any callback it made outside a batch): replies gathered in the callbacks go
// out in one write from the hook.
type BatchingDevice interface {
	AsyncDevice
	AfterCompletions(fn func()) (remove func())
}

// pendingReply is a reply waiting for the writer, with the buffers to recycle after it.
type pendingReply struct {
	cookie  uint64
	err     error
	data    []byte // READ data to send
	payload []byte // WRITE payload to recycle
	cost    int64  // the bytes of data it holds against the budgets
}

// transmit reads requests and serves up to MaxInflight of them at once, holding at most
// MaxConnMemory of their data; replies go out as they complete, in any order (clients match
// them by cookie), gathered by one writer.
func (c *conn) transmit() (err error) {
	c.sem = make(chan struct{}, c.s.opts.MaxInflight)
	c.mem = newBudget(c.s.opts.MaxConnMemory)
	sem := c.sem
	async, _ := c.exp.Dev.(AsyncDevice)
	queueAsync := c.queue
	if b, ok := c.exp.Dev.(BatchingDevice); ok {
		queueAsync = c.gather
		defer b.AfterCompletions(c.flushGathered)() // after the Wait below: it writes the replies
	}
	if d, ok := c.exp.Dev.(BufferDevice); ok {
		c.bufDev = d // the arena is taken at the first read or write
		defer func() {
			if ar := c.ar.Load(); ar != nil {
				c.s.closeArena(ar) // after the Wait below
			}
		}()
	}
	defer c.inflight.Wait() // every request answered (or dropped with the connection)
	defer func() {
		if err != nil {
			c.kill() // what is in flight is answered to nobody, and nothing waits for the client
		}
	}()
	// While the next request is already buffered, the device is plugged: requests read in
	// one go leave in one go. Unplugged before anything that waits, and after maxPlugged
	// requests in a row, so that a client that streams requests cannot keep the session's
	// other users' IO back.
	plugger, _ := c.exp.Dev.(PluggingDevice)
	plugged, inPlug := false, 0
	unplug := func() {
		if plugged {
			plugger.Unplug()
			plugged, inPlug = false, 0
		}
	}
	defer unplug()
	var hdr [requestSize]byte
	for {
		// The next read may wait: what is plugged goes first, unless the socket already has
		// the next request (fio submits while we post).
		if c.r.Buffered() < requestSize && (!plugged || c.r.FillNow() == 0 || c.r.Buffered() < requestSize) {
			unplug()
		}
		if err := c.r.ReadFull(hdr[:]); err != nil {
			return err
		}
		req, err := DecodeRequest(hdr[:])
		if err != nil {
			return err
		}
		if req.Type == CmdWrite && req.Length > MaxRequest {
			return fmt.Errorf("nbd: write of %d bytes", req.Length)
		}
		if req.Type == CmdDisc {
			return nil // the deferred Wait lets the requests in flight answer first
		}
		var cost int64
		if req.Type == CmdRead && req.Length <= MaxRequest || req.Type == CmdWrite {
			cost = int64(req.Length)
		}
		if !c.take(sem, cost, unplug) {
			if err := c.s.ctx.Err(); err != nil {
				return err
			}
			return fmt.Errorf("nbd: the connection died while a request waited for a slot or bytes (a reply not taken for %v, or a failed write): %w", c.s.opts.ReplyTimeout, net.ErrClosed)
		}
		var payload []byte
		if req.Type == CmdWrite {
			if c.r.Buffered() < int(req.Length) {
				unplug() // what is plugged must not wait for a payload still on its way
			}
			payload = c.getBuf(int(req.Length))
			if err := c.r.ReadFull(payload); err != nil {
				c.putBuf(payload)
				c.give(cost)
				return err
			}
		}
		c.inflight.Add(1)
		c.s.inflight.Add(1)
		// A plug holds at most maxPlugged requests, refused ones counted: a stream of them
		// must not keep back what a plug holds.
		if inPlug++; inPlug > maxPlugged {
			unplug()
		}
		if c.s.draining.Load() {
			c.queue(pendingReply{cookie: req.Cookie, err: syscall.ESHUTDOWN, payload: payload, cost: cost})
			continue
		}
		if err := c.check(req); err != nil || req.Length == 0 && req.Type != CmdFlush {
			// A zero-length request is answered here, with success once it passed the
			// checks: the spec leaves it open, and RNBD has no IO of no bytes to send.
			c.queue(pendingReply{cookie: req.Cookie, err: err, payload: payload, cost: cost})
			continue
		}
		if plugger != nil && !plugged && c.r.Buffered() >= requestSize {
			plugger.Plug()
			plugged, inPlug = true, 1
		}
		off, fua := int64(req.Offset), req.Flags&CmdFlagFUA != 0
		switch {
		case !c.aligned(req):
			go c.serveUnaligned(req, payload, cost)
		case async != nil && req.Type == CmdRead:
			a := newAsyncReply(queueAsync, pendingReply{cookie: req.Cookie, data: c.getBuf(int(req.Length)), cost: cost})
			async.ReadAsync(c.s.ctx, a.r.data, off, a.cb)
		case async != nil && req.Type == CmdWrite:
			a := newAsyncReply(queueAsync, pendingReply{cookie: req.Cookie, payload: payload, cost: cost})
			if !c.blocks.TryRLock() {
				// A read-modify-write holds the export, or waits for writes of ours that a
				// plug keeps back: what is plugged goes first, then this write waits.
				unplug()
				c.blocks.RLock()
			}
			a.held = c.blocks
			async.WriteAsync(c.s.ctx, payload, off, fua, a.cb)
		default:
			go c.serve(req, payload, cost)
		}
	}
}

// maxPlugged bounds the requests of a connection that one plug holds back.
const maxPlugged = 64

// take waits for a slot and for cost bytes of the connection's and the server's budgets;
// false if the server stops or the connection dies meanwhile. What is plugged goes first
// when it would wait: slots and bytes come back with replies, which need it.
func (c *conn) take(sem chan struct{}, cost int64, unplug func()) bool {
	select {
	case sem <- struct{}{}:
	default:
		unplug()
		select {
		case sem <- struct{}{}:
		case <-c.dead:
			return false
		case <-c.s.ctx.Done():
			return false
		}
	}
	if cost == 0 {
		return true
	}
	if !c.mem.tryAcquire(cost) {
		unplug()
		if !c.mem.acquire(cost, c.dead, c.s.ctx.Done()) {
			<-sem
			return false
		}
	}
	if c.kernel {
		// The kernel's own queue bounds what it sends, and its IO must not wait for
		// socket clients to give bytes back.
		return true
	}
	if !c.s.mem.tryAcquire(cost) {
		unplug()
		if !c.s.mem.acquire(cost, c.dead, c.s.ctx.Done()) {
			c.mem.release(cost)
			<-sem
			return false
		}
	}
	return true
}

// give returns a request's slot and bytes.
func (c *conn) give(cost int64) {
	if cost > 0 {
		if !c.kernel {
			c.s.mem.release(cost)
		}
		c.mem.release(cost)
	}
	<-c.sem
}

// kill closes the socket: the reader and the writer see it, and what waits for the client
// (a slot, bytes) gives up.
func (c *conn) kill() {
	c.killOnce.Do(func() {
		close(c.dead)
		c.nc.Close() // the socket itself: a TLS close would try to send close_notify first
	})
}

// asyncReply is the pending reply of an asynchronous request, pooled with its done callback
// bound once, so that a request allocates nothing.
type asyncReply struct {
	r     pendingReply
	queue func(pendingReply)
	cb    func(error)
	held  *sync.RWMutex // the export's lock, shared by a write until it is done
}

var asyncReplies sync.Pool

func init() {
	// Set here: the callback puts the reply back into the pool it comes from.
	asyncReplies.New = func() any {
		a := new(asyncReply)
		a.cb = a.done
		return a
	}
}

func newAsyncReply(queue func(pendingReply), r pendingReply) *asyncReply {
	a := asyncReplies.Get().(*asyncReply)
	a.r, a.queue = r, queue
	return a
}

// done is the device's callback: the reply is queued, the holder goes back to the pool.
func (a *asyncReply) done(err error) {
	r, queue, held := a.r, a.queue, a.held
	a.r, a.queue, a.held = pendingReply{}, nil, nil
	asyncReplies.Put(a)
	if held != nil {
		held.RUnlock()
	}
	r.err = err
	queue(r)
}

// serve runs one request synchronously and queues its reply.
func (c *conn) serve(req Request, payload []byte, cost int64) {
	ctx := c.s.ctx
	d := c.exp.Dev
	var data []byte
	fua := req.Flags&CmdFlagFUA != 0
	off, n := int64(req.Offset), int64(req.Length)
	var err error
	if req.Type != CmdRead && req.Type != CmdFlush {
		c.blocks.RLock()
		defer c.blocks.RUnlock()
	}
	switch req.Type {
	case CmdRead:
		data = getBuf(int(n))
		err = d.ReadAtContext(ctx, data, off)
	case CmdWrite:
		err = d.WriteAtContext(ctx, payload, off, fua)
	case CmdFlush:
		err = d.Flush(ctx)
	case CmdTrim:
		if err = d.Discard(ctx, off, n); err == nil && fua {
			err = d.Flush(ctx)
		}
	case CmdWriteZeroes:
		if err = d.WriteZeroes(ctx, off, n, req.Flags&CmdFlagNoHole != 0); err == nil && fua {
			err = d.Flush(ctx)
		}
		if errors.Is(err, syscall.EOPNOTSUPP) {
			err = errZeroesNotSup{err}
		}
	}
	c.queue(pendingReply{cookie: req.Cookie, err: err, data: data, payload: payload, cost: cost})
}

// errZeroesNotSup is a WRITE_ZEROES the device could not do: ENOTSUP on the wire, on which
// qemu and the kernel's nbd write the zeroes themselves.
type errZeroesNotSup struct{ error }

func (e errZeroesNotSup) Unwrap() error { return e.error }

// check refuses what the export cannot take: unknown commands, command flags the command or
// the handshake does not allow, writes to a read-only export, ranges outside the device or
// not in whole blocks, oversized reads.
func (c *conn) check(req Request) error {
	switch req.Type {
	case CmdRead, CmdWrite, CmdTrim, CmdWriteZeroes, CmdFlush:
	default:
		return fmt.Errorf("nbd: command %d: %w", req.Type, syscall.EINVAL)
	}
	// FUA goes with any command (clients are known to set it beyond writes), NO_HOLE with
	// WRITE_ZEROES. DF and FAST_ZERO need transmission flags this server does not announce
	// (SEND_DF with structured replies, SEND_FAST_ZERO), so they are refused as the spec
	// asks: a FAST_ZERO done slowly, or a DF read in pieces, would break the client's use.
	allowed := uint16(CmdFlagFUA)
	if req.Type == CmdWriteZeroes {
		allowed |= CmdFlagNoHole
	}
	if req.Flags&^allowed != 0 {
		return fmt.Errorf("nbd: command %d with flags %#x: %w", req.Type, req.Flags, syscall.EINVAL)
	}
	if req.Type == CmdFlush {
		return nil
	}
	if req.Type != CmdRead && c.exp.ReadOnly {
		return syscall.EPERM
	}
	// A command the transmission flags did not offer is EINVAL, as the spec has it.
	if f := c.tf; req.Type == CmdTrim && f&tflagSendTrim == 0 || req.Type == CmdWriteZeroes && f&tflagWriteZeroes == 0 {
		return fmt.Errorf("nbd: command %d not offered for this export: %w", req.Type, syscall.EINVAL)
	}
	if req.Type == CmdRead && req.Length > MaxRequest {
		return syscall.EINVAL
	}
	bs := c.bs
	end := req.Offset + uint64(req.Length)
	if end < req.Offset || end > uint64(c.exp.Dev.Size()) {
		if req.Type == CmdWrite || req.Type == CmdWriteZeroes {
			return syscall.ENOSPC
		}
		return syscall.EINVAL
	}
	if c.bsAgreed && (req.Offset%bs != 0 || uint64(req.Length)%bs != 0) {
		return syscall.EINVAL
	}
	return nil
}

// aligned says whether req covers whole blocks (a FLUSH always does).
func (c *conn) aligned(req Request) bool {
	return req.Type == CmdFlush || req.Offset%c.bs == 0 && uint64(req.Length)%c.bs == 0
}

// serveUnaligned serves a request of a client that agreed to no block size and sent part of
// a block: a READ reads the blocks it touches; a WRITE or WRITE_ZEROES reads the first and
// last block it touches in part, merges, and writes them back with the whole blocks between,
// holding the export's lock alone; a TRIM, advisory, discards the whole blocks inside it.
func (c *conn) serveUnaligned(req Request, payload []byte, cost int64) {
	ctx, d := c.s.ctx, c.exp.Dev
	bs := int64(d.BlockSize())
	off, n := int64(req.Offset), int64(req.Length)
	start, end := off-off%bs, (off+n+bs-1)/bs*bs
	fua := req.Flags&CmdFlagFUA != 0
	var data []byte
	var err error
	switch req.Type {
	case CmdRead:
		buf := make([]byte, end-start)
		if err = d.ReadAtContext(ctx, buf, start); err == nil {
			data = getBuf(int(n))
			copy(data, buf[off-start:])
		}
	case CmdTrim:
		if in0, in1 := (off+bs-1)/bs*bs, (off+n)/bs*bs; in1 > in0 {
			c.blocks.RLock()
			err = d.Discard(ctx, in0, in1-in0)
			c.blocks.RUnlock()
		}
		if err == nil && fua {
			err = d.Flush(ctx)
		}
	case CmdWrite:
		c.blocks.Lock()
		err = c.rmw(start, end, off, payload, fua)
		c.blocks.Unlock()
	case CmdWriteZeroes:
		c.blocks.Lock()
		err = c.zeroUnaligned(start, end, off, n, req.Flags&CmdFlagNoHole != 0, fua)
		c.blocks.Unlock()
		if errors.Is(err, syscall.EOPNOTSUPP) {
			err = errZeroesNotSup{err}
		}
	}
	c.queue(pendingReply{cookie: req.Cookie, err: err, data: data, payload: payload, cost: cost})
}

// rmw writes p at off inside the blocks [start, end): the partial first and last blocks are
// read first. Called with the export's lock held alone.
func (c *conn) rmw(start, end, off int64, p []byte, fua bool) error {
	ctx, d := c.s.ctx, c.exp.Dev
	bs := int64(d.BlockSize())
	buf := make([]byte, end-start)
	if off != start {
		if err := d.ReadAtContext(ctx, buf[:bs], start); err != nil {
			return err
		}
	}
	if tail := end - bs; off+int64(len(p)) != end && (tail != start || off == start) {
		if err := d.ReadAtContext(ctx, buf[tail-start:], tail); err != nil {
			return err
		}
	}
	copy(buf[off-start:], p)
	return d.WriteAtContext(ctx, buf, start, fua)
}

// zeroUnaligned zeroes [off, off+n) inside the blocks [start, end): the partial first and
// last blocks by read-modify-write, the whole blocks between as the device zeroes them.
// Called with the export's lock held alone.
func (c *conn) zeroUnaligned(start, end, off, n int64, noHole, fua bool) error {
	ctx, d := c.s.ctx, c.exp.Dev
	bs := int64(d.BlockSize())
	in0, in1 := (off+bs-1)/bs*bs, (off+n)/bs*bs
	if in1 <= in0 {
		// Within one block, or two partial ones with none between.
		if err := c.rmw(start, end, off, make([]byte, n), false); err != nil {
			return err
		}
	} else {
		if in0 != off {
			if err := c.rmw(start, in0, off, make([]byte, in0-off), false); err != nil {
				return err
			}
		}
		if err := d.WriteZeroes(ctx, in0, in1-in0, noHole); err != nil {
			return err
		}
		if in1 != off+n {
			if err := c.rmw(in1, end, in1, make([]byte, off+n-in1), false); err != nil {
				return err
			}
		}
	}
	if fua {
		return d.Flush(ctx)
	}
	return nil
}

// queue hands a reply over; it never waits for another reply's write. Whoever finds no
// write in progress becomes the writer and sends what has gathered, batch after batch, so
// a lone completion goes out from its own goroutine with no hand-off.
func (c *conn) queue(r pendingReply) {
	c.qmu.Lock()
	c.pending = append(c.pending, r)
	if c.writing {
		c.qmu.Unlock()
		return
	}
	c.writeAllLocked(false)
}

// gather queues a reply without writing it: the device's after-completions hook sends
// everything gathered in one write.
func (c *conn) gather(r pendingReply) {
	c.qmu.Lock()
	c.pending = append(c.pending, r)
	c.qmu.Unlock()
	c.gathered.Store(true)
}

// flushGathered is the after-completions hook: it sends what gather queued, unless a write
// is in progress (whose writer then takes it).
func (c *conn) flushGathered() {
	if !c.gathered.Swap(false) {
		return
	}
	c.qmu.Lock()
	if c.writing || len(c.pending) == 0 {
		c.qmu.Unlock()
		return
	}
	c.writeAllLocked(false)
}

// writeAllLocked makes the caller the writer until nothing is pending; c.qmu is held on
// entry and released on return. Callers are the device's completion goroutines, which must
// not block (one client that stops reading its replies would stall every device of the
// transport connection): a batch the socket does not take at once is finished, and the
// queue written on, by a goroutine of its own, which may block.
func (c *conn) writeAllLocked(mayBlock bool) {
	c.writing = true
	for {
		batch := c.pending
		c.pending = c.spare[:0]
		c.qmu.Unlock()
		if !c.write(batch, mayBlock) {
			go c.finishWrite(batch)
			return
		}
		if !c.written(batch) {
			return
		}
	}
}

// written takes a written batch's list back for reuse. With more replies pending it returns
// true with c.qmu held; otherwise the write is over and it returns false, c.qmu released.
func (c *conn) written(batch []pendingReply) bool {
	c.qmu.Lock()
	c.spare = batch[:0]
	if len(c.pending) == 0 {
		c.writing = false
		c.qmu.Unlock()
		return false
	}
	return true
}

// finishWrite writes the rest of a batch that a non-blocking write left, then the queue.
func (c *conn) finishWrite(batch []pendingReply) {
	c.blockingWrite()
	c.release(batch)
	if c.written(batch) {
		c.writeAllLocked(true)
	}
}

// write sends a batch of replies in one writev; after a failed write the connection is
// closed and the rest are dropped. Either way the requests are done. Unless mayBlock, it
// makes one non-blocking attempt and returns false if that left something in c.bufs.
func (c *conn) write(batch []pendingReply, mayBlock bool) bool {
	hdrs, bufs := c.hdrs[:0], c.iovs[:0]
	for i := range batch {
		r := &batch[i]
		var e uint32
		if r.err != nil {
			e = wireError(r.err)
			if errors.As(r.err, new(errZeroesNotSup)) {
				e = errNotSup
			}
		}
		hdrs = binary.BigEndian.AppendUint32(hdrs, simpleReplyMagic)
		hdrs = binary.BigEndian.AppendUint32(hdrs, e)
		hdrs = binary.BigEndian.AppendUint64(hdrs, r.cookie)
	}
	data := 0
	for i := range batch {
		bufs = append(bufs, hdrs[i*replySize:(i+1)*replySize])
		if batch[i].err == nil && len(batch[i].data) > 0 {
			bufs = append(bufs, batch[i].data)
			data += len(batch[i].data)
		}
	}
	c.hdrs, c.iovs, c.bufs = hdrs, bufs, bufs
	if c.werr == nil && !mayBlock && data >= handOff {
		// Copying this much into the socket takes the completing goroutine (the transport
		// connection's reader) away from reading the next data for tens of µs: a goroutine
		// of its own writes it, on another CPU.
		return false
	}
	if c.werr == nil {
		switch {
		case !mayBlock && c.raw == nil:
			// No socket to try without waiting (TLS): a goroutine of its own writes.
			return false
		case !mayBlock:
			c.wn, c.we = 0, 0
			if c.werr = c.raw.Write(c.wfn); c.werr == nil && c.we != 0 {
				c.werr = c.we
			}
			if c.werr != nil {
				c.kill()
			} else if consume(&c.bufs, c.wn); len(c.bufs) > 0 {
				return false
			}
		default:
			c.blockingWrite()
		}
	}
	c.release(batch)
	return true
}

// blockingWrite writes what is left of the batch a megabyte at a time, each waiting up to
// ReplyTimeout for the client to take it: a client that takes nothing for that long dies, one
// that reads slowly does not. The deadline is cleared after, since a deadline left behind
// would fail the next non-blocking write once it has passed. On a socket the writes are raw
// writevs that wait in the netpoller: entered as system calls they would wake the runtime's
// monitor thread in an idle client on every large reply (docs/benchmarks.md).
func (c *conn) blockingWrite() {
	for len(c.bufs) > 0 && c.werr == nil {
		if c.werr = c.c.SetWriteDeadline(time.Now().Add(c.s.opts.ReplyTimeout)); c.werr != nil {
			break
		}
		if c.raw != nil {
			c.wleft, c.we = writeChunk, 0
			if c.werr = c.raw.Write(c.writevWait); c.werr == nil && c.we != 0 {
				c.werr = c.we
			}
			continue
		}
		c.chunk = c.chunk[:0]
		for left, i := writeChunk, 0; i < len(c.bufs) && left > 0; i++ {
			b := c.bufs[i][:min(len(c.bufs[i]), left)]
			c.chunk = append(c.chunk, b)
			left -= len(b)
		}
		chunk := c.chunk
		var n int64
		n, c.werr = chunk.WriteTo(c.c)
		consume(&c.bufs, int(n))
	}
	clear(c.chunk)
	if c.werr == nil {
		c.werr = c.c.SetWriteDeadline(time.Time{})
	}
	if c.werr != nil {
		c.kill() // the reader sees it and the connection ends
	}
}

// writevWait is the RawConn callback of a blocking write: writevs of c.bufs until they are
// written, writeChunk bytes have gone or the socket fails; false (wait until the socket takes
// more) when it is full.
func (c *conn) writevWait(fd uintptr) bool {
	for len(c.bufs) > 0 && c.wleft > 0 {
		// At most what the deadline still covers: one raw call copies no more than that,
		// however large the socket's buffer.
		n, e := c.writev(fd, c.wleft)
		switch {
		case e == syscall.EINTR:
			continue // a socket with room may never report writable again
		case e == syscall.EAGAIN:
			return false
		case e != 0:
			c.we = e
			return true
		}
		consume(&c.bufs, n)
		c.wleft -= n
	}
	return true
}

// writeChunk is how much of a blocking write one deadline covers.
const writeChunk = 1 << 20

// writevOnce is the RawConn callback of a non-blocking write: one writev of c.bufs (as
// much of it as one call takes), never waiting for the socket.
func (c *conn) writevOnce(fd uintptr) bool {
	n, e := c.writev(fd, math.MaxInt)
	c.wn = n
	if e != syscall.EAGAIN && e != syscall.EINTR {
		c.we = e
	}
	return true
}

// writev makes one non-blocking writev of the head of c.bufs, at most limit bytes, and
// returns what it wrote or its error.
func (c *conn) writev(fd uintptr, limit int) (int, syscall.Errno) {
	iov := c.iov[:0]
	for _, b := range c.bufs {
		if len(iov) == maxIOV || limit <= 0 {
			break
		}
		b = b[:min(len(b), limit)]
		limit -= len(b)
		v := syscall.Iovec{Base: &b[0]}
		v.SetLen(len(b))
		iov = append(iov, v)
	}
	// Raw: non-blocking, so the runtime need not know (see soft's writeSegs).
	w, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
	clear(iov)
	c.iov = iov[:0]
	if e != 0 {
		return 0, e
	}
	return int(w), 0
}

// handOff: replies carrying this much data are written by a goroutine of their own.
const handOff = 64 << 10

// maxIOV bounds the vectors of one non-blocking write (IOV_MAX).
const maxIOV = 1024

// consume drops n written bytes from the head of b.
func consume(b *net.Buffers, n int) {
	for len(*b) > 0 && n >= len((*b)[0]) {
		n -= len((*b)[0])
		(*b)[0] = nil
		*b = (*b)[1:]
	}
	if len(*b) > 0 {
		(*b)[0] = (*b)[0][n:]
	}
}

// release ends a batch's requests and recycles their buffers.
func (c *conn) release(batch []pendingReply) {
	clear(c.iovs)
	c.iovs, c.bufs = c.iovs[:0], nil
	for i := range batch {
		c.putBuf(batch[i].data)
		c.putBuf(batch[i].payload)
		cost := batch[i].cost
		batch[i] = pendingReply{}
		c.give(cost)
		c.inflight.Done()
		c.s.inflight.Add(-1)
	}
}

// getBuf is n bytes for a request's data: from the connection's arena when it has one
// with room, else from the pools. The transmission's goroutine's.
func (c *conn) getBuf(n int) []byte {
	if n == 0 {
		return nil
	}
	if c.bufDev != nil { // once, taken or not
		c.ar.Store(c.s.newArena(c.bufDev, c.exp.Name))
		c.bufDev = nil
	}
	if ar := c.ar.Load(); ar != nil {
		if b := ar.get(n); b != nil {
			return b
		}
	}
	return getBuf(n)
}

// putBuf recycles b, into the arena it came from or the pools.
func (c *conn) putBuf(b []byte) {
	if ar := c.ar.Load(); ar == nil || !ar.put(b) {
		putBuf(b)
	}
}

// Buffers by power-of-two size class, 4 KiB to MaxRequest.
var bufPools [14]sync.Pool

func class(n int) int {
	c := 0
	for s := 4096; s < n; s <<= 1 {
		c++
	}
	return c
}

func getBuf(n int) []byte {
	if n == 0 {
		return nil
	}
	c := class(n)
	if b, ok := bufPools[c].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, 4096<<c)
}

func putBuf(b []byte) {
	if cap(b) < 4096 || cap(b)&(cap(b)-1) != 0 || cap(b) > MaxRequest {
		return
	}
	b = b[:cap(b)]
	bufPools[class(cap(b))].Put(&b)
}
