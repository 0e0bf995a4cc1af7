// Package rdma is a provider-neutral verbs API modelled on libibverbs and librdmacm: devices and
// ports, protection domains, memory regions with local and remote keys, reliable-connected queue
// pairs, completion queues and a connection manager whose connect, accept and reject carry
// private data. It knows nothing of RTRS. Providers implement the interfaces: pkg/rdma/soft (RDMA
// semantics over TCP, pure Go) is the default. docs/rdma-api.md maps every call to its ibverbs or
// librdmacm counterpart.
//
// Memory semantics follow verbs: a buffer handed to a work request belongs to the provider until
// the request completes, and memory registered for remote access may change under the owner's
// feet whenever a peer holds a valid rkey for it. Ordering between a completion and the data it
// announces is established by polling the completion queue.
package rdma

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"time"
)

// Provider opens devices and creates connection identifiers. It is the analogue of the set of
// devices ibv_get_device_list returns together with librdmacm's address resolution.
type Provider interface {
	// Name is the provider's short name ("soft", "verbs").
	Name() string
	// Devices lists the devices this provider can open on this host.
	Devices() ([]DeviceInfo, error)
	// OpenDevice opens a device by name (ibv_open_device).
	OpenDevice(name string) (Device, error)
	// ResolveAddr creates a connection identifier bound to the local device that routes to dst,
	// from src if src is valid (rdma_create_id + rdma_resolve_addr + rdma_resolve_route).
	ResolveAddr(ctx context.Context, src netip.Addr, dst netip.AddrPort) (ConnID, error)
	// Listen starts listening for connection requests on addr (rdma_bind_addr + rdma_listen).
	// An unspecified address listens on every local address (dual-stack for "::").
	Listen(addr netip.AddrPort, backlog int) (Listener, error)
}

// DeviceInfo names a device and the network interface it stands for.
type DeviceInfo struct {
	Name      string // device name, as shown in hca_name
	Interface string // network interface the device serves
}

// DeviceAttr are the device limits (ibv_query_device).
type DeviceAttr struct {
	MaxQPWR               int    // max_qp_wr
	MaxSGE                int    // max_sge
	MaxCQE                int    // max_cqe
	MaxMRSize             uint64 // max_mr_size
	MaxFastRegPageListLen int    // max_fast_reg_page_list_len
	MaxMsgSize            uint32 // largest single message or RDMA operation
	PhysPortCnt           int    // phys_port_cnt
	// SyncLocalOps: LOCAL_INV and REG_MR take effect before PostSend returns (their
	// completions only report it). A consumer that waits for a key to die may then go on at
	// once; on an HCA, which executes them later, it must wait for the completion.
	SyncLocalOps bool
	// MapRegisteredOnly: MR.Map takes only memory inside a region registered on the same PD
	// with local write (userspace verbs bind a memory window over a registered region; there
	// is no registration of arbitrary pages by work request). A consumer whose buffers come
	// from elsewhere stages them in registered memory.
	MapRegisteredOnly bool
}

// PortAttr describes a device port (ibv_query_port).
type PortAttr struct {
	State     PortState
	LinkLayer string // "Ethernet" or "InfiniBand"
	MTU       int
	// GIDs are the port's valid GID table entries (ibv_query_gid), in table order; a RoCE
	// GID is the IPv6 or IPv4-mapped address of the interface. Empty where the provider has
	// no GID table.
	GIDs []netip.Addr
}

// PortState is a port's logical state.
type PortState int

// Port states (enum ibv_port_state, the ones a provider reports).
const (
	PortDown   PortState = 1
	PortActive PortState = 4
)

// Device is an opened device (ibv_context).
type Device interface {
	Name() string
	Query() DeviceAttr
	QueryPort(port int) (PortAttr, error)
	AllocPD() (PD, error)
	// CreateCQ creates a completion queue with room for at least cqe completions.
	CreateCQ(cqe int) (CQ, error)
	Close() error
}

