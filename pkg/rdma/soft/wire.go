package soft

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Frame layout (docs/soft-rdma.md): a fixed 40-byte big-endian header, then Len bytes of
// payload for the opcodes that carry one.
//
//	0  u8  op
//	1  u8  flags
//	2  u16 reserved, zero
//	4  u32 len      payload length; for READ_REQ the length asked for (no payload follows)
//	8  u64 seq      requester's message sequence number (requests, READ_RESP, TERMINATE)
//	16 u64 ack      every request of the receiver up to ack has been executed (all data frames)
//	24 u32 imm      immediate, invalidate rkey, WC status (TERMINATE) or protocol version (CM)
//	28 u32 rkey
//	32 u64 addr     remote address; CM frames carry the magic here
const hdrLen = 40

// frameOp is a frame opcode.
type frameOp uint8

// Frame opcodes. CM frames come first on a connection, then data frames.
const (
	fConnReq   frameOp = 1 // connect request with private data
	fConnAcc   frameOp = 2 // accept with private data
	fConnRej   frameOp = 3 // reject with private data
	fConnRTU   frameOp = 4 // ready to use: the connector saw the accept
	fSend      frameOp = 10
	fSendImm   frameOp = 11
	fSendInv   frameOp = 12
	fWrite     frameOp = 13
	fWriteImm  frameOp = 14
	fReadReq   frameOp = 15
	fReadResp  frameOp = 16
	fAck       frameOp = 17 // carries only the ack field
	fTerminate frameOp = 18 // request seq failed at the responder with status imm; QP is dead
	fDisc      frameOp = 19 // orderly disconnect
)

// isRequest says whether a frame of op is a request, which carries a sequence number of
// the sender's and is acknowledged.
func (op frameOp) isRequest() bool {
	switch op {
	case fSend, fSendImm, fSendInv, fWrite, fWriteImm, fReadReq:
		return true
	}
	return false
}

// Frame flags.
const (
	flagSolicited uint8 = 1 << 0
	// flagAckReq asks the receiver to acknowledge, once it has executed everything up to this
	// frame, even if it has nothing else to send.
	flagAckReq uint8 = 1 << 1
)

// cmMagic marks CM frames ("SOFTRDMA").
const cmMagic uint64 = 0x534f465452444d41

// protoVersion is the soft-RDMA frame protocol version carried in CM frames.
const protoVersion uint32 = 1

// maxMsgSize bounds any payload length read from the wire.
const maxMsgSize = 1 << 30

var errFrame = errors.New("soft-rdma: malformed frame")

// frameHdr is a decoded header.
type frameHdr struct {
	op    frameOp
	flags uint8
	len   uint32
	seq   uint64
	ack   uint64
	imm   uint32
	rkey  uint32
	addr  uint64
}

func (h *frameHdr) encode(b []byte) {
	_ = b[hdrLen-1]
	b[0] = byte(h.op)
	b[1] = h.flags
	b[2], b[3] = 0, 0
	binary.BigEndian.PutUint32(b[4:], h.len)
	binary.BigEndian.PutUint64(b[8:], h.seq)
	binary.BigEndian.PutUint64(b[16:], h.ack)
	binary.BigEndian.PutUint32(b[24:], h.imm)
	binary.BigEndian.PutUint32(b[28:], h.rkey)
	binary.BigEndian.PutUint64(b[32:], h.addr)
}

// decodeHdr decodes and validates a header. It never trusts a length: every opcode has a
// bound on len, and fields an opcode does not use must be zero.
func decodeHdr(b []byte) (frameHdr, error) {
	if len(b) < hdrLen {
		return frameHdr{}, fmt.Errorf("%w: %d bytes, header is %d", errFrame, len(b), hdrLen)
	}
	h := frameHdr{
		op:    frameOp(b[0]),
		flags: b[1],
		len:   binary.BigEndian.Uint32(b[4:]),
		seq:   binary.BigEndian.Uint64(b[8:]),
		ack:   binary.BigEndian.Uint64(b[16:]),
		imm:   binary.BigEndian.Uint32(b[24:]),
		rkey:  binary.BigEndian.Uint32(b[28:]),
		addr:  binary.BigEndian.Uint64(b[32:]),
	}
	if b[2] != 0 || b[3] != 0 {
		return h, fmt.Errorf("%w: reserved bytes set", errFrame)
	}
	if h.flags&^(flagSolicited|flagAckReq) != 0 {
		return h, fmt.Errorf("%w: unknown flags %#x", errFrame, h.flags)
	}
	switch h.op {
	case fConnReq, fConnAcc, fConnRej:
		if h.addr != cmMagic {
			return h, fmt.Errorf("%w: bad CM magic %#x", errFrame, h.addr)
		}
		if h.len > rdma.MaxPrivateData || h.ack != 0 {
			return h, fmt.Errorf("%w: %d bytes of private data, at most %d", errFrame, h.len, rdma.MaxPrivateData)
		}
	case fConnRTU, fAck, fDisc:
		if h.len != 0 || h.seq != 0 {
			return h, fmt.Errorf("%w: %v carries %d payload bytes", errFrame, h.op, h.len)
		}
	case fSend, fSendImm, fSendInv, fWrite, fWriteImm, fReadReq, fReadResp:
		if h.len > maxMsgSize {
			return h, fmt.Errorf("%w: length %d over %d", errFrame, h.len, maxMsgSize)
		}
	case fTerminate:
		if h.len != 0 || h.imm > 0xff {
			return h, fmt.Errorf("%w: bad terminate", errFrame)
		}
	default:
		return h, fmt.Errorf("%w: unknown opcode %d", errFrame, h.op)
	}
	return h, nil
}

// payloadLen is how many payload bytes follow the header on the wire.
func (h *frameHdr) payloadLen() int {
	if h.op == fReadReq {
		return 0
	}
	return int(h.len)
}

var frameOpNames = map[frameOp]string{
	fConnReq: "CONN_REQ", fConnAcc: "CONN_ACCEPT", fConnRej: "CONN_REJECT", fConnRTU: "CONN_RTU",
	fSend: "SEND", fSendImm: "SEND_IMM", fSendInv: "SEND_INV", fWrite: "WRITE",
	fWriteImm: "WRITE_IMM", fReadReq: "READ_REQ", fReadResp: "READ_RESP", fAck: "ACK",
	fTerminate: "TERMINATE", fDisc: "DISCONNECT",
}

func (o frameOp) String() string {
	if n, ok := frameOpNames[o]; ok {
		return n
	}
	return fmt.Sprintf("frameOp(%d)", uint8(o))
}
