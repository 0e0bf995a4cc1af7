package transport

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Timings are the protocol's timers. Zero fields take the kernel's values.
type Timings struct {
	HeartbeatInterval time.Duration // RTRS_HB_INTERVAL_MS, 5 s
	HeartbeatMissed   int           // RTRS_HB_MISSED_MAX, 5
	ConnectTimeout    time.Duration // RTRS_CONNECT_TIMEOUT_MS, 30 s
	ReconnectDelay    time.Duration // reconnect_delay_sec as RNBD passes it, 30 s
	ReconnectBackoff  time.Duration // RTRS_RECONNECT_BACKOFF, 1 s
	ZombieTimeout     time.Duration // RTRS_MAX_CONN_TIMEOUT, 30 s
}

func (t Timings) withDefaults() Timings {
	if t.HeartbeatInterval <= 0 {
		t.HeartbeatInterval = 5 * time.Second
	}
	if t.HeartbeatMissed <= 0 {
		t.HeartbeatMissed = 5
	}
	if t.ConnectTimeout <= 0 {
		t.ConnectTimeout = 30 * time.Second
	}
	if t.ReconnectDelay <= 0 {
		t.ReconnectDelay = 30 * time.Second
	}
	if t.ReconnectBackoff < 0 {
		t.ReconnectBackoff = 0
	} else if t.ReconnectBackoff == 0 {
		t.ReconnectBackoff = time.Second
	}
	if t.ZombieTimeout <= 0 {
		t.ZombieTimeout = 30 * time.Second
	}
	return t
}

// Dir is the direction of a request.
type Dir int

// Directions.
const (
	Read Dir = iota
	Write
)

func (d Dir) String() string {
	if d == Read {
		return "READ"
	}
	return "WRITE"
}

// Errors the transport returns. They wrap the errno the kernel returns in the same case.
var (
	ErrNoPath    = fmt.Errorf("rtrs: no connected path took the request: %w", syscall.ECONNABORTED)
	ErrMsgSize   = fmt.Errorf("rtrs: request too large: %w", syscall.EMSGSIZE)
	ErrClosed    = fmt.Errorf("rtrs: session closed: %w", syscall.ESHUTDOWN)
	ErrNoPermit  = fmt.Errorf("rtrs: no permit free: %w", syscall.EAGAIN)
	ErrBusy      = fmt.Errorf("rtrs: path busy: %w", syscall.EBUSY)
	ErrNotConn   = fmt.Errorf("rtrs: path not connected: %w", syscall.ENOTCONN)
	ErrExists    = fmt.Errorf("rtrs: already exists: %w", syscall.EEXIST)
	ErrInvalName = fmt.Errorf("rtrs: invalid session name: %w", syscall.EINVAL)
)

// Errno returns the negative errno a request error stands for, as the kernel passes it to
// its callbacks (0 for nil).
func Errno(err error) int {
	if err == nil {
		return 0
	}
	var en syscall.Errno
	if errors.As(err, &en) {
		return -int(en)
	}
	return -int(syscall.EIO)
}

// errnoErr turns a negative errno from the wire into an error.
func errnoErr(errno int) error {
	if errno == 0 {
		return nil
	}
	if errno < 0 {
		errno = -errno
	}
	return syscall.Errno(errno)
}

// CheckText refuses what must not be in a name that reaches a config file, a tree or a log:
// invalid UTF-8, whitespace, control characters, and '#' (the config files' comment mark,
// which would cut the name short when the file is read back). The kernel takes all of them;
// its names never go through a text file.
func CheckText(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("name %q is not UTF-8: %w", s, syscall.EINVAL)
	}
	for _, r := range s {
		if r == '#' || unicode.IsSpace(r) || unicode.IsControl(r) {
			return fmt.Errorf("name %q contains %q: %w", s, r, syscall.EINVAL)
		}
	}
	return nil
}

// validName checks a session name as the kernel does (no '/' or '.', 1..254 bytes) and with
// CheckText.
func validName(name string) error {
	if name == "" || len(name) >= NameMax {
		return fmt.Errorf("%w: %d bytes", ErrInvalName, len(name))
	}
	if err := CheckText(name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalName, err)
	}
	for i := 0; i < len(name); i++ {
		if name[i] == '/' || name[i] == '.' {
			return fmt.Errorf("%w: %q contains %q", ErrInvalName, name, name[i])
		}
	}
	return nil
}

