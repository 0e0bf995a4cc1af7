package nbd

// Attaching exports to the kernel's NBD driver (/dev/nbdX) through its generic netlink
// interface, as `nbd-client` and rbd-nbd do: a socketpair per connection, the transmission
// phase served on our end (the kernel starts sending requests at once, without a
// handshake), the other end handed to the kernel with NBD_CMD_CONNECT.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ServeTransmission serves a connection whose handshake is done elsewhere, or that never
// has one (a socket handed to the kernel's NBD driver), for export e: requests are read
// and answered until the client sends DISC, the connection fails or the server closes.
// It closes nc before it returns; nil means the connection ended normally. Its requests'
// data counts against the connection's bound but not the server's (MaxMemory): the kernel's
// own queue bounds what it sends, and its IO must not wait for socket clients.
func (s *Server) ServeTransmission(nc net.Conn, e Export) error {
	s.mu.Lock()
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		nc.Close()
		return net.ErrClosed
	}
	s.conns[nc] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
		nc.Close()
		s.wg.Done()
	}()
	c := s.newConn(nc)
	c.use(e, true) // the kernel was told the block size at the attach
	c.kernel = true
	err := c.transmit()
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || s.ctx.Err() != nil {
		return nil
	}
	return err
}

// TransmissionFlags are the NBD transmission flags the server announces for e.
func TransmissionFlags(e Export) uint16 { return (&conn{exp: e}).tflags() }

// AttachOptions configure Attach.
type AttachOptions struct {
	// Index asks for /dev/nbd<Index>; negative: any free device.
	Index int
	// Conns is the number of sockets, each a hardware queue of the kernel's device
	// (default: the CPUs, at most 4; at most 64).
	Conns int
	// Timeout is the kernel's request timeout (NBD_ATTR_TIMEOUT, whole seconds, rounded
	// up). A request the server takes longer to answer makes the kernel shut its socket
	// down and send it again on another; with no socket left, IO fails. 0 sends none, and
	// the kernel's default of 30 s applies.
	Timeout time.Duration
	// Backend names the attachment in /sys/block/nbdX/backend (NBD_ATTR_BACKEND_IDENTIFIER);
	// Detach disconnects the device only while it shows this name. Default: the process id,
	// the export name and a number unique in the process.
	Backend string
	// ClientFlags go to NBD_ATTR_CLIENT_FLAGS as they are (CFlag*; default none).
	ClientFlags uint64
	// NetlinkTimeout bounds each netlink exchange (default 10 s).
	NetlinkTimeout time.Duration
}

// Attachment is an export attached to a kernel NBD device.
type Attachment struct {
	s       *Server
	exp     Export
	index   int
	backend string
	nlTO    time.Duration
	conns   []net.Conn
	live    atomic.Int32
	done    chan struct{} // closed when the last connection ended

	mu       sync.Mutex
	detached bool
}

// Test hooks: the kernel's NBD family, and where its devices show.
var (
	openKernel = func(ctx context.Context, timeout time.Duration) (*kernelNBD, error) {
		return openKernelNBD(ctx, timeout)
	}
	sysBlock = "/sys/block"
	devDir   = "/dev"
)

var attachSeq atomic.Uint64

// detachWait bounds how long Detach waits for the requests in flight after the disconnect.
const detachWait = time.Minute

// maxIndex is the largest device index the kernel could take (MINORMASK; the kernel
// checks it against its own part_shift).
const maxIndex = 1<<20 - 1

