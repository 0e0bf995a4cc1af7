// Package aio is the small layer of Linux's native asynchronous IO (io_setup(2),
// io_submit(2), io_getevents(2)) that the server's direct IO needs, on golang.org/x/sys/unix
// and no cgo.
//
// Why AIO beside io_uring (see docs/design.md): a block device's O_DIRECT completion goes to
// the AIO context's ring from the device's completion context, where io_uring runs it as task
// work of the thread that submitted the request. Any goroutine can therefore submit to a
// Context, on whatever thread it runs, and another reap, with no thread of its own needed
// for either side.
package aio

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Commands (IOCB_CMD_*).
const (
	CmdPread  = 0
	CmdPwrite = 1
)

// FlagResFd (IOCB_FLAG_RESFD) in IOCB.Flags has the request's completion add one to the
// eventfd in ResFd, which Go's netpoller can wait on.
const FlagResFd = 1

// IOCB is struct iocb, 64 bytes. The kernel reads it during Submit only.
type IOCB struct {
	Data    uint64 // handed back in the Event
	_       uint32 // aio_key: the kernel's
	RWFlags uint32 // RWF_* for reads and writes
	Opcode  uint16
	_       int16 // aio_reqprio
	Fd      uint32
	Buf     uint64 // an address
	Nbytes  uint64
	Offset  int64
	_       uint64
	Flags   uint32
	ResFd   uint32
}

// Event is struct io_event, a completion: Res is the byte count or a negative errno.
type Event struct {
	Data uint64
	Obj  uint64
	Res  int64
	Res2 int64
}

// Context is an AIO context. Submit and Ready may be called from any goroutine.
type Context struct{ id uint64 }

// New sets up a context for n requests in flight at once.
func New(n int) (*Context, error) {
	c := &Context{}
	if _, _, e := unix.Syscall(unix.SYS_IO_SETUP, uintptr(n), uintptr(unsafe.Pointer(&c.id)), 0); e != 0 {
		return nil, fmt.Errorf("io_setup(%d): %w", n, e)
	}
	return c, nil
}

// Destroy tears the context down; the kernel waits for what is still in flight, so call it
// only once nothing is.
func (c *Context) Destroy() error {
	if _, _, e := unix.Syscall(unix.SYS_IO_DESTROY, uintptr(c.id), 0, 0); e != 0 {
		return fmt.Errorf("io_destroy: %w", e)
	}
	return nil
}

// Submit submits the requests in order and returns how many the kernel took. It takes the
// first ones up to the first it refuses: that refusal is the error only when it took none
// (EAGAIN: no resources, or, with RWF_NOWAIT, the request would block).
func (c *Context) Submit(cbs []*IOCB) (int, error) {
	if len(cbs) == 0 {
		return 0, nil
	}
	for {
		n, _, e := unix.Syscall(unix.SYS_IO_SUBMIT, uintptr(c.id), uintptr(len(cbs)), uintptr(unsafe.Pointer(&cbs[0])))
		switch e {
		case 0:
			return int(n), nil
		case unix.EINTR:
			continue
		default:
			return 0, fmt.Errorf("io_submit: %w", e)
		}
	}
}

// Ready moves up to len(ev) completions that are there into ev without waiting, and returns
// how many.
func (c *Context) Ready(ev []Event) (int, error) {
	var ts unix.Timespec // zero: do not wait
	for {
		n, _, e := unix.Syscall6(unix.SYS_IO_GETEVENTS, uintptr(c.id), 0, uintptr(len(ev)), uintptr(unsafe.Pointer(&ev[0])), uintptr(unsafe.Pointer(&ts)), 0)
		switch e {
		case 0:
			return int(n), nil
		case unix.EINTR:
		default:
			return 0, fmt.Errorf("io_getevents: %w", e)
		}
	}
}
