// Package transport is RTRS: the kernel's RDMA transport (rtrs-clt, rtrs-srv) over pkg/rdma.
// Its messages are byte-compatible with the kernel's (rtrs-pri.h); the protocol behaviour
// follows the kernel implementation as restated in the project's spec.
package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"

	"github.com/google/uuid"
)

// Protocol constants (rtrs-pri.h).
const (
	Magic        = 0x1BBD
	ProtoVersion = 0x0200 // major 2, minor 0
	ProtoMajor   = 2

	MaxPathsNum         = 128 // MAX_PATHS_NUM
	MaxSessQueueDepth   = 65535
	MinChunkSize        = 8192
	DefaultChunkSize    = 128 << 10
	DefaultQueueDepth   = 512
	MaxHdrSize          = 4096 // MAX_HDR_SIZE = PAGE_SIZE
	ServiceConQD        = 512  // SERVICE_CON_QUEUE_DEPTH
	MaxConnsPerPath     = 4096 // server rejects a larger cid_num
	NameMax             = 255
	maxImmPayloadBits   = 28
	immTypeShift        = 28
	immErrnoShift       = 19
	immIDMask           = 0x7FFFF
	immErrnoMask        = 0x1FF
	immPayloadMask      = 0x0FFFFFFF
	firstConnFlag       = 0x01
	sgDescSize          = 16
	infoRspHdrSize      = 8
	readHdrSize         = 8
	writeHdrSize        = 4
	rkeyRspSize         = 8
	connMsgSize         = 56
	infoReqSize         = 272
	infoReqPathnameSize = 255
)

// Message types (enum rtrs_msg_types).
const (
	MsgTypeInfoReq uint16 = iota
	MsgTypeInfoRsp
	MsgTypeWrite
	MsgTypeRead
	MsgTypeRkeyRsp
)

// Message flags (enum rtrs_msg_flags): READ header flags and conn_rsp flags.
const (
	MsgNeedInvalF uint16 = 0x1
	MsgNewRkeyF   uint32 = 0x2
)

// Immediate types (enum rtrs_imm_type).
const (
	ImmIOReq     = 0
	ImmIORsp     = 1
	ImmIORspWInv = 2
	ImmHBMsg     = 8
	ImmHBAck     = 9
)

// Heartbeat immediates.
const (
	ImmHBMsgValue uint32 = ImmHBMsg << immTypeShift // 0x80000000
	ImmHBAckValue uint32 = ImmHBAck << immTypeShift // 0x90000000
)

// ErrMsg marks a malformed message from the peer.
var ErrMsg = errors.New("rtrs: malformed message")

func msgErr(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMsg}, a...)...)
}

// MsgConnReq is rtrs_msg_conn_req, the client's connect private data (56 bytes).
type MsgConnReq struct {
	Cid       uint16
	CidNum    uint16
	ReconCnt  uint16
	SessUUID  uuid.UUID // per path
	PathsUUID uuid.UUID // per session
	FirstConn bool
}

// Marshal encodes the request.
func (m *MsgConnReq) Marshal() []byte {
	b := make([]byte, connMsgSize)
	binary.LittleEndian.PutUint16(b[2:], Magic)
	binary.LittleEndian.PutUint16(b[4:], ProtoVersion)
	binary.LittleEndian.PutUint16(b[6:], m.Cid)
	binary.LittleEndian.PutUint16(b[8:], m.CidNum)
	binary.LittleEndian.PutUint16(b[10:], m.ReconCnt)
	copy(b[12:28], m.SessUUID[:])
	copy(b[28:44], m.PathsUUID[:])
	if m.FirstConn {
		b[44] = firstConnFlag
	}
	return b
}

