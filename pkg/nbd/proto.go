// Package nbd is a small NBD server (fixed newstyle handshake, simple replies) that serves
// block devices to NBD clients: qemu, nbdcopy, nbdinfo, fio's nbd engine, the kernel's nbd.
// The protocol is the one in NBD's doc/proto.md; numbers here are that document's.
package nbd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
)

// Handshake and option-haggling constants.
const (
	nbdMagic      = 0x4e42444d41474943 // "NBDMAGIC"
	optMagic      = 0x49484156454f5054 // "IHAVEOPT"
	optReplyMagic = 0x0003e889045565a9

	flagFixedNewstyle = 1 << 0
	flagNoZeroes      = 1 << 1

	optExportName     = 1
	optAbort          = 2
	optList           = 3
	optStartTLS       = 5
	optInfo           = 6
	optGo             = 7
	optStructuredRepl = 8

	repAck         = 1
	repServer      = 2
	repInfo        = 3
	repErrUnsup    = 1<<31 + 1
	repErrTLSReqd  = 1<<31 + 5
	repErrInval    = 1<<31 + 3
	repErrUnknwn   = 1<<31 + 6
	repErrTooBig   = 1<<31 + 9
	repErrShutdown = 1<<31 + 7

	infoExport      = 0
	infoName        = 1
	infoDescription = 2
	infoBlockSize   = 3

	// maxOptLen bounds the option data the server reads; longer options up to maxOptSkip
	// are skipped and refused (NBD_REP_ERR_TOO_BIG, or ERR_UNSUP when unknown), longer
	// still end the connection.
	maxOptLen  = 64 << 10
	maxOptSkip = 16 << 20
)

// Transmission flags.
const (
	tflagHasFlags     = 1 << 0
	tflagReadOnly     = 1 << 1
	tflagSendFlush    = 1 << 2
	tflagSendFUA      = 1 << 3
	tflagSendTrim     = 1 << 5
	tflagWriteZeroes  = 1 << 6
	tflagCanMultiConn = 1 << 8
)

// Commands, command flags, and the request and reply magics.
const (
	requestMagic     = 0x25609513
	simpleReplyMagic = 0x67446698
	requestSize      = 28
	replySize        = 16

	CmdRead        = 0
	CmdWrite       = 1
	CmdDisc        = 2
	CmdFlush       = 3
	CmdTrim        = 4
	CmdCache       = 5
	CmdWriteZeroes = 6
	CmdBlockStatus = 7

	CmdFlagFUA      = 1 << 0
	CmdFlagNoHole   = 1 << 1
	CmdFlagDF       = 1 << 2
	CmdFlagFastZero = 1 << 4

	// MaxRequest is the largest READ or WRITE payload, announced as the maximum block size.
	MaxRequest = 32 << 20
)

// Request is a transmission-phase request.
type Request struct {
	Flags  uint16
	Type   uint16
	Cookie uint64
	Offset uint64
	Length uint32
}

var errBadMagic = errors.New("nbd: bad request magic")

// DecodeRequest reads a 28-byte request header; anything but the request magic is refused.
func DecodeRequest(b []byte) (Request, error) {
	if len(b) < requestSize {
		return Request{}, fmt.Errorf("nbd: %d-byte request: %w", len(b), syscall.EINVAL)
	}
	be := binary.BigEndian
	if be.Uint32(b) != requestMagic {
		return Request{}, errBadMagic
	}
	return Request{Flags: be.Uint16(b[4:]), Type: be.Uint16(b[6:]), Cookie: be.Uint64(b[8:]),
		Offset: be.Uint64(b[16:]), Length: be.Uint32(b[24:])}, nil
}

// Put encodes the request (for clients and tests).
func (r Request) Put(b []byte) {
	be := binary.BigEndian
	be.PutUint32(b, requestMagic)
	be.PutUint16(b[4:], r.Flags)
	be.PutUint16(b[6:], r.Type)
	be.PutUint64(b[8:], r.Cookie)
	be.PutUint64(b[16:], r.Offset)
	be.PutUint32(b[24:], r.Length)
}

// NBD error values (they are Linux errno numbers, but only these may go on the wire).
const (
	errPerm     = 1
	errIO       = 5
	errNoMem    = 12
	errInval    = 22
	errNoSpc    = 28
	errOverflow = 75
	errNotSup   = 95
	errShutdown = 108
)

// wireError maps an error to the NBD error the reply carries.
func wireError(err error) uint32 {
	var en syscall.Errno
	if !errors.As(err, &en) {
		return errIO
	}
	switch en {
	case syscall.EPERM, syscall.EROFS, syscall.EACCES:
		return errPerm
	case syscall.ENOMEM:
		return errNoMem
	case syscall.EINVAL:
		return errInval
	case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG:
		return errNoSpc // the spec's words for a full export, whatever the server's
	case syscall.EOPNOTSUPP:
		// The spec keeps ENOTSUP for a FAST_ZERO that would be slow and EOVERFLOW for a DF
		// read in pieces (neither offered here): a server's EOPNOTSUPP or EOVERFLOW is
		// another failure of the command. Write-zeroes' is set apart (errZeroesNotSup).
		return errInval
	case syscall.EOVERFLOW:
		return errInval
	case syscall.ESHUTDOWN:
		return errShutdown
	}
	return errIO
}
