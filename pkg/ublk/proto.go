// Package ublk serves block devices through the kernel's ublk driver (ublk_drv, in Linux
// since 6.0; this package needs 6.5, for GET_FEATURES; Debian has it from 6.12): /dev/ublkb<n> is a block device whose requests come
// to this process as io_uring commands on /dev/ublkc<n>, one ring and one thread per queue,
// and go back the same way. Devices are added, started, stopped and recovered through
// /dev/ublk-control (Ctrl).
//
// The types below are the driver's UAPI (include/uapi/linux/ublk_cmd.h), named after it.
// Commands are ioctl-encoded (_IOR/_IOWR('u', nr, …)), which every kernel from 6.5 accepts;
// the legacy plain numbers are a build option of the driver.
package ublk

import (
	"unsafe"
)

// Control command numbers (UBLK_CMD_*).
const (
	cmdGetDevInfo              = 0x02
	cmdAddDev                  = 0x04
	cmdDelDev                  = 0x05
	cmdStartDev                = 0x06
	cmdStopDev                 = 0x07
	cmdSetParams               = 0x08
	cmdGetParams               = 0x09
	cmdStartUserRecovery       = 0x10
	cmdEndUserRecovery         = 0x11
	cmdGetFeatures             = 0x13
	cmdDelDevAsync             = 0x14 // Linux 6.11 and later
	cmdUpdateSize              = 0x15 // with FlagUpdateSize (6.14 and later)
	cmdTryStopDev              = 0x17 // with FlagSafeStopDev (7.x)
	ioFetchReq                 = 0x20 // UBLK_IO_FETCH_REQ
	ioCommitAndFetchReq        = 0x21 // UBLK_IO_COMMIT_AND_FETCH_REQ
	ioctlRead                  = 2
	ioctlReadWrite             = 3
	ioctlType                  = 'u'
	ctrlCmdSize                = 32 // sizeof(struct ublksrv_ctrl_cmd)
	ioCmdSize                  = 16 // sizeof(struct ublksrv_io_cmd)
	maxQueueDepth              = 4096
	ioResAbort                 = -19 // UBLK_IO_RES_ABORT: -ENODEV, the queue is going away
	ioDescSize                 = 24  // sizeof(struct ublksrv_io_desc)
	ioDescBufOffset      int64 = 0   // UBLKSRV_CMD_BUF_OFFSET
)

// ioc is the kernel's _IOC(dir, 'u', nr, size).
func ioc(dir, nr, size uint32) uint32 { return dir<<30 | size<<16 | ioctlType<<8 | nr }

func ctrlOp(nr uint32) uint32 {
	switch nr {
	case cmdGetDevInfo, cmdGetParams, cmdGetFeatures, cmdDelDevAsync:
		return ioc(ioctlRead, nr, ctrlCmdSize)
	}
	return ioc(ioctlReadWrite, nr, ctrlCmdSize)
}

func ioOp(nr uint32) uint32 { return ioc(ioctlReadWrite, nr, ioCmdSize) }

// Device flags (UBLK_F_*) this package uses or reports.
const (
	FlagURingCmdCompInTask   = 1 << 1  // UBLK_F_URING_CMD_COMP_IN_TASK
	FlagUserRecovery         = 1 << 3  // UBLK_F_USER_RECOVERY: the device outlives its server
	FlagUserRecoveryReissue  = 1 << 4  // UBLK_F_USER_RECOVERY_REISSUE: requests in flight at the crash are issued again
	FlagCmdIoctlEncode       = 1 << 6  // UBLK_F_CMD_IOCTL_ENCODE
	FlagUserRecoveryFailIO   = 1 << 9  // UBLK_F_USER_RECOVERY_FAIL_IO
	FlagUpdateSize           = 1 << 10 // UBLK_F_UPDATE_SIZE: UPDATE_SIZE resizes a started device
	FlagSafeStopDev          = 1 << 17 // UBLK_F_SAFE_STOP_DEV: TRY_STOP_DEV, a stop refused while the disk is open
	featuresNeeded           = FlagUserRecovery | FlagUserRecoveryReissue | FlagCmdIoctlEncode
	stateDead, stateLive     = 0, 1 // UBLK_S_DEV_*
	stateQuiesced, stateFail = 2, 3
)

// State is a device's state as the driver reports it (UBLK_S_DEV_*).
type State uint16