// PD is a protection domain (ibv_pd). A queue pair may only touch memory regions of its own PD.
type PD interface {
	Device() Device
	// RegMR registers caller-provided memory (ibv_reg_mr). buf must stay alive and unmoved
	// until Dereg; the provider may read and write it at any time while a key is valid.
	RegMR(buf []byte, access Access) (MR, error)
	// AllocMR allocates and registers length bytes owned by the provider (for a provider
	// whose memory must live outside the Go heap).
	AllocMR(length int, access Access) (MR, error)
	// RegFileMR registers length bytes of file f from offset off (ibv_reg_dmabuf_mr: memory
	// named by a file descriptor instead of an address). The region keeps its own reference
	// to the file, so f may be closed after. It is a local source for SENDs and RDMA WRITEs,
	// which a provider may feed to the wire straight from the file (the page cache's pages,
	// not a copy of them); it has no Bytes, and a provider refuses the access it cannot give.
	// If the file shrinks under a request that is sending from it, the connection fails.
	RegFileMR(f *os.File, off int64, length int, access Access) (MR, error)
	// AllocFastRegMR allocates an MR with no memory and no valid key, of at most maxLen
	// bytes, to be mapped with MR.Map and made valid by an OpRegMR work request
	// (ib_alloc_mr + ib_map_mr_sg). flags say how its keys will be used; see FastRegFlags.
	AllocFastRegMR(maxLen int, flags FastRegFlags) (MR, error)
	Dealloc() error
}

// MR is a memory region.
type MR interface {
	// LKey is the local key that SGEs name; RKey is the key a peer names. Both change on
	// re-registration.
	LKey() uint32
	RKey() uint32
	// Addr is the region's I/O virtual address: offsets into Bytes start there.
	Addr() uint64
	// Len is the region's length in bytes.
	Len() int
	// Bytes is the registered memory.
	Bytes() []byte
	// Access is the current access of the region.
	Access() Access
	// Valid reports whether the keys currently grant access (false after invalidation).
	Valid() bool
	// Map points a fast-registration MR at buf with the given I/O virtual address; the MR
	// must be invalid. The next OpRegMR makes it valid. A provider that cannot choose the
	// address (a memory window covers its memory at the memory's own virtual address) uses
	// its own: Addr after Map is the address that SGEs and peers name.
	Map(buf []byte, iova uint64) error
	// Dereg deregisters the region (ibv_dereg_mr); later accesses with its keys fail.
	Dereg() error
}

// FastRegFlags say how a fast-registration MR's keys are used. Userspace verbs emulate
// fast registration with memory windows, whose two types cannot do everything an HCA's
// fast-registration MR does, so the consumer says which it needs.
type FastRegFlags uint8

const (
	// FastRegRemoteInv: the key serves only the QP that posts the region's REG_MR, and that
	// QP's peer may invalidate it with SEND_WITH_INV (a type 2 memory window). Without it the
	// key serves every QP of the PD and only a local LOCAL_INV invalidates it (a type 1
	// window); a SEND_WITH_INV naming it is a remote invalid request.
	FastRegRemoteInv FastRegFlags = 1 << 0
)

// Access are memory access rights (enum ibv_access_flags).
type Access uint32

// Access flags.
const (
	AccessLocalWrite  Access = 1 << 0
	AccessRemoteWrite Access = 1 << 1
	AccessRemoteRead  Access = 1 << 2
)

func (a Access) String() string {
	s := ""
	for _, f := range []struct {
		bit  Access
		name string
	}{{AccessLocalWrite, "LOCAL_WRITE"}, {AccessRemoteWrite, "REMOTE_WRITE"}, {AccessRemoteRead, "REMOTE_READ"}} {
		if a&f.bit != 0 {
			if s != "" {
				s += "|"
			}
			s += f.name
		}
	}
	if s == "" {
		return "0"
	}
	return s
}

// IncKey returns key with its low 8 bits (the consumer-owned key byte) incremented, as
// ib_inc_rkey does before a fast re-registration.
func IncKey(key uint32) uint32 {
	return key&0xffffff00 | (key+1)&0xff
}

// SGE is one scatter/gather element (ibv_sge): Length bytes at Addr inside the MR named by LKey.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// SGEOf returns an SGE covering length bytes at offset off of mr.
func SGEOf(mr MR, off, length int) SGE {
	return SGE{Addr: mr.Addr() + uint64(off), Length: uint32(length), LKey: mr.LKey()}
}

// Opcode is a send queue work request opcode (enum ibv_wr_opcode / ib_wr_opcode).
type Opcode uint8

// Send queue opcodes.
const (
	OpRDMAWrite Opcode = iota
	OpRDMAWriteWithImm
	OpSend
	OpSendWithImm
	OpRDMARead
	OpSendWithInv
	OpLocalInv
	OpRegMR
)

