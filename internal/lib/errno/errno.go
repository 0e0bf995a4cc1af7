// Package errno is the one mapping from our errors to the errno a kernel-facing reader sees:
// a file of our trees, an RTRS response on the wire, an NBD reply.
package errno

import (
	"context"
	"errors"
	"os"
	"syscall"
)

// Of is the errno err stands for: the errno it wraps, else ETIMEDOUT for a deadline,
// EINTR for a cancellation, ENOENT for a missing file, else EIO. 0 for nil.
func Of(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var en syscall.Errno
	if errors.As(err, &en) {
		return en
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return syscall.ETIMEDOUT
	case errors.Is(err, context.Canceled):
		return syscall.EINTR
	case errors.Is(err, os.ErrNotExist):
		return syscall.ENOENT
	}
	return syscall.EIO
}

// Neg is Of as the kernel passes it to callbacks and puts on the wire: negative, 0 for nil.
func Neg(err error) int { return -int(Of(err)) }
