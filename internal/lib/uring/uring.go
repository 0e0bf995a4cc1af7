// Package uring is the small io_uring layer ublk needs, on golang.org/x/sys/unix and no cgo:
// a ring set up and mapped, submission entries (64 or 128 bytes) filled in place, one
// io_uring_enter that submits and waits with a deadline, and the completions read back.
//
// A Ring is not safe for concurrent use: one goroutine owns it. ublk further wants every
// command of a queue issued by one thread, so its queue loops lock their OS thread.
package uring

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SetupSQE128 is io_uring_setup(2)'s IORING_SETUP_SQE128: 128-byte entries, with 80 bytes
// of command (ublk's control commands need 32).
const SetupSQE128 = 1 << 10

// Setup flags for a ring that one thread alone submits to and waits on (ublk's queue loops,
// each on a locked thread); a ring with SetupSingleIssuer refuses another thread's submits
// (EEXIST).
const (
	// SetupCoopTaskrun (IORING_SETUP_COOP_TASKRUN, 5.19): the kernel does not interrupt the
	// thread to run a completion's work; the thread runs it when it next enters the ring.
	SetupCoopTaskrun = 1 << 8
	// SetupSingleIssuer (IORING_SETUP_SINGLE_ISSUER, 6.0): only the thread that set the ring
	// up submits to it.
	SetupSingleIssuer = 1 << 12
	// SetupDeferTaskrun (IORING_SETUP_DEFER_TASKRUN, 6.1; needs SetupSingleIssuer): a
	// completion's work waits until the thread enters to get events, which Submit then
	// always asks for.
	SetupDeferTaskrun = 1 << 13
)

// Opcodes this package's users issue.
const (
	OpNop         = 0  // IORING_OP_NOP
	OpAsyncCancel = 14 // IORING_OP_ASYNC_CANCEL: Addr is the user data of the entry to cancel
	OpRead        = 22 // IORING_OP_READ
	OpWrite       = 23 // IORING_OP_WRITE
	OpURingCmd    = 46 // IORING_OP_URING_CMD
)

const (
	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000

	enterGetEvents = 1 << 0
	enterExtArg    = 1 << 3

	featSingleMmap = 1 << 0
	featExtArg     = 1 << 8

	sqeSize = 64
	cqeSize = 16
)

// params is struct io_uring_params (120 bytes).
type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFd uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

// getEventsArg is struct io_uring_getevents_arg, for IORING_ENTER_EXT_ARG.
type getEventsArg struct {
	sigmask   uint64
	sigmaskSz uint32
	pad       uint32
	ts        uint64
}

// SQE is a submission queue entry's first 64 bytes (struct io_uring_sqe). For
// IORING_OP_URING_CMD, the low half of Off is cmd_op and the command starts at Addr3: use
// Ring.Cmd for its bytes.
type SQE struct {
	Opcode      uint8
	Flags       uint8
	IOPrio      uint16
	Fd          int32
	Off         uint64
	Addr        uint64
	Len         uint32
	OpFlags     uint32
	UserData    uint64
	BufIndex    uint16
	Personality uint16
	SpliceFdIn  int32
	Addr3       uint64
	_           uint64
}

// CQE is a completion (struct io_uring_cqe).
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// Ring is one io_uring instance.
type Ring struct {
	fd      int
	setup   uint32  // the Setup flags
	sqeLen  uintptr // 64 or 128
	ringMem []byte  // SQ and CQ rings (one mapping: IORING_FEAT_SINGLE_MMAP)
	sqeMem  []byte

	sqHead, sqTail, sqArray *uint32
	sqMask, sqEntries       uint32
	cqHead, cqTail          *uint32
	cqMask                  uint32
	cqes                    unsafe.Pointer

	tail    uint32 // next entry to hand out
	flushed uint32 // entries made visible to the kernel (sqTail)

	// The wait's deadline, in the heap: the kernel reads it through a pointer the
	// compiler cannot see, and a goroutine's stack may move.
	ts unix.Timespec
	ea getEventsArg
}