var opNames = [...]string{"RDMA_WRITE", "RDMA_WRITE_WITH_IMM", "SEND", "SEND_WITH_IMM", "RDMA_READ", "SEND_WITH_INV", "LOCAL_INV", "REG_MR"}

func (o Opcode) String() string {
	if int(o) < len(opNames) {
		return opNames[o]
	}
	return fmt.Sprintf("Opcode(%d)", uint8(o))
}

// SendFlags modify a send work request (enum ibv_send_flags).
type SendFlags uint8

// Send flags.
const (
	// SendSignaled asks for a completion when the request finishes successfully. Failed
	// requests always complete.
	SendSignaled SendFlags = 1 << 0
	// SendSolicited sets the solicited-event bit on a SEND (carried, informational).
	SendSolicited SendFlags = 1 << 1
)

// SendWR is a send queue work request (ibv_send_wr). Which fields matter depends on Opcode:
// RemoteAddr/RKey for RDMA ops; Imm for *_WITH_IMM; InvRKey for SEND_WITH_INV and LOCAL_INV;
// MR/Key/Access for REG_MR.
type SendWR struct {
	ID         uint64
	Opcode     Opcode
	Flags      SendFlags
	SGList     []SGE
	Imm        uint32 // immediate data, host order (providers put it on the wire big-endian)
	RemoteAddr uint64
	RKey       uint32
	InvRKey    uint32 // key to invalidate (remote for SEND_WITH_INV, local for LOCAL_INV)
	MR         MR     // REG_MR: the region to make valid
	Key        uint32 // REG_MR: the new key (same index, new low byte; see IncKey)
	Access     Access // REG_MR: access to grant
}

// RecvWR is a receive queue work request (ibv_recv_wr).
type RecvWR struct {
	ID     uint64
	SGList []SGE
}

// WCOpcode is the kind of work a completion reports (enum ibv_wc_opcode).
type WCOpcode uint8

// Completion opcodes.
const (
	WCSend WCOpcode = iota
	WCRDMAWrite
	WCRDMARead
	WCLocalInv
	WCRegMR
	WCRecv
	WCRecvRDMAWithImm
)

var wcOpNames = [...]string{"SEND", "RDMA_WRITE", "RDMA_READ", "LOCAL_INV", "REG_MR", "RECV", "RECV_RDMA_WITH_IMM"}

func (o WCOpcode) String() string {
	if int(o) < len(wcOpNames) {
		return wcOpNames[o]
	}
	return fmt.Sprintf("WCOpcode(%d)", uint8(o))
}

// WCStatus is a completion status (enum ibv_wc_status).
type WCStatus uint8

// Completion statuses, with ibverbs' numeric values.
const (
	WCSuccess        WCStatus = 0
	WCLocLenErr      WCStatus = 1
	WCLocQPOpErr     WCStatus = 2
	WCLocProtErr     WCStatus = 4
	WCFlushErr       WCStatus = 5
	WCMWBindErr      WCStatus = 6
	WCBadRespErr     WCStatus = 7
	WCLocAccessErr   WCStatus = 8
	WCRemInvReqErr   WCStatus = 9
	WCRemAccessErr   WCStatus = 10
	WCRemOpErr       WCStatus = 11
	WCRetryExcErr    WCStatus = 12
	WCRNRRetryExcErr WCStatus = 13
	WCFatalErr       WCStatus = 19
	WCGeneralErr     WCStatus = 21
)

var wcStatusNames = map[WCStatus]string{
	WCSuccess: "success", WCLocLenErr: "local length error", WCLocQPOpErr: "local QP operation error",
	WCLocProtErr: "local protection error", WCFlushErr: "Work Request Flushed Error",
	WCMWBindErr: "memory window bind error", WCBadRespErr: "bad response error",
	WCLocAccessErr: "local access error", WCRemInvReqErr: "remote invalid request error",
	WCRemAccessErr: "remote access error", WCRemOpErr: "remote operation error",
	WCRetryExcErr: "transport retry counter exceeded", WCRNRRetryExcErr: "RNR retry counter exceeded",
	WCFatalErr: "fatal error", WCGeneralErr: "general error",
}

// String matches ibv_wc_status_str.
func (s WCStatus) String() string {
	if n, ok := wcStatusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("unknown status %d", uint8(s))
}

// WCFlags qualify a completion (enum ibv_wc_flags).
type WCFlags uint8

// Completion flags.
const (
	WCWithImm WCFlags = 1 << 1
	WCWithInv WCFlags = 1 << 3
)