// Device states a daemon tells apart when it takes a device back.
const (
	// StateDead is a device added and not started (or stopped): no disk, no IO waiting on it.
	StateDead State = stateDead
	// StateQuiesced is a device whose server died: its IO waits for a new one.
	StateQuiesced State = stateQuiesced
)

// String names the state as ublk's documentation does.
func (s State) String() string {
	switch s {
	case stateDead:
		return "dead"
	case stateLive:
		return "live"
	case stateQuiesced:
		return "quiesced"
	case stateFail:
		return "fail_io"
	}
	return "unknown"
}

// CtrlCmd is struct ublksrv_ctrl_cmd, the command area of a control io_uring command.
type CtrlCmd struct {
	DevID      uint32
	QueueID    uint16 // 0xffff: not a queue's command
	Len        uint16
	Addr       uint64
	Data       uint64
	DevPathLen uint16
	_          uint16
	_          uint32
}

// DevInfo is struct ublksrv_ctrl_dev_info.
type DevInfo struct {
	NrHWQueues    uint16
	QueueDepth    uint16
	State         State
	_             uint16
	MaxIOBufBytes uint32
	DevID         uint32
	SrvPID        int32
	_             uint32
	Flags         uint64
	SrvFlags      uint64 // the server's own; the driver keeps them for it
	OwnerUID      uint32
	OwnerGID      uint32
	_             [2]uint64
}

// Basic attributes (UBLK_ATTR_*).
const (
	AttrReadOnly      = 1 << 0
	AttrRotational    = 1 << 1
	AttrVolatileCache = 1 << 2
	AttrFUA           = 1 << 3
)

// ParamBasic is struct ublk_param_basic.
type ParamBasic struct {
	Attrs            uint32
	LogicalBSShift   uint8
	PhysicalBSShift  uint8
	IOOptShift       uint8
	IOMinShift       uint8
	MaxSectors       uint32
	ChunkSectors     uint32
	DevSectors       uint64
	VirtBoundaryMask uint64
}

// ParamDiscard is struct ublk_param_discard.
type ParamDiscard struct {
	DiscardAlignment      uint32
	DiscardGranularity    uint32
	MaxDiscardSectors     uint32
	MaxWriteZeroesSectors uint32
	MaxDiscardSegments    uint16
	_                     uint16
}

// ParamDevt is struct ublk_param_devt: the char and block devices' numbers (read only).
type ParamDevt struct {
	CharMajor, CharMinor, DiskMajor, DiskMinor uint32
}

// ParamZoned is struct ublk_param_zoned (unused: no zoned devices here).
type ParamZoned struct {
	MaxOpenZones, MaxActiveZones, MaxZoneAppendSectors uint32
	_                                                  [20]uint8
}

// Parameter types (UBLK_PARAM_TYPE_*).
const (
	ParamTypeBasic   = 1 << 0
	ParamTypeDiscard = 1 << 1
	ParamTypeDevt    = 1 << 2
)

// Params is struct ublk_params as 6.1 to 6.13 know it; the driver takes a shorter or
// longer one and says in Len how much it used.
type Params struct {
	Len     uint32
	Types   uint32
	Basic   ParamBasic
	Discard ParamDiscard
	Devt    ParamDevt
	Zoned   ParamZoned
}

// IODesc is struct ublksrv_io_desc: one request, in the queue's shared descriptor array.
type IODesc struct {
	OpFlags     uint32 // op in bits 0–7, UBLK_IO_F_* above
	NrSectors   uint32
	StartSector uint64
	Addr        uint64
}

// Request operations (UBLK_IO_OP_*) and flags (UBLK_IO_F_*).
const (
	OpRead        = 0
	OpWrite       = 1
	OpFlush       = 2
	OpDiscard     = 3
	OpWriteSame   = 4
	OpWriteZeroes = 5
	IOFlagFUA     = 1 << 13
	IOFlagNoUnmap = 1 << 15
)

// ioCmd is struct ublksrv_io_cmd, the command area of an IO io_uring command.
type ioCmd struct {
	QID    uint16
	Tag    uint16
	Result int32
	Addr   uint64
}

var (
	_ [ctrlCmdSize - unsafe.Sizeof(CtrlCmd{})]byte
	_ [unsafe.Sizeof(CtrlCmd{}) - ctrlCmdSize]byte
	_ [ioCmdSize - unsafe.Sizeof(ioCmd{})]byte
	_ [ioDescSize - unsafe.Sizeof(IODesc{})]byte
	_ [64 - unsafe.Sizeof(DevInfo{})]byte
	_ [unsafe.Sizeof(DevInfo{}) - 64]byte
)