// New sets up a ring of at least entries submission entries with the given Setup flags.
func New(entries uint32, flags uint32) (*Ring, error) {
	var p params
	p.flags = flags
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup(%d, %#x): %w", entries, flags, errno)
	}
	r := &Ring{fd: int(fd), sqeLen: sqeSize, setup: flags}
	if flags&SetupSQE128 != 0 {
		r.sqeLen = 2 * sqeSize
	}
	if err := r.mmap(&p); err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

func (r *Ring) mmap(p *params) error {
	if p.features&featSingleMmap == 0 || p.features&featExtArg == 0 {
		return fmt.Errorf("io_uring without SINGLE_MMAP and EXT_ARG (features %#x): kernel too old: %w", p.features, syscall.ENOSYS)
	}
	sqLen := uintptr(p.sqOff.array) + uintptr(p.sqEntries)*4
	cqLen := uintptr(p.cqOff.cqes) + uintptr(p.cqEntries)*cqeSize
	ringLen := max(sqLen, cqLen)
	var err error
	r.ringMem, err = unix.Mmap(r.fd, offSQRing, int(ringLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("mmap io_uring rings: %w", err)
	}
	r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(uintptr(p.sqEntries)*r.sqeLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("mmap io_uring entries: %w", err)
	}
	base := unsafe.Pointer(&r.ringMem[0])
	u32 := func(off uint32) *uint32 { return (*uint32)(unsafe.Add(base, off)) }
	r.sqHead, r.sqTail, r.sqArray = u32(p.sqOff.head), u32(p.sqOff.tail), u32(p.sqOff.array)
	r.sqMask, r.sqEntries = *u32(p.sqOff.ringMask), *u32(p.sqOff.ringEntries)
	r.cqHead, r.cqTail = u32(p.cqOff.head), u32(p.cqOff.tail)
	r.cqMask = *u32(p.cqOff.ringMask)
	r.cqes = unsafe.Add(base, p.cqOff.cqes)
	// Entries are used in ring order, so the indirection array is the identity.
	for i := uint32(0); i < r.sqEntries; i++ {
		*(*uint32)(unsafe.Add(unsafe.Pointer(r.sqArray), 4*i)) = i
	}
	r.tail = atomic.LoadUint32(r.sqTail)
	r.flushed = r.tail
	return nil
}

// Close unmaps the ring and closes it; the kernel cancels what is still in flight.
func (r *Ring) Close() error {
	if r.sqeMem != nil {
		_ = unix.Munmap(r.sqeMem)
		r.sqeMem = nil
	}
	if r.ringMem != nil {
		_ = unix.Munmap(r.ringMem)
		r.ringMem = nil
	}
	if r.fd < 0 {
		return nil
	}
	err := unix.Close(r.fd)
	r.fd = -1
	return err
}

// Fd is the ring's file descriptor.
func (r *Ring) Fd() int { return r.fd }

// Entries is the size of the submission queue.
func (r *Ring) Entries() uint32 { return r.sqEntries }

// Free is how many submission entries GetSQE can still hand out before a Submit.
func (r *Ring) Free() uint32 { return r.sqEntries - (r.tail - atomic.LoadUint32(r.sqHead)) }

// Unsubmitted is how many entries got since New are not yet taken by the kernel.
func (r *Ring) Unsubmitted() uint32 { return r.tail - r.flushed }

// GetSQE hands out the next submission entry, zeroed (its whole 64 or 128 bytes), or nil
// when the queue is full.
func (r *Ring) GetSQE() *SQE {
	if r.Free() == 0 {
		return nil
	}
	p := unsafe.Add(unsafe.Pointer(&r.sqeMem[0]), uintptr(r.tail&r.sqMask)*r.sqeLen)
	clear(unsafe.Slice((*byte)(p), r.sqeLen))
	r.tail++
	return (*SQE)(p)
}

// Cmd is the command area of a URING_CMD entry from GetSQE: 16 bytes, or 80 with SQE128.
func (r *Ring) Cmd(s *SQE) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&s.Addr3)), r.sqeLen-48)
}

// Submit makes the entries got since the last Submit visible to the kernel and enters it:
// it submits them and, if wait > 0, waits until wait completions are there or timeout
// passes (timeout <= 0: no limit). It returns how many entries the kernel took. It may
// return sooner (a timeout is not an error, and a call that submitted returns whether its
// wait was cut short or not), so callers look at the completions and call again.
func (r *Ring) Submit(wait uint32, timeout time.Duration) (int, error) {
	atomic.StoreUint32(r.sqTail, r.tail)
	var flags uintptr
	if wait > 0 || r.setup&SetupDeferTaskrun != 0 {
		flags |= enterGetEvents
	}
	var arg unsafe.Pointer
	var argSz uintptr
	deadline := time.Now().Add(timeout)
	if wait > 0 && timeout > 0 {
		r.ts = unix.NsecToTimespec(timeout.Nanoseconds())
		r.ea = getEventsArg{ts: uint64(uintptr(unsafe.Pointer(&r.ts)))}
		arg, argSz, flags = unsafe.Pointer(&r.ea), unsafe.Sizeof(r.ea), flags|enterExtArg
	}
	for {
		// The kernel reports an error only when it submitted nothing: a wait cut short
		// after a submission still returns the count.
		n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.tail-r.flushed), uintptr(wait), flags, uintptr(arg), argSz)
		switch errno {
		case 0:
			r.flushed += uint32(n)
			return int(n), nil
		case unix.ETIME:
			return 0, nil
		case unix.EINTR: // the Go runtime's preemption signals: wait for what is left
			if timeout > 0 {
				left := time.Until(deadline)
				if left <= 0 {
					return 0, nil
				}
				r.ts = unix.NsecToTimespec(left.Nanoseconds())
			}
		default:
			return 0, fmt.Errorf("io_uring_enter: %w", errno)
		}
	}
}

// Completions calls fn for each completion there is, in order, and consumes them; it
// returns how many there were.
func (r *Ring) Completions(fn func(CQE)) int {
	head := atomic.LoadUint32(r.cqHead)
	tail := atomic.LoadUint32(r.cqTail)
	n := 0
	for ; head != tail; head++ {
		c := *(*CQE)(unsafe.Add(r.cqes, uintptr(head&r.cqMask)*cqeSize))
		fn(c)
		n++
	}
	atomic.StoreUint32(r.cqHead, head)
	return n
}

// Errno turns a completion's negative result into its errno (nil for res >= 0).
func Errno(res int32) error {
	if res >= 0 {
		return nil
	}
	return syscall.Errno(-res)
}