// Work request ids: kind in the top byte, an index below.
const (
	wrRecv     = 1 << 56
	wrInfo     = 2 << 56
	wrLocalInv = 3 << 56
	wrResp     = 4 << 56
	wrHB       = 5 << 56
	wrReq      = 6 << 56
	wrKindMask = 0xff << 56
)

// con is one RDMA connection of a path.
type con struct {
	cid int
	id  rdma.ConnID
	cq  rdma.CQ
	qp  rdma.QP

	// Signal one send in sigInterval so that the send queue drains on hardware, where
	// unsignaled requests free their slots only through a later signaled one.
	sigInterval int
	sends       atomic.Uint32

	// Scratch for the connection's completion handler (calls never overlap).
	recvWR [1]rdma.RecvWR
	sendWR [1]rdma.SendWR
}

// signal returns the flags for the next send on c.
func (c *con) signal() rdma.SendFlags {
	if int(c.sends.Add(1))%c.sigInterval == 0 {
		return rdma.SendSignaled
	}
	return 0
}

// drain polls c's queue empty, passing each completion to handle, and returns how many there
// were (for wc_completion).
func (c *con) drain(wc []rdma.WC, handle func(rdma.WC)) int {
	total := 0
	for n := c.cq.Poll(wc); n > 0; n = c.cq.Poll(wc) {
		total += n
		for _, w := range wc[:n] {
			handle(w)
		}
	}
	return total
}

func (c *con) destroy() {
	if c.id != nil {
		_ = c.id.Destroy()
	}
	if c.cq != nil {
		c.cq.SetHandler(nil)
		_ = c.cq.Destroy()
	}
}

// heartbeat is the per-path heartbeat state shared by client and server (spec 1.13).
type heartbeat struct {
	missed   atomic.Int32
	lastSent atomic.Int64 // unix nanos of the last HB_MSG
	latency  atomic.Int64 // last round trip, ns

	mu   sync.Mutex
	stop chan struct{}
	done chan struct{}
}

// run ticks every interval: after more than max unanswered ticks it calls onDead; otherwise
// it sends a heartbeat when the previous one was answered.
func (h *heartbeat) run(interval time.Duration, maxMissed int, send func() error, onDead func()) {
	stop, done := make(chan struct{}), make(chan struct{})
	h.mu.Lock()
	h.stop, h.done = stop, done
	h.mu.Unlock()
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			if int(h.missed.Load()) > maxMissed {
				onDead()
				return
			}
			if h.missed.Add(1) > 1 {
				continue // the previous heartbeat is not answered yet
			}
			h.lastSent.Store(time.Now().UnixNano())
			if send() != nil {
				onDead()
				return
			}
		}
	}()
}

// halt stops the heartbeat; safe to call more than once and from onDead.
func (h *heartbeat) halt() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stop == nil {
		return
	}
	select {
	case <-h.stop:
	default:
		close(h.stop)
	}
}

// wait waits for the heartbeat goroutine to end (not from onDead).
func (h *heartbeat) wait() {
	h.mu.Lock()
	d := h.done
	h.mu.Unlock()
	if d != nil {
		<-d
	}
}

// acked records an HB_ACK: the round trip becomes the path's latency.
func (h *heartbeat) acked() {
	if sent := h.lastSent.Load(); sent != 0 {
		h.latency.Store(time.Now().UnixNano() - sent)
	}
}

// hbWR is the zero-length RDMA_WRITE_WITH_IMM a heartbeat travels in.
func hbWR(imm uint32) []rdma.SendWR {
	return []rdma.SendWR{{ID: wrHB, Opcode: rdma.OpRDMAWriteWithImm, Imm: imm}}
}

// hbAck answers a heartbeat from the connection's handler without allocating.
func (c *con) hbAck() error {
	c.sendWR[0] = rdma.SendWR{ID: wrHB, Opcode: rdma.OpRDMAWriteWithImm, Imm: ImmHBAckValue}
	_, err := c.qp.PostSend(c.sendWR[:])
	return err
}

// addrOf turns a connection endpoint into an RTRS address.
func addrOf(ap netip.AddrPort) Addr { return Addr{IP: ap.Addr().Unmap()} }

// ctxTimeout bounds ctx by d.
func ctxTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}

// logger returns the base logger with fields.
func logger(f log.Fields) *log.Entry { return log.L.WithFields(f) }
