package rdma

import (
	"errors"
	"fmt"
	"syscall"
)

// Errors a provider returns. Each wraps the errno the matching libibverbs/librdmacm call would
// set, so errors.Is(err, syscall.EINVAL) holds for ErrInvalid and so on.
var (
	ErrInvalid     = fmt.Errorf("rdma: invalid argument: %w", syscall.EINVAL)
	ErrNoMem       = fmt.Errorf("rdma: queue full: %w", syscall.ENOMEM)
	ErrClosed      = fmt.Errorf("rdma: object destroyed: %w", syscall.EBADF)
	ErrTimeout     = fmt.Errorf("rdma: timed out: %w", syscall.ETIMEDOUT)
	ErrAddrError   = fmt.Errorf("rdma: address resolution failed: %w", syscall.EHOSTUNREACH)
	ErrUnreachable = fmt.Errorf("rdma: peer unreachable: %w", syscall.EHOSTUNREACH)
	ErrNoDevice    = fmt.Errorf("rdma: no such device: %w", syscall.ENODEV)
	// ErrPeerFault is why a connection a peer broke went down: an access outside its
	// rights (a key or range it does not hold) or a protocol violation. A provider that
	// can tell wraps it in its CMEvent.Err.
	ErrPeerFault = fmt.Errorf("rdma: fault of the peer: %w", syscall.EPROTO)
)

// RejectError is returned by Connect when the peer rejected the request. Consumer-defined
// rejects carry the rejecting side's private data; a request that found no listener carries
// none (IB_CM_REJ_INVALID_SERVICE_ID).
type RejectError struct {
	PrivateData []byte
	// NoListener is set when nothing listened at the destination.
	NoListener bool
}

func (e *RejectError) Error() string {
	if e.NoListener {
		return "rdma: connection rejected: no listener at destination"
	}
	return fmt.Sprintf("rdma: connection rejected by peer (%d bytes of private data)", len(e.PrivateData))
}

// Unwrap makes a reject an ECONNREFUSED for callers that only look at errnos.
func (e *RejectError) Unwrap() error { return syscall.ECONNREFUSED }

// IsReject reports whether err is a reject and returns it.
func IsReject(err error) (*RejectError, bool) {
	var r *RejectError
	ok := errors.As(err, &r)
	return r, ok
}