// Unmarshal decodes and checks magic and major version.
func (m *MsgConnReq) Unmarshal(b []byte) error {
	if len(b) < connMsgSize {
		return msgErr("conn_req of %d bytes", len(b))
	}
	if mg := binary.LittleEndian.Uint16(b[2:]); mg != Magic {
		return msgErr("conn_req magic %#x", mg)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v>>8 != ProtoMajor {
		return msgErr("conn_req protocol version %#x, major %d wanted", v, ProtoMajor)
	}
	m.Cid = binary.LittleEndian.Uint16(b[6:])
	m.CidNum = binary.LittleEndian.Uint16(b[8:])
	m.ReconCnt = binary.LittleEndian.Uint16(b[10:])
	copy(m.SessUUID[:], b[12:28])
	copy(m.PathsUUID[:], b[28:44])
	m.FirstConn = b[44]&firstConnFlag != 0
	return nil
}

// MsgConnRsp is rtrs_msg_conn_rsp, the server's accept or reject private data (56 bytes).
type MsgConnRsp struct {
	Errno      int16 // 0 on accept, a negative errno on reject
	QueueDepth uint16
	MaxIOSize  uint32
	MaxHdrSize uint32
	Flags      uint32
}

// Marshal encodes the response.
func (m *MsgConnRsp) Marshal() []byte {
	b := make([]byte, connMsgSize)
	binary.LittleEndian.PutUint16(b[0:], Magic)
	binary.LittleEndian.PutUint16(b[2:], ProtoVersion)
	binary.LittleEndian.PutUint16(b[4:], uint16(m.Errno))
	binary.LittleEndian.PutUint16(b[6:], m.QueueDepth)
	binary.LittleEndian.PutUint32(b[8:], m.MaxIOSize)
	binary.LittleEndian.PutUint32(b[12:], m.MaxHdrSize)
	binary.LittleEndian.PutUint32(b[16:], m.Flags)
	return b
}

// Unmarshal decodes and checks magic and major version.
func (m *MsgConnRsp) Unmarshal(b []byte) error {
	if len(b) < connMsgSize {
		return msgErr("conn_rsp of %d bytes", len(b))
	}
	if mg := binary.LittleEndian.Uint16(b[0:]); mg != Magic {
		return msgErr("conn_rsp magic %#x", mg)
	}
	if v := binary.LittleEndian.Uint16(b[2:]); v>>8 != ProtoMajor {
		return msgErr("conn_rsp protocol version %#x", v)
	}
	m.Errno = int16(binary.LittleEndian.Uint16(b[4:]))
	m.QueueDepth = binary.LittleEndian.Uint16(b[6:])
	m.MaxIOSize = binary.LittleEndian.Uint32(b[8:])
	m.MaxHdrSize = binary.LittleEndian.Uint32(b[12:])
	m.Flags = binary.LittleEndian.Uint32(b[16:])
	return nil
}

// MsgInfoReq is rtrs_msg_info_req (272 bytes): the session name.
type MsgInfoReq struct {
	PathName string
}

// Marshal encodes the request; the name must fit the 255-byte field.
func (m *MsgInfoReq) Marshal() ([]byte, error) {
	if len(m.PathName) == 0 || len(m.PathName) >= infoReqPathnameSize {
		return nil, fmt.Errorf("rtrs: session name of %d bytes (1..%d)", len(m.PathName), infoReqPathnameSize-1)
	}
	b := make([]byte, infoReqSize)
	binary.LittleEndian.PutUint16(b[0:], MsgTypeInfoReq)
	copy(b[2:2+infoReqPathnameSize], m.PathName)
	return b, nil
}

// Unmarshal decodes a request: at least 272 bytes, the right type, a NUL-terminated name.
func (m *MsgInfoReq) Unmarshal(b []byte) error {
	if len(b) < infoReqSize {
		return msgErr("info_req of %d bytes", len(b))
	}
	if t := binary.LittleEndian.Uint16(b); t != MsgTypeInfoReq {
		return msgErr("info_req of type %d", t)
	}
	name := b[2 : 2+infoReqPathnameSize]
	n := 0
	for n < len(name) && name[n] != 0 {
		n++
	}
	if n == len(name) {
		return msgErr("info_req name not terminated")
	}
	m.PathName = string(name[:n])
	return nil
}

// SgDesc is rtrs_sg_desc (16 bytes).
type SgDesc struct {
	Addr uint64
	Key  uint32
	Len  uint32
}

func (d SgDesc) put(b []byte) {
	binary.LittleEndian.PutUint64(b[0:], d.Addr)
	binary.LittleEndian.PutUint32(b[8:], d.Key)
	binary.LittleEndian.PutUint32(b[12:], d.Len)
}

func getDesc(b []byte) SgDesc {
	return SgDesc{Addr: binary.LittleEndian.Uint64(b), Key: binary.LittleEndian.Uint32(b[8:]), Len: binary.LittleEndian.Uint32(b[12:])}
}

// MsgInfoRsp is rtrs_msg_info_rsp: one descriptor per server memory region.
type MsgInfoRsp struct {
	Desc []SgDesc
}

// InfoRspSize is the size of an info response with n descriptors.
func InfoRspSize(n int) int { return infoRspHdrSize + sgDescSize*n }

// Marshal encodes the response.
func (m *MsgInfoRsp) Marshal() []byte {
	b := make([]byte, InfoRspSize(len(m.Desc)))
	binary.LittleEndian.PutUint16(b[0:], MsgTypeInfoRsp)
	binary.LittleEndian.PutUint16(b[2:], uint16(len(m.Desc)))
	for i, d := range m.Desc {
		d.put(b[infoRspHdrSize+sgDescSize*i:])
	}
	return b
}

// Unmarshal decodes a response; sg_cnt must fit both the message and maxDesc.
func (m *MsgInfoRsp) Unmarshal(b []byte, maxDesc int) error {
	if len(b) < infoRspHdrSize {
		return msgErr("info_rsp of %d bytes", len(b))
	}
	if t := binary.LittleEndian.Uint16(b); t != MsgTypeInfoRsp {
		return msgErr("info_rsp of type %d", t)
	}
	n := int(binary.LittleEndian.Uint16(b[2:]))
	if n == 0 || n > maxDesc || len(b) < InfoRspSize(n) {
		return msgErr("info_rsp with %d descriptors in %d bytes (at most %d)", n, len(b), maxDesc)
	}
	m.Desc = make([]SgDesc, n)
	for i := range m.Desc {
		m.Desc[i] = getDesc(b[infoRspHdrSize+sgDescSize*i:])
	}
	return nil
}

// MsgRdmaRead is rtrs_msg_rdma_read: the RTRS header of a READ request, at the end of the
// message the client writes into the chunk.
type MsgRdmaRead struct {
	UsrLen uint16
	Flags  uint16
	Desc   []SgDesc
}

// ReadHdrSize is the size of a READ header with n descriptors.
func ReadHdrSize(n int) int { return readHdrSize + sgDescSize*n }

// Put encodes the header into b, which must be ReadHdrSize(len(Desc)) long.
func (m *MsgRdmaRead) Put(b []byte) {
	binary.LittleEndian.PutUint16(b[0:], MsgTypeRead)
	binary.LittleEndian.PutUint16(b[2:], m.UsrLen)
	binary.LittleEndian.PutUint16(b[4:], m.Flags)
	binary.LittleEndian.PutUint16(b[6:], uint16(len(m.Desc)))
	for i, d := range m.Desc {
		d.put(b[readHdrSize+sgDescSize*i:])
	}
}

// Unmarshal decodes a READ header found at the start of b; the kernel server accepts sg_cnt
// 0 or 1 only.
func (m *MsgRdmaRead) Unmarshal(b []byte) error {
	if len(b) < readHdrSize {
		return msgErr("read header of %d bytes", len(b))
	}
	if t := binary.LittleEndian.Uint16(b); t != MsgTypeRead {
		return msgErr("read header of type %d", t)
	}
	m.UsrLen = binary.LittleEndian.Uint16(b[2:])
	m.Flags = binary.LittleEndian.Uint16(b[4:])
	n := int(binary.LittleEndian.Uint16(b[6:]))
	if n > 1 || len(b) < ReadHdrSize(n) {
		return msgErr("read header with %d descriptors", n)
	}
	m.Desc = m.Desc[:0]
	if n == 1 {
		m.Desc = append(m.Desc, getDesc(b[readHdrSize:]))
	}
	return nil
}

// PutMsgRdmaWrite encodes rtrs_msg_rdma_write (4 bytes) into b.
func PutMsgRdmaWrite(b []byte, usrLen uint16) {
	binary.LittleEndian.PutUint16(b[0:], MsgTypeWrite)
	binary.LittleEndian.PutUint16(b[2:], usrLen)
}

// reqHdr decodes what every request header starts with (rtrs_msg_rdma_write, and the first
// four bytes of rtrs_msg_rdma_read): the message type and the user header's length. b holds
// at least writeHdrSize bytes.
func reqHdr(b []byte) (typ uint16, usrLen int) {
	return binary.LittleEndian.Uint16(b), int(binary.LittleEndian.Uint16(b[2:]))
}

// MsgRkeyRsp is rtrs_msg_rkey_rsp (8 bytes): the new rkey of a chunk.
type MsgRkeyRsp struct {
	BufID uint16
	Rkey  uint32
}

// Put encodes the message into b (8 bytes).
func (m *MsgRkeyRsp) Put(b []byte) {
	binary.LittleEndian.PutUint16(b[0:], MsgTypeRkeyRsp)
	binary.LittleEndian.PutUint16(b[2:], m.BufID)
	binary.LittleEndian.PutUint32(b[4:], m.Rkey)
}

// Unmarshal decodes the message.
func (m *MsgRkeyRsp) Unmarshal(b []byte) error {
	if len(b) < rkeyRspSize {
		return msgErr("rkey_rsp of %d bytes", len(b))
	}
	if t := binary.LittleEndian.Uint16(b); t != MsgTypeRkeyRsp {
		return msgErr("rkey_rsp of type %d", t)
	}
	m.BufID = binary.LittleEndian.Uint16(b[2:])
	m.Rkey = binary.LittleEndian.Uint32(b[4:])
	return nil
}

// ImmOf builds an immediate from a type and a 28-bit payload (rtrs_to_imm).
func ImmOf(typ, payload uint32) uint32 {
	return (typ&0xF)<<immTypeShift | payload&immPayloadMask
}

// ImmFields splits an immediate (rtrs_from_imm).
func ImmFields(imm uint32) (typ, payload uint32) {
	return imm >> immTypeShift, imm & immPayloadMask
}

// IORspImm builds an IO response immediate (rtrs_to_io_rsp_imm): a 9-bit errno magnitude and
// a 19-bit message id; w/inv selects RTRS_IO_RSP_W_INV_IMM.
func IORspImm(msgID uint32, errno int, withInv bool) uint32 {
	if errno < 0 {
		errno = -errno
	}
	typ := uint32(ImmIORsp)
	if withInv {
		typ = ImmIORspWInv
	}
	return ImmOf(typ, uint32(errno&immErrnoMask)<<immErrnoShift|msgID&immIDMask)
}

// IORspFields decodes an IO response payload (rtrs_from_io_rsp_imm); the errno is returned
// negated, as the kernel does.
func IORspFields(payload uint32) (msgID uint32, errno int) {
	return payload & immIDMask, -int((payload >> immErrnoShift) & immErrnoMask)
}

// ChunkBits is ceil(log2(queueDepth)): the bits a chunk id takes in a request immediate
// (ilog2(qd - 1) + 1).
func ChunkBits(queueDepth int) int {
	if queueDepth <= 1 {
		return 0
	}
	return bits.Len(uint(queueDepth - 1))
}

// MemBits is the bits left in a request immediate for the offset inside a chunk.
func MemBits(queueDepth int) int { return maxImmPayloadBits - ChunkBits(queueDepth) }

// CheckImmBits checks the kernel's rule that chunk id and chunk offset fit the 28-bit
// immediate payload: ceil(log2 qd) + ceil(log2 chunkSize) ≤ 28.
func CheckImmBits(queueDepth, chunkSize int) error {
	cb := bits.Len(uint(chunkSize - 1))
	if ChunkBits(queueDepth)+cb > maxImmPayloadBits {
		return fmt.Errorf("rtrs: queue depth %d and chunk size %d need %d+%d bits, more than %d",
			queueDepth, chunkSize, ChunkBits(queueDepth), cb, maxImmPayloadBits)
	}
	return nil
}

// IOReqImm builds the request immediate for chunk id with the RTRS header at off.
func IOReqImm(id, off uint32, memBits int) uint32 {
	return ImmOf(ImmIOReq, id<<memBits|off)
}

// IOReqFields splits a request payload into chunk id and offset.
func IOReqFields(payload uint32, memBits int) (id, off uint32) {
	return payload >> memBits, payload & (1<<memBits - 1)
}