// WC is a work completion (ibv_wc).
type WC struct {
	ID      uint64
	Status  WCStatus
	Opcode  WCOpcode
	Flags   WCFlags
	ByteLen uint32
	Imm     uint32 // valid with WCWithImm, host order
	InvRKey uint32 // valid with WCWithInv: the local rkey the peer invalidated
	QPNum   uint32
}

// CQ is a completion queue (ibv_cq). Completions of every QP attached to it arrive in order
// per queue.
type CQ interface {
	// Poll moves up to len(wc) completions into wc and returns how many (ibv_poll_cq).
	// Fewer than len(wc) does not promise an empty queue: a provider may hand out what it
	// already holds and look again at the next Poll. Callers poll until Poll returns 0.
	Poll(wc []WC) int
	// Wait blocks until the queue holds a completion, ctx ends, or the queue is destroyed
	// (ibv_req_notify_cq + ibv_get_cq_event, without the re-arm race).
	Wait(ctx context.Context) error
	// SetHandler installs fn as the queue's completion handler, called from a provider
	// goroutine once new completions have been queued (a poll context, as the kernel's
	// IB_POLL_SOFTIRQ; nil removes it). Calls for one queue never overlap and no provider lock
	// is held during them. fn polls the queue itself and may post work requests; it must not
	// block, since it runs on the goroutine that receives from the network.
	SetHandler(fn func())
	// Destroy destroys the queue; waiters return ErrClosed.
	Destroy() error
}

// CallCounter is a provider that calls into a foreign library on the data path (the verbs
// provider, through cgo, whose every call costs a stack switch and, under an emulated CPU, as
// much as the verb itself). DataPathCalls is how many such calls its posts, polls and
// completion events have made so far, over all its devices; a benchmark divides the
// difference of two readings by the operations between them.
type CallCounter interface {
	DataPathCalls() uint64
}

// BusyPoller is a CQ that can spin for completions inside the provider. A caller that
// busy-polls anyway (a latency tool, a dedicated polling core) then pays for one call into
// the provider per completion instead of one per empty poll, which matters where that call
// is expensive (cgo). Providers whose Poll is a plain Go call need not implement it.
type BusyPoller interface {
	// PollBusy polls as Poll does, again and again until it finds a completion or has
	// found the queue empty spins times, and returns as Poll. It holds the queue while it
	// spins (other Polls of it wait): for a caller that owns the queue, with spins bounded.
	PollBusy(wc []WC, spins int) int
}

// QPState is a queue pair state (enum ibv_qp_state).
type QPState int

// Queue pair states.
const (
	QPSReset QPState = iota
	QPSInit
	QPSRTR
	QPSRTS
	QPSSQD
	QPSSQE
	QPSErr
)

var qpStateNames = [...]string{"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"}

func (s QPState) String() string {
	if int(s) < len(qpStateNames) {
		return qpStateNames[s]
	}
	return fmt.Sprintf("QPState(%d)", int(s))
}

// QPInitAttr creates a reliable-connected queue pair (ibv_qp_init_attr).
type QPInitAttr struct {
	SendCQ, RecvCQ CQ
	MaxSendWR      int
	MaxRecvWR      int
	MaxSendSGE     int
	MaxRecvSGE     int
}

// QP is a reliable-connected queue pair (ibv_qp).
type QP interface {
	Num() uint32
	State() QPState
	// PostSend posts a chain of send work requests (ibv_post_send). On error, bad is the index
	// of the first request not posted; the ones before it were posted.
	PostSend(wrs []SendWR) (bad int, err error)
	// PostRecv posts receive work requests (ibv_post_recv); allowed before the connection is
	// established.
	PostRecv(wrs []RecvWR) (bad int, err error)
	// ToError moves the queue pair to the error state: outstanding work completes with
	// WCFlushErr (ibv_modify_qp to IBV_QPS_ERR, as ib_drain_qp starts with).
	ToError()
}

// Plugger is implemented by queue pairs that can hold back the frames of posted work
// requests and send them together, as a driver rings one doorbell for a list of work
// requests. Plugs nest; the last Unplug sends what was held. Work requests are executed and
// completed as usual, only their transmission waits.
type Plugger interface {
	Plug()
	Unplug()
}

// ConnParam is what connect and accept carry (rdma_conn_param).
type ConnParam struct {
	PrivateData []byte
	// RNRRetryCount: how many times a SEND from the peer is retried when no receive is posted
	// here; 7 retries for ever (as in IB).
	RNRRetryCount uint8
	// RetryCount is the transport retry count (informational for providers over TCP).
	RetryCount uint8
}