// Attach connects export e to a kernel NBD device. The kernel reads the device's size,
// block size and flags from here, so the export must have a size in whole blocks of 512
// bytes to the page size. On error nothing is left attached and every socket is closed.
func (s *Server) Attach(ctx context.Context, e Export, o AttachOptions) (*Attachment, error) {
	if e.Dev == nil {
		return nil, fmt.Errorf("nbd: export %q has no device: %w", e.Name, syscall.EINVAL)
	}
	size, bs := e.Dev.Size(), e.Dev.BlockSize()
	if bs < 512 || bs > os.Getpagesize() || bits.OnesCount(uint(bs)) != 1 {
		return nil, fmt.Errorf("nbd: %q has %d-byte blocks; the kernel's NBD takes 512 to %d: %w", e.Name, bs, os.Getpagesize(), syscall.EINVAL)
	}
	if size <= 0 || size%int64(bs) != 0 {
		return nil, fmt.Errorf("nbd: %q is %d bytes, not whole %d-byte blocks: %w", e.Name, size, bs, syscall.EINVAL)
	}
	if o.Index > maxIndex {
		return nil, fmt.Errorf("nbd: index %d: %w", o.Index, syscall.EINVAL)
	}
	n := o.Conns
	if n <= 0 {
		n = min(runtime.NumCPU(), 4)
	}
	n = min(n, 64)
	if o.NetlinkTimeout <= 0 {
		o.NetlinkTimeout = 10 * time.Second
	}
	if o.Backend == "" {
		o.Backend = fmt.Sprintf("pid %d export %s #%d", os.Getpid(), e.Name, attachSeq.Add(1))
	}
	if s.ctx.Err() != nil {
		return nil, fmt.Errorf("nbd: server closed: %w", syscall.ESHUTDOWN)
	}
	k, err := openKernel(ctx, o.NetlinkTimeout)
	if err != nil {
		return nil, err
	}
	defer k.Close()

	a := &Attachment{s: s, exp: e, index: -1, backend: o.Backend, nlTO: o.NetlinkTimeout, done: make(chan struct{})}
	var kfds []int
	closeKernelEnds := func() {
		for _, fd := range kfds {
			unix.Close(fd)
		}
		kfds = nil
	}
	for range n {
		nc, kfd, err := socketPair()
		if err != nil {
			closeKernelEnds()
			for _, c := range a.conns {
				c.Close()
			}
			return nil, err
		}
		a.conns = append(a.conns, nc)
		kfds = append(kfds, kfd)
	}
	// Served before the kernel has them: it may send requests while CONNECT runs.
	a.live.Store(int32(len(a.conns)))
	for _, nc := range a.conns {
		go a.serve(nc)
	}
	tv := uint64(0)
	if o.Timeout > 0 {
		tv = uint64((o.Timeout + time.Second - 1) / time.Second)
	}
	idx, err := k.connect(ctx, connectReq{index: o.Index, size: uint64(size), blockSize: uint64(bs), timeout: tv,
		serverFlags: uint64(TransmissionFlags(e)), clientFlags: o.ClientFlags, fds: kfds, backend: o.Backend})
	// The kernel holds its own references to the sockets it took.
	closeKernelEnds()
	if err != nil {
		for _, c := range a.conns {
			c.Close()
		}
		// An answer that did not come (or made no sense) leaves the kernel's state unknown:
		// a device that shows our backend name is ours to disconnect.
		var en syscall.Errno
		if !errors.As(err, &en) || en == syscall.ETIMEDOUT || en == syscall.EBADMSG {
			for _, i := range findBackend(o.Backend) {
				_ = k.disconnect(context.WithoutCancel(ctx), i)
			}
		}
		where := "any free device"
		if o.Index >= 0 {
			where = fmt.Sprintf("/dev/nbd%d", o.Index)
		}
		return nil, fmt.Errorf("nbd: NBD_CMD_CONNECT of %q to %s: %w", e.Name, where, err)
	}
	a.index = idx
	s.log.Debugf("%q attached to /dev/nbd%d with %d connections", e.Name, idx, len(a.conns))
	return a, nil
}

// socketPair returns our end as a net.Conn and the kernel's end as a descriptor.
func socketPair() (net.Conn, int, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, -1, os.NewSyscallError("socketpair", err)
	}
	f := os.NewFile(uintptr(fds[0]), "nbd")
	nc, err := net.FileConn(f) // a duplicate of fds[0]
	f.Close()
	if err != nil {
		unix.Close(fds[1])
		return nil, -1, err
	}
	return nc, fds[1], nil
}

func (a *Attachment) serve(nc net.Conn) {
	if err := a.s.ServeTransmission(nc, a.exp); err != nil {
		a.s.log.Debugf("kernel connection of %q ends: %v", a.exp.Name, err)
	}
	if a.live.Add(-1) == 0 {
		close(a.done)
	}
}

// Index is the kernel's device index: /dev/nbd<Index>.
func (a *Attachment) Index() int { return a.index }

// Device is the device node's path.
func (a *Attachment) Device() string { return filepath.Join(devDir, "nbd"+strconv.Itoa(a.index)) }

// Backend is the name the kernel shows in /sys/block/nbdX/backend.
func (a *Attachment) Backend() string { return a.backend }

// Export is the export attached.
func (a *Attachment) Export() Export { return a.exp }

// Conns is the number of connections still served (the kernel shuts one down when a
// request on it times out).
func (a *Attachment) Conns() int { return int(a.live.Load()) }

// Done is closed when the kernel has none of the connections left: after Detach, or when
// it dropped them (timeouts, or a disconnect from outside).
func (a *Attachment) Done() <-chan struct{} { return a.done }

