package soft

import (
	"errors"
	"io"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// frameReader reads a QP's socket. Headers and small payloads come through its buffer, so
// that one read takes a burst of small frames. The tail of a large payload is read straight
// into its destination with a readv whose second vector takes at most spillMax bytes of what
// follows (the next frame's header) into the buffer: a buffered reader would instead pull the
// next 64 KiB of payload into its buffer and copy it a second time in user space, which was a
// tenth of the client's CPU at 1 MiB IOs.
type frameReader struct {
	conn net.Conn
	raw  syscall.RawConn // nil when conn is no socket (tests' pipes): plain reads
	buf  []byte
	r, w int

	// State of the readv run by readFn, kept here so that the closure is allocated once.
	vecs   [2][]byte
	nvecs  int
	n      int
	rerr   error
	readFn func(fd uintptr) bool
}

const (
	// directMin is the smallest remainder of a payload read straight into its destination.
	directMin = 16 << 10
	// spillMax bounds what a direct read takes beyond the payload: a header and a small
	// message, little enough to copy again.
	spillMax = 1 << 10
)

func newFrameReader(conn net.Conn, size int) *frameReader {
	f := &frameReader{conn: conn, buf: make([]byte, max(size, 2*spillMax))}
	if sc, ok := conn.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			f.raw = raw
		}
	}
	f.readFn = func(fd uintptr) bool {
		for {
			f.n, f.rerr = unix.Readv(int(fd), f.vecs[:f.nvecs])
			if f.rerr != unix.EINTR {
				break
			}
		}
		return !errors.Is(f.rerr, unix.EAGAIN)
	}
	return f
}

// Buffered is how many bytes a read returns without touching the socket.
func (f *frameReader) Buffered() int { return f.w - f.r }

// Read implements io.Reader (handshake messages, discarding after a failure).
func (f *frameReader) Read(p []byte) (int, error) {
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
func (f *frameReader) ReadFull(p []byte) error {
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
	for len(p) > 0 {
		// The buffer is empty here.
		if len(p) < directMin {
			if err := f.fill(); err != nil {
				return unexpected(err)
			}
			n := copy(p, f.buf[f.r:f.w])
			f.r += n
			p = p[n:]
			continue
		}
		f.r, f.w = 0, 0
		n, err := f.readv(p, f.buf[:spillMax])
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
func (f *frameReader) fill() error {
	f.r, f.w = 0, 0
	n, err := f.readv(f.buf, nil)
	f.w = n
	if n > 0 {
		return nil
	}
	return err
}

// readv reads into a and then b (a alone without a socket), returning how many bytes arrived (at least one, or an error).
func (f *frameReader) readv(a, b []byte) (int, error) {
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
