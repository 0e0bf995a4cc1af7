// Package rnbd is the block service on RTRS: RNBD's protocol (spec section 7), a server that
// exports files and block devices under a search path, and a client that maps them as devices.
package rnbd

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"syscall"
)

// Protocol version (RNBD_PROTO_VER_MAJOR/MINOR): 2.2, the flags PREFLUSH and NOUNMAP of
// Linux 7.2. Only the major number is exchanged (SESS_INFO), so a peer's minor is never
// known: what a peer takes is learnt from the open response's limits instead.
const (
	ProtoVerMajor = 2
	ProtoVerMinor = 2
)

// MsgType is rnbd_msg_hdr.type.
type MsgType uint16

// Message types (enum rnbd_msg_type).
const (
	MsgTypeSessInfo MsgType = iota
	MsgTypeSessInfoRsp
	MsgTypeOpen
	MsgTypeOpenRsp
	MsgTypeIO
	MsgTypeClose
)

// Message sizes in bytes, as sizeof() of the kernel's structs on 64-bit.
const (
	SessInfoSize    = 36
	SessInfoRspSize = 36
	OpenSize        = 264
	OpenRspSize     = 56
	IOSize          = 32
	CloseSize       = 8
	// NameMax is the device name field of MsgTypeOpen (NAME_MAX): a name is at most 254 bytes
	// so that it stays NUL-terminated.
	NameMax = 255
)

// AccessMode is rnbd_access_mode.
type AccessMode uint8

// Access modes: any number of ro openers, one rw, a second rw only as migration.
const (
	AccessRO AccessMode = iota
	AccessRW
	AccessMigration
)

func (m AccessMode) String() string {
	switch m {
	case AccessRO:
		return "ro"
	case AccessRW:
		return "rw"
	case AccessMigration:
		return "migration"
	}
	return fmt.Sprintf("unknown(%d)", uint8(m))
}

// ParseAccessMode reads the access_mode= value of map_device.
func ParseAccessMode(s string) (AccessMode, error) {
	switch s {
	case "ro":
		return AccessRO, nil
	case "rw":
		return AccessRW, nil
	case "migration":
		return AccessMigration, nil
	}
	return 0, fmt.Errorf("rnbd: access mode %q (ro, rw, migration): %w", s, syscall.EINVAL)
}

// Op is the operation in the low 8 bits of rnbd_msg_io.rw.
type Op uint8

// Operations (enum rnbd_io_flags).
const (
	OpRead Op = iota
	OpWrite
	OpFlush
	OpDiscard
	OpSecureErase
	OpWriteZeroes
	opLast
)