// Busy says whether the device is claimed exclusively (a mounted file system, a device
// mapper or md member): opening it with O_EXCL fails with EBUSY. Without a device node
// it says false.
func (a *Attachment) Busy() bool {
	fd, err := unix.Open(a.Device(), unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err == nil {
		unix.Close(fd)
	}
	return err == unix.EBUSY
}

// owned says whether the kernel's device is still this attachment's: its backend name
// is ours (kernels without the backend file: its pid file names one of our threads).
func (a *Attachment) owned() bool {
	dir := filepath.Join(sysBlock, "nbd"+strconv.Itoa(a.index))
	if b, err := os.ReadFile(filepath.Join(dir, "backend")); err == nil {
		return strings.TrimRight(string(b), "\n") == a.backend
	}
	b, err := os.ReadFile(filepath.Join(dir, "pid"))
	if err != nil {
		return false // not connected
	}
	_, err = os.Stat(filepath.Join("/proc/self/task", strings.TrimSpace(string(b))))
	return err == nil
}

// Detach disconnects the kernel's device (NBD_CMD_DISCONNECT: the kernel sends DISC on
// every connection, shuts them down and fails the requests it still had), unless it is no
// longer this attachment's; waits, up to ctx, for the requests in flight to be answered;
// and closes the connections. A second Detach does nothing.
func (a *Attachment) Detach(ctx context.Context) error {
	a.mu.Lock()
	if a.detached {
		a.mu.Unlock()
		return nil
	}
	a.detached = true
	a.mu.Unlock()
	if !a.owned() {
		for _, c := range a.conns {
			c.Close()
		}
		return nil
	}
	k, err := openKernel(ctx, a.nlTO)
	if err == nil {
		err = k.disconnect(ctx, a.index)
		k.Close()
	}
	if err != nil {
		err = fmt.Errorf("nbd: NBD_CMD_DISCONNECT of /dev/nbd%d: %w", a.index, err)
	} else {
		// The kernel has shut its ends down; ours answer what is in flight and end.
		t := time.NewTimer(detachWait)
		select {
		case <-a.done:
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	for _, c := range a.conns {
		c.Close()
	}
	return err
}

// Resize gives the kernel's device size bytes (NBD_CMD_RECONFIGURE): the export's device
// has been resized, and the kernel would otherwise keep the size it was told at Attach.
// size must be whole blocks of the export's block size.
func (a *Attachment) Resize(ctx context.Context, size int64) error {
	bs := int64(a.exp.Dev.BlockSize())
	if size <= 0 || size%bs != 0 {
		return fmt.Errorf("nbd: resize /dev/nbd%d to %d bytes: not whole %d-byte blocks: %w", a.index, size, bs, syscall.EINVAL)
	}
	a.mu.Lock()
	detached := a.detached
	a.mu.Unlock()
	if detached || !a.owned() {
		return fmt.Errorf("nbd: resize /dev/nbd%d: detached: %w", a.index, syscall.ENODEV)
	}
	k, err := openKernel(ctx, a.nlTO)
	if err != nil {
		return err
	}
	defer k.Close()
	if err := k.resize(ctx, a.index, uint64(size), a.backend); err != nil {
		return fmt.Errorf("nbd: NBD_CMD_RECONFIGURE of /dev/nbd%d to %d bytes: %w", a.index, size, err)
	}
	return nil
}

// findBackend lists the NBD devices whose backend name is b.
func findBackend(b string) []int {
	ms, _ := filepath.Glob(filepath.Join(sysBlock, "nbd*", "backend"))
	var out []int
	for _, m := range ms {
		got, err := os.ReadFile(m)
		if err != nil || strings.TrimRight(string(got), "\n") != b {
			continue
		}
		if i, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(filepath.Dir(m)), "nbd")); err == nil {
			out = append(out, i)
		}
	}
	return out
}

// KernelStatus lists the kernel's NBD devices (NBD_CMD_STATUS), or only /dev/nbd<index>
// when index >= 0.
func KernelStatus(ctx context.Context, index int) ([]DeviceStatus, error) {
	k, err := openKernel(ctx, 10*time.Second)
	if err != nil {
		return nil, err
	}
	defer k.Close()
	return k.status(ctx, index)
}

// DisconnectStale disconnects the kernel's NBD devices whose backend name stale accepts
// (those a process that died left connected: the kernel keeps a device configured, its
// sockets dead, until someone disconnects it). It returns the indexes disconnected; with
// no NBD device in sysfs it does nothing at all.
func DisconnectStale(ctx context.Context, stale func(backend string) bool) ([]int, error) {
	ms, _ := filepath.Glob(filepath.Join(sysBlock, "nbd*", "backend"))
	var idx []int
	for _, m := range ms {
		b, err := os.ReadFile(m)
		if err != nil || !stale(strings.TrimRight(string(b), "\n")) {
			continue
		}
		if i, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(filepath.Dir(m)), "nbd")); err == nil {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return nil, nil
	}
	k, err := openKernel(ctx, 10*time.Second)
	if err != nil {
		return nil, err
	}
	defer k.Close()
	var done []int
	var errs []error
	for _, i := range idx {
		if err := k.disconnect(ctx, i); err != nil {
			errs = append(errs, fmt.Errorf("nbd: NBD_CMD_DISCONNECT of /dev/nbd%d: %w", i, err))
			continue
		}
		done = append(done, i)
	}
	return done, errors.Join(errs...)
}
