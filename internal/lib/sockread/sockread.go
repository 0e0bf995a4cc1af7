// Package sockread reads framed streams from sockets: small messages through a buffer, large
// payloads straight into their destination.
package sockread

import (
	"errors"
	"io"
	"net"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/racebuf"
)

// Reader reads a stream of headers and payloads. Headers and small payloads come through its
// buffer, so that one read takes a burst of small messages. The tail of a large payload is
// read straight into its destination with a readv whose second vector takes at most SpillMax
// bytes of what follows (the next header) into the buffer: a bufio.Reader would instead pull
// the next 64 KiB of payload into its buffer and copy it a second time in user space, which
// was a tenth of the RTRS client's CPU at 1 MiB IOs.
type Reader struct {
	conn net.Conn
	raw  syscall.RawConn // nil when conn is no socket (tests' pipes): plain reads
	buf  []byte
	r, w int

	// State of the readv run by readFn, kept here so that the closure is allocated once.
	vecs   [2][]byte
	nvecs  int
	iov    [2]unix.Iovec
	msg    unix.Msghdr
	n      int
	rerr   error
	wait   bool // readFn waits for data (a read), or returns at once (FillNow)
	readFn func(fd uintptr) bool
}

const (
	// DirectMin is the smallest remainder of a payload read straight into its destination.
	DirectMin = 16 << 10
	// SpillMax bounds what a direct read takes beyond the payload: a header and a small
	// message, little enough to copy again.
	SpillMax = 1 << 10
)

// New returns a Reader of conn with a buffer of size bytes.
func New(conn net.Conn, size int) *Reader {
	f := &Reader{conn: conn, buf: make([]byte, max(size, 2*SpillMax)), wait: true}
	if sc, ok := conn.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil && isSocket(raw) {
			f.raw = raw
		}
	}
	f.readFn = func(fd uintptr) bool {
		for {
			f.n, f.rerr = f.rawRecv(fd)
			if f.rerr != unix.EINTR {
				break
			}
		}
		return !f.wait || !errors.Is(f.rerr, unix.EAGAIN)
	}
	return f
}

// isSocket says whether raw's descriptor is a socket, which rawRecv needs.
func isSocket(raw syscall.RawConn) bool {
	ok := false
	if err := raw.Control(func(fd uintptr) {
		_, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE)
		ok = err == nil
	}); err != nil {
		return false
	}
	return ok
}

// rawRecv reads into f.vecs by recvmsg(2) with MSG_DONTWAIT, without the runtime's system
// call bookkeeping. It never blocks, whatever the descriptor's O_NONBLOCK (a flag of the open
// file, which a dup's Fd() elsewhere could clear): the runtime's poller does the waiting.
// Entered as a system call, a read would, in a process that has nothing else to run, wake the
// runtime's monitor thread (sysmon) from its sleep and keep it ticking for a while: on every
// message, a thread woken on another CPU for nothing (the soft provider's writes are raw for
// the same reason).
func (f *Reader) rawRecv(fd uintptr) (int, error) {
	k := 0
	for _, v := range f.vecs[:f.nvecs] {
		if len(v) > 0 {
			f.iov[k].Base = &v[0]
			f.iov[k].SetLen(len(v))
			k++
		}
	}
	if k == 0 {
		return 0, nil
	}
	f.msg.Iov = &f.iov[0]
	f.msg.SetIovlen(k)
	r, _, e := unix.RawSyscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&f.msg)), unix.MSG_DONTWAIT)
	f.iov, f.msg = [2]unix.Iovec{}, unix.Msghdr{} // hold no buffer past the call
	if e != 0 {
		return -1, e
	}
	for i, left := 0, int(r); i < f.nvecs && left > 0; i++ {
		k := min(left, len(f.vecs[i]))
		racebuf.Written(f.vecs[i][:k])
		left -= k
	}
	return int(r), nil
}

// FillNow adds to the buffer what the socket holds, without waiting, and returns how many
// bytes that was; errors are left to the next read. A caller that holds work back while more
// is buffered (a plug) can look for more before letting it go.
func (f *Reader) FillNow() int {
	if f.raw == nil {
		return 0
	}
	if f.r == f.w {
		f.r, f.w = 0, 0
	} else if f.r > 0 && len(f.buf)-f.w < SpillMax {
		f.w = copy(f.buf, f.buf[f.r:f.w])
		f.r = 0
	}
	if f.w == len(f.buf) {
		return 0
	}
	f.vecs[0], f.nvecs, f.wait = f.buf[f.w:], 1, false
	f.n, f.rerr = 0, nil
	err := f.raw.Read(f.readFn)
	f.vecs[0], f.wait = nil, true
	if err != nil || f.rerr != nil || f.n <= 0 {
		return 0
	}
	f.w += f.n
	return f.n
}

// Buffered is how many bytes a read returns without touching the socket.
func (f *Reader) Buffered() int { return f.w - f.r }

// Read implements io.Reader (handshake messages, discarding after a failure).
func (f *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if f.r == f.w {
		if err := f.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, f.buf[f.r:f.w])
	f.r += n
	return n, nil
}

// ReadFull reads exactly len(p) bytes, as io.ReadFull: io.EOF if the stream ended before
// them, io.ErrUnexpectedEOF if inside them.
func (f *Reader) ReadFull(p []byte) error {
	want := len(p)
	unexpected := func(err error) error {
		if err == io.EOF && len(p) < want {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	n := copy(p, f.buf[f.r:f.w])
	f.r += n
	p = p[n:]
	// A large remainder is read directly to its end, also when a short read leaves little of
	// it: reading that little through the buffer would fill the buffer with what follows.
	direct := len(p) >= DirectMin
	for len(p) > 0 {
		// The buffer is empty here.
		if !direct {
			if err := f.fill(); err != nil {
				return unexpected(err)
			}
			n := copy(p, f.buf[f.r:f.w])
			f.r += n
			p = p[n:]
			continue
		}
		f.r, f.w = 0, 0
		n, err := f.readv(p, f.buf[:SpillMax])
		if n > len(p) {
			f.w = n - len(p)
			n = len(p)
		}
		p = p[n:]
		if err != nil && len(p) > 0 {
			return unexpected(err)
		}
	}
	return nil
}

// fill reads into the empty buffer.
func (f *Reader) fill() error {
	f.r, f.w = 0, 0
	n, err := f.readv(f.buf, nil)
	f.w = n
	if n > 0 {
		return nil
	}
	return err
}

// readv reads into a and then b (a alone without a socket), returning how many bytes arrived (at least one, or an error).
func (f *Reader) readv(a, b []byte) (int, error) {
	if f.raw == nil {
		n, err := f.conn.Read(a)
		if n == 0 && err == nil {
			err = io.ErrNoProgress
		}
		return n, err
	}
	f.vecs[0], f.vecs[1], f.nvecs = a, b, 1
	if len(b) > 0 {
		f.nvecs = 2
	}
	f.n, f.rerr = 0, nil
	err := f.raw.Read(f.readFn)
	f.vecs = [2][]byte{}
	if err == nil {
		err = f.rerr
	}
	n := max(f.n, 0)
	if n > 0 {
		return n, nil
	}
	if err == nil {
		err = io.EOF
	}
	return 0, err
}