// MaxPrivateData is the most private data a provider must carry in connect, accept and reject.
const MaxPrivateData = 196

// AddrGroup is what per-address bounds count a peer address as: the address itself, or for
// IPv6 its /64, since one host has a whole /64 to pick source addresses from.
func AddrGroup(a netip.Addr) netip.Addr {
	a = a.Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.Addr()
	}
	return a
}

// Authenticated is implemented by a connection identifier whose provider authenticated the
// peer (the soft provider with TLS); PeerSubject is the subject of the peer's certificate.
type Authenticated interface {
	PeerSubject() string
}

// ConnID is a connection identifier (rdma_cm_id).
type ConnID interface {
	// Device is the local device this identifier is bound to.
	Device() Device
	// Port is the device port in use.
	Port() int
	// LocalAddr and RemoteAddr are the resolved addresses (rdma_get_local_addr / _peer_addr).
	LocalAddr() netip.AddrPort
	RemoteAddr() netip.AddrPort
	// CreateQP creates the identifier's queue pair on pd (rdma_create_qp).
	CreateQP(pd PD, attr QPInitAttr) (QP, error)
	QP() QP
	// Connect connects to the resolved destination (rdma_connect) and waits for the peer to
	// accept, returning the peer's private data. A reject returns *RejectError with the
	// rejecting side's private data.
	Connect(ctx context.Context, p ConnParam) ([]byte, error)
	// Accept accepts a connection request (rdma_accept) and waits until it is established.
	Accept(ctx context.Context, p ConnParam) error
	// Reject rejects a connection request with private data (rdma_reject).
	Reject(privateData []byte) error
	// Events delivers the identifier's events after establishment: EventDisconnected once the
	// connection is gone (peer or local disconnect, or transport failure).
	Events() <-chan CMEvent
	// Disconnect moves the queue pair to error (outstanding work flushes) and tells the peer
	// (rdma_disconnect).
	Disconnect() error
	// Destroy disconnects if needed, destroys the queue pair and releases the identifier
	// (rdma_destroy_qp + rdma_destroy_id). It waits for the provider's own goroutines.
	Destroy() error
}

// Listener accepts connection requests (a listening rdma_cm_id).
type Listener interface {
	// Accept returns the next connection request (an RDMA_CM_EVENT_CONNECT_REQUEST). The
	// caller answers it with ConnID.Accept or ConnID.Reject.
	Accept(ctx context.Context) (*ConnRequest, error)
	Addr() netip.AddrPort
	Close() error
}

// ConnRequest is an incoming connection request.
type ConnRequest struct {
	ID          ConnID
	PrivateData []byte
}

// CMEventType is a connection manager event (enum rdma_cm_event_type).
type CMEventType int

// Connection manager events.
const (
	EventAddrResolved CMEventType = iota
	EventAddrError
	EventRouteResolved
	EventRouteError
	EventConnectRequest
	EventConnectResponse
	EventConnectError
	EventUnreachable
	EventRejected
	EventEstablished
	EventDisconnected
	EventDeviceRemoval
	EventMulticastJoin
	EventMulticastError
	EventAddrChange
	EventTimewaitExit
)

var cmEventNames = [...]string{"ADDR_RESOLVED", "ADDR_ERROR", "ROUTE_RESOLVED", "ROUTE_ERROR",
	"CONNECT_REQUEST", "CONNECT_RESPONSE", "CONNECT_ERROR", "UNREACHABLE", "REJECTED",
	"ESTABLISHED", "DISCONNECTED", "DEVICE_REMOVAL", "MULTICAST_JOIN", "MULTICAST_ERROR",
	"ADDR_CHANGE", "TIMEWAIT_EXIT"}

func (t CMEventType) String() string {
	if int(t) >= 0 && int(t) < len(cmEventNames) {
		return cmEventNames[t]
	}
	return fmt.Sprintf("CMEvent(%d)", int(t))
}

// CMEvent is one connection manager event.
type CMEvent struct {
	Type CMEventType
	// Err says why, for DISCONNECTED after a transport failure (nil after an orderly disconnect).
	Err error
}

// DefaultConnectTimeout bounds connection establishment when the caller's context has no
// deadline (RTRS_CONNECT_TIMEOUT_MS).
const DefaultConnectTimeout = 30 * time.Second
