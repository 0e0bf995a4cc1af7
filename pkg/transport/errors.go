package transport

import (
	"fmt"
	"syscall"
)

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