func (o Op) String() string {
	if o < opLast {
		return [...]string{"READ", "WRITE", "FLUSH", "DISCARD", "SECURE_ERASE", "WRITE_ZEROES"}[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Flags of rnbd_msg_io.rw above the operation (RNBD_F_*). PREFLUSH and NOUNMAP are protocol
// 2.2's: a server of 2.0 (Linux 6.1, 6.12) ignores them.
const (
	FlagSync uint32 = 1 << 8
	FlagFUA  uint32 = 1 << 9
	// FlagPreflush: flush the volatile cache before the operation.
	FlagPreflush uint32 = 1 << 10
	// FlagNoUnmap: WRITE_ZEROES only; the zeroed range stays allocated.
	FlagNoUnmap uint32 = 1 << 11
	opMask      uint32 = 0xff
	flagsAll           = FlagSync | FlagFUA | FlagPreflush | FlagNoUnmap
)

// Cache policy bits of MsgTypeOpenRsp.CachePolicy (enum rnbd_cache_policy).
const (
	CacheFUA       = 1 << 0
	CacheWriteback = 1 << 1
)

// SectorSize is the unit of sector numbers and sizes in sectors.
const SectorSize = 512

// maxSectors is the largest device size we take, in sectors: 2^63 bytes less one sector,
// what an int64 offset reaches.
const maxSectors = 1<<54 - 1

func putHdr(b []byte, t MsgType) {
	binary.LittleEndian.PutUint16(b[0:], uint16(t))
	binary.LittleEndian.PutUint16(b[2:], 0)
}

// checkHdr checks the length and the type of a message.
func checkHdr(b []byte, t MsgType, size int) error {
	if len(b) < size {
		return fmt.Errorf("rnbd: %d-byte message shorter than %d: %w", len(b), size, syscall.EBADMSG)
	}
	if got := MsgType(binary.LittleEndian.Uint16(b)); got != t {
		return fmt.Errorf("rnbd: message type %d, want %d: %w", got, t, syscall.EBADMSG)
	}
	return nil
}

// MsgSessInfo is rnbd_msg_sess_info (client → server) and, with the other type,
// rnbd_msg_sess_info_rsp: the protocol major version.
type MsgSessInfo struct {
	Ver uint8
}

// Put writes the message of type t (MsgTypeSessInfo or MsgTypeSessInfoRsp) into b (≥ 36 bytes).
func (m MsgSessInfo) Put(b []byte, t MsgType) {
	clear(b[:SessInfoSize])
	putHdr(b, t)
	b[4] = m.Ver
}

// Unmarshal reads a message of type t.
func (m *MsgSessInfo) Unmarshal(b []byte, t MsgType) error {
	if err := checkHdr(b, t, SessInfoSize); err != nil {
		return err
	}
	m.Ver = b[4]
	return nil
}

// MsgOpen is rnbd_msg_open: map a device by its path under the server's search path.
type MsgOpen struct {
	AccessMode AccessMode
	DevName    string
}

// Put writes the message into b (≥ 264 bytes); the name must be shorter than NameMax.
func (m MsgOpen) Put(b []byte) error {
	if m.DevName == "" || len(m.DevName) >= NameMax || m.AccessMode > AccessMigration {
		return fmt.Errorf("rnbd: open %q mode %v: %w", m.DevName, m.AccessMode, syscall.EINVAL)
	}
	clear(b[:OpenSize])
	putHdr(b, MsgTypeOpen)
	b[4] = uint8(m.AccessMode)
	copy(b[6:6+NameMax], m.DevName)
	return nil
}

// Unmarshal reads an open message: the name must be NUL-terminated inside its field and
// contain no NUL before that; the access mode must be known.
func (m *MsgOpen) Unmarshal(b []byte) error {
	if err := checkHdr(b, MsgTypeOpen, OpenSize); err != nil {
		return err
	}
	if b[4] > uint8(AccessMigration) {
		return fmt.Errorf("rnbd: access mode %d: %w", b[4], syscall.EINVAL)
	}
	field := b[6 : 6+NameMax]
	n := bytes.IndexByte(field, 0)
	if n <= 0 {
		return fmt.Errorf("rnbd: device name empty or not terminated: %w", syscall.EINVAL)
	}
	m.AccessMode, m.DevName = AccessMode(b[4]), string(field[:n])
	return nil
}

// MsgOpenRsp is rnbd_msg_open_rsp: what the client needs to set up its queue.
type MsgOpenRsp struct {
	DeviceID              uint32
	NSectors              uint64
	MaxHWSectors          uint32
	MaxWriteZeroesSectors uint32
	MaxDiscardSectors     uint32
	DiscardGranularity    uint32
	DiscardAlignment      uint32
	PhysicalBlockSize     uint16
	LogicalBlockSize      uint16
	MaxSegments           uint16
	SecureDiscard         uint16
	CachePolicy           uint8
}

// Put writes the message into b (≥ 56 bytes).
func (m MsgOpenRsp) Put(b []byte) {
	clear(b[:OpenRspSize])
	putHdr(b, MsgTypeOpenRsp)
	le := binary.LittleEndian
	le.PutUint32(b[4:], m.DeviceID)
	le.PutUint64(b[8:], m.NSectors)
	le.PutUint32(b[16:], m.MaxHWSectors)
	le.PutUint32(b[20:], m.MaxWriteZeroesSectors)
	le.PutUint32(b[24:], m.MaxDiscardSectors)
	le.PutUint32(b[28:], m.DiscardGranularity)
	le.PutUint32(b[32:], m.DiscardAlignment)
	le.PutUint16(b[36:], m.PhysicalBlockSize)
	le.PutUint16(b[38:], m.LogicalBlockSize)
	le.PutUint16(b[40:], m.MaxSegments)
	le.PutUint16(b[42:], m.SecureDiscard)
	b[45] = m.CachePolicy
}

// Unmarshal reads an open response and checks that its geometry is usable: block sizes
// powers of two from 512 to 64 KiB, the physical one not below the logical one, a size in
// whole logical blocks.
func (m *MsgOpenRsp) Unmarshal(b []byte) error {
	if err := checkHdr(b, MsgTypeOpenRsp, OpenRspSize); err != nil {
		return err
	}
	le := binary.LittleEndian
	*m = MsgOpenRsp{
		DeviceID:              le.Uint32(b[4:]),
		NSectors:              le.Uint64(b[8:]),
		MaxHWSectors:          le.Uint32(b[16:]),
		MaxWriteZeroesSectors: le.Uint32(b[20:]),
		MaxDiscardSectors:     le.Uint32(b[24:]),
		DiscardGranularity:    le.Uint32(b[28:]),
		DiscardAlignment:      le.Uint32(b[32:]),
		PhysicalBlockSize:     le.Uint16(b[36:]),
		LogicalBlockSize:      le.Uint16(b[38:]),
		MaxSegments:           le.Uint16(b[40:]),
		SecureDiscard:         le.Uint16(b[42:]),
		CachePolicy:           b[45],
	}
	lbs, pbs := int(m.LogicalBlockSize), int(m.PhysicalBlockSize)
	pow2 := func(v int) bool { return v >= SectorSize && v <= 1<<15 && v&(v-1) == 0 }
	if !pow2(lbs) || (pbs != 0 && (!pow2(pbs) || pbs < lbs)) {
		return fmt.Errorf("rnbd: block sizes %d/%d: %w", lbs, pbs, syscall.EBADMSG)
	}
	if m.NSectors > maxSectors || m.NSectors%uint64(lbs/SectorSize) != 0 {
		return fmt.Errorf("rnbd: %d sectors with %d-byte blocks: %w", m.NSectors, lbs, syscall.EBADMSG)
	}
	if m.MaxHWSectors != 0 && int(m.MaxHWSectors)*SectorSize < lbs {
		return fmt.Errorf("rnbd: max_hw_sectors %d below one %d-byte block: %w", m.MaxHWSectors, lbs, syscall.EBADMSG)
	}
	// A discard or write-zeroes limit below one block cannot carry any request: taken as
	// no limit announced, so the operation is not offered.
	if int(m.MaxDiscardSectors)*SectorSize < lbs {
		m.MaxDiscardSectors = 0
	}
	if int(m.MaxWriteZeroesSectors)*SectorSize < lbs {
		m.MaxWriteZeroesSectors = 0
	}
	// The block layer rounds with the discard granularity as a power of two: one that is
	// not (or is past 1 GiB) is taken as none announced, the block size then serving.
	if g := m.DiscardGranularity; g&(g-1) != 0 || g > 1<<30 {
		m.DiscardGranularity, m.DiscardAlignment = 0, 0
	}
	return nil
}

// MsgIO is rnbd_msg_io, the user header of every block IO.
type MsgIO struct {
	DeviceID uint32
	Sector   uint64
	RW       uint32 // Op | flags
	BiSize   uint32 // bytes
	Prio     uint16
}

// Op is the message's operation.
func (m MsgIO) Op() Op { return Op(m.RW & opMask) }

// Put writes the message into b (≥ 32 bytes); the tail padding is zeroed.
func (m MsgIO) Put(b []byte) {
	putHdr(b, MsgTypeIO)
	le := binary.LittleEndian
	le.PutUint32(b[4:], m.DeviceID)
	le.PutUint64(b[8:], m.Sector)
	le.PutUint32(b[16:], m.RW)
	le.PutUint32(b[20:], m.BiSize)
	le.PutUint16(b[24:], m.Prio)
	clear(b[26:IOSize])
}

// Unmarshal reads an IO header. Unknown operations or flags are refused (EOPNOTSUPP), as is
// NOUNMAP on anything but WRITE_ZEROES, where no kernel client puts it.
func (m *MsgIO) Unmarshal(b []byte) error {
	if err := checkHdr(b, MsgTypeIO, IOSize); err != nil {
		return err
	}
	le := binary.LittleEndian
	*m = MsgIO{DeviceID: le.Uint32(b[4:]), Sector: le.Uint64(b[8:]), RW: le.Uint32(b[16:]),
		BiSize: le.Uint32(b[20:]), Prio: le.Uint16(b[24:])}
	if Op(m.RW&opMask) >= opLast || m.RW&^(opMask|flagsAll) != 0 ||
		(m.RW&FlagNoUnmap != 0 && m.Op() != OpWriteZeroes) {
		return fmt.Errorf("rnbd: io flags %#x: %w", m.RW, syscall.EOPNOTSUPP)
	}
	return nil
}

// MsgClose is rnbd_msg_close: unmap one device.
type MsgClose struct {
	DeviceID uint32
}

// Put writes the message into b (≥ 8 bytes).
func (m MsgClose) Put(b []byte) {
	putHdr(b, MsgTypeClose)
	binary.LittleEndian.PutUint32(b[4:], m.DeviceID)
}

// Unmarshal reads a close message.
func (m *MsgClose) Unmarshal(b []byte) error {
	if err := checkHdr(b, MsgTypeClose, CloseSize); err != nil {
		return err
	}
	m.DeviceID = binary.LittleEndian.Uint32(b[4:])
	return nil
}

// PeekType returns the type of a message (ok false if it has no header).
func PeekType(b []byte) (MsgType, bool) {
	if len(b) < 4 {
		return 0, false
	}
	return MsgType(binary.LittleEndian.Uint16(b)), true
}
