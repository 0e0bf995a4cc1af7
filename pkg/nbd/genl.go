package nbd

// Generic netlink, as much of it as attaching NBD devices needs: messages and attributes
// encoded and decoded by hand, a socket whose every exchange is bounded in time, and the
// family lookup (CTRL_CMD_GETFAMILY). Numbers are those of <linux/netlink.h>,
// <linux/genetlink.h> and <linux/nbd-netlink.h>.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Netlink and generic netlink constants.
const (
	nlmsgHdrLen  = 16
	genlHdrLen   = 4
	nlaHdrLen    = 4
	nlaFNested   = 0x8000
	nlaTypeMask  = 0x3fff // without NLA_F_NESTED and NLA_F_NET_BYTEORDER
	nlmsgError   = 2      // NLMSG_ERROR
	nlmsgDone    = 3      // NLMSG_DONE
	nlmFRequest  = 0x1
	nlmFAck      = 0x4
	nlmFCapped   = 0x100 // NLM_F_CAPPED: the error carries only the request's header
	nlmFAckTLVs  = 0x200 // NLM_F_ACK_TLVS: extended ack attributes follow
	nlmsgerrMsg  = 1     // NLMSGERR_ATTR_MSG
	genlIDCtrl   = 0x10  // GENL_ID_CTRL
	ctrlCmdGetFa = 3     // CTRL_CMD_GETFAMILY
	ctrlAFamID   = 1     // CTRL_ATTR_FAMILY_ID
	ctrlAFamName = 2     // CTRL_ATTR_FAMILY_NAME
	ctrlAVersion = 3     // CTRL_ATTR_VERSION
)

// The kernel's NBD family (<linux/nbd-netlink.h>).
const (
	nbdFamily  = "nbd"
	nbdVersion = 1

	nbdCmdConnect     = 1
	nbdCmdDisconnect  = 2
	nbdCmdReconfigure = 3
	nbdCmdStatus      = 5

	nbdAttrIndex           = 1
	nbdAttrSizeBytes       = 2
	nbdAttrBlockSizeBytes  = 3
	nbdAttrTimeout         = 4
	nbdAttrServerFlags     = 5
	nbdAttrClientFlags     = 6
	nbdAttrSockets         = 7
	nbdAttrDeadConnTimeout = 8
	nbdAttrDeviceList      = 9
	nbdAttrBackend         = 10

	nbdSockItem = 1
	nbdSockFD   = 1

	nbdDeviceItem      = 1
	nbdDeviceIndex     = 1
	nbdDeviceConnected = 2
)

// Client flags of NBD_ATTR_CLIENT_FLAGS.
const (
	CFlagDestroyOnDisconnect = 1 << 0
	CFlagDisconnectOnClose   = 1 << 1
)

var nle = binary.NativeEndian // netlink is in host byte order

// nlMsg builds one netlink message: the header, then whatever is appended.
type nlMsg struct{ b []byte }

func newGenlMsg(family uint16, cmd, version uint8) *nlMsg {
	b := make([]byte, nlmsgHdrLen+genlHdrLen, 256)
	nle.PutUint16(b[4:], family)
	nle.PutUint16(b[6:], nlmFRequest|nlmFAck)
	b[nlmsgHdrLen] = cmd
	b[nlmsgHdrLen+1] = version
	return &nlMsg{b: b}
}

func nlaAlign(n int) int { return (n + 3) &^ 3 }

func (m *nlMsg) attr(typ uint16, data []byte) {
	start := len(m.b)
	m.b = nle.AppendUint16(m.b, uint16(nlaHdrLen+len(data)))
	m.b = nle.AppendUint16(m.b, typ)
	m.b = append(m.b, data...)
	for len(m.b)-start < nlaAlign(nlaHdrLen+len(data)) {
		m.b = append(m.b, 0)
	}
}

func (m *nlMsg) u32(typ uint16, v uint32) { m.attr(typ, nle.AppendUint32(nil, v)) }
func (m *nlMsg) u64(typ uint16, v uint64) { m.attr(typ, nle.AppendUint64(nil, v)) }
func (m *nlMsg) str(typ uint16, s string) { m.attr(typ, append([]byte(s), 0)) }

// nest opens a nested attribute; the returned function closes it.
func (m *nlMsg) nest(typ uint16) (end func()) {
	start := len(m.b)
	m.b = nle.AppendUint16(m.b, 0)
	m.b = nle.AppendUint16(m.b, typ|nlaFNested)
	return func() { nle.PutUint16(m.b[start:], uint16(len(m.b)-start)) }
}

// bytes finishes the message with its length and sequence number.
func (m *nlMsg) bytes(seq uint32) []byte {
	nle.PutUint32(m.b[0:], uint32(len(m.b)))
	nle.PutUint32(m.b[8:], seq)
	return m.b
}

// nlAttr is one decoded attribute.
type nlAttr struct {
	typ  uint16 // without the flag bits
	data []byte
}

var errMalformed = fmt.Errorf("nbd: malformed netlink message: %w", syscall.EBADMSG)

// parseAttrs splits a run of attributes; any length that does not fit is an error.
func parseAttrs(b []byte) ([]nlAttr, error) {
	var out []nlAttr
	for len(b) > 0 {
		if len(b) < nlaHdrLen {
			return nil, errMalformed
		}
		n := int(nle.Uint16(b))
		if n < nlaHdrLen || n > len(b) {
			return nil, errMalformed
		}
		out = append(out, nlAttr{typ: nle.Uint16(b[2:]) & nlaTypeMask, data: b[nlaHdrLen:n]})
		b = b[min(nlaAlign(n), len(b)):]
	}
	return out, nil
}

func findAttr(attrs []nlAttr, typ uint16) ([]byte, bool) {
	for _, a := range attrs {
		if a.typ == typ {
			return a.data, true
		}
	}
	return nil, false
}

func attrU32(attrs []nlAttr, typ uint16) (uint32, bool) {
	d, ok := findAttr(attrs, typ)
	if !ok || len(d) < 4 {
		return 0, false
	}
	return nle.Uint32(d), true
}

func attrU16(attrs []nlAttr, typ uint16) (uint16, bool) {
	d, ok := findAttr(attrs, typ)
	if !ok || len(d) < 2 {
		return 0, false
	}
	return nle.Uint16(d), true
}

// nlReply is one message of an answer.
type nlReply struct {
	typ, flags uint16
	seq        uint32
	payload    []byte
}

// splitMsgs splits a datagram into its netlink messages.
func splitMsgs(b []byte) ([]nlReply, error) {
	var out []nlReply
	for len(b) > 0 {
		if len(b) < nlmsgHdrLen {
			return nil, errMalformed
		}
		n := int(nle.Uint32(b))
		if n < nlmsgHdrLen || n > len(b) {
			return nil, errMalformed
		}
		out = append(out, nlReply{typ: nle.Uint16(b[4:]), flags: nle.Uint16(b[6:]), seq: nle.Uint32(b[8:]), payload: b[nlmsgHdrLen:n]})
		b = b[min(nlaAlign(n), len(b)):]
	}
	return out, nil
}

// ackError decodes an NLMSG_ERROR payload: nil for an ACK, else the errno with the
// extended ack's message when there is one.
func ackError(r nlReply) error {
	if len(r.payload) < 4 {
		return errMalformed
	}
	code := int32(nle.Uint32(r.payload))
	if code == 0 {
		return nil
	}
	if code > 0 || code < -4095 {
		return errMalformed
	}
	err := syscall.Errno(-code)
	if r.flags&nlmFAckTLVs != 0 {
		// After the error: the request's header (whole request unless capped), then TLVs.
		off := 4 + nlmsgHdrLen
		if r.flags&nlmFCapped == 0 && len(r.payload) >= 4+4 {
			off = 4 + nlaAlign(int(nle.Uint32(r.payload[4:])))
		}
		if off <= len(r.payload) {
			if attrs, perr := parseAttrs(r.payload[off:]); perr == nil {
				if m, ok := findAttr(attrs, nlmsgerrMsg); ok {
					return fmt.Errorf("%s: %w", strings.TrimRight(string(m), "\x00"), err)
				}
			}
		}
	}
	return err
}

// genlReply strips the generic netlink header from a reply's payload and returns its
// command and attributes.
func genlReply(p []byte) (cmd uint8, attrs []nlAttr, err error) {
	if len(p) < genlHdrLen {
		return 0, nil, errMalformed
	}
	attrs, err = parseAttrs(p[genlHdrLen:])
	return p[0], attrs, err
}

// exchanger sends one request and returns the payloads of the messages that answered it
// (before the ACK); a failed request is the errno of its NLMSG_ERROR.
type exchanger interface {
	exchange(ctx context.Context, req []byte) ([][]byte, error)
	Close() error
}

// genlSock is a NETLINK_GENERIC socket with timeouts on every send and receive.
type genlSock struct {
	fd      int
	seq     atomic.Uint32
	timeout time.Duration
}

// errTimeout is what an exchange that got no answer in time returns.
var errTimeout = fmt.Errorf("nbd: no netlink answer in time: %w", syscall.ETIMEDOUT)

func openGenl(timeout time.Duration) (*genlSock, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_GENERIC)
	if err != nil {
		return nil, os.NewSyscallError("socket(AF_NETLINK)", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("bind(AF_NETLINK)", err)
	}
	// Extended acks carry the kernel's message; capped, they do not echo the request.
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
	s := &genlSock{fd: fd, timeout: timeout}
	s.seq.Store(uint32(time.Now().UnixNano()))
	return s, nil
}

func (s *genlSock) Close() error { return unix.Close(s.fd) }

// setTimeout bounds the next blocking send or receive by the context's deadline and the
// socket's own timeout, whichever comes first.
func (s *genlSock) setTimeout(ctx context.Context, opt int) error {
	d := s.timeout
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(dl))
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if d <= 0 {
		return errTimeout
	}
	tv := unix.NsecToTimeval(max(d.Nanoseconds(), int64(time.Millisecond)))
	return unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, opt, &tv)
}

func (s *genlSock) exchange(ctx context.Context, req []byte) ([][]byte, error) {
	seq := s.seq.Add(1)
	nle.PutUint32(req[8:], seq)
	if err := s.setTimeout(ctx, unix.SO_SNDTIMEO); err != nil {
		return nil, err
	}
	for {
		err := unix.Sendto(s.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			return nil, errTimeout
		}
		if err != nil {
			return nil, os.NewSyscallError("sendto(netlink)", err)
		}
		break
	}
	var out [][]byte
	buf := make([]byte, 64<<10)
	for {
		if err := s.setTimeout(ctx, unix.SO_RCVTIMEO); err != nil {
			return nil, err
		}
		n, _, err := unix.Recvfrom(s.fd, buf, 0)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			return nil, errTimeout
		}
		if err != nil {
			return nil, os.NewSyscallError("recvfrom(netlink)", err)
		}
		msgs, err := splitMsgs(buf[:n])
		if err != nil {
			return nil, err
		}
		done, err := collect(msgs, seq, &out)
		if done {
			return out, err
		}
	}
}

// collect takes the messages answering request seq (others are stale answers and are
// dropped); done says the answer is complete: the ACK or the error came.
func collect(msgs []nlReply, seq uint32, out *[][]byte) (done bool, err error) {
	for _, m := range msgs {
		if m.seq != seq {
			continue
		}
		switch m.typ {
		case nlmsgError:
			return true, ackError(m)
		case nlmsgDone:
			return true, nil
		default:
			*out = append(*out, append([]byte(nil), m.payload...))
		}
	}
	return false, nil
}

// genlFamily resolves a generic netlink family's id and version; ENOENT when the kernel
// has no such family.
func genlFamily(ctx context.Context, x exchanger, name string) (id uint16, version uint32, err error) {
	m := newGenlMsg(genlIDCtrl, ctrlCmdGetFa, 2)
	m.str(ctrlAFamName, name)
	replies, err := x.exchange(ctx, m.bytes(0))
	if err != nil {
		return 0, 0, err
	}
	for _, p := range replies {
		_, attrs, err := genlReply(p)
		if err != nil {
			return 0, 0, err
		}
		if id, ok := attrU16(attrs, ctrlAFamID); ok {
			version, _ := attrU32(attrs, ctrlAVersion)
			return id, version, nil
		}
	}
	return 0, 0, fmt.Errorf("nbd: no id for family %q in the answer: %w", name, syscall.EBADMSG)
}

// connectReq is what NBD_CMD_CONNECT carries.
type connectReq struct {
	index       int // < 0: any free device
	size        uint64
	blockSize   uint64
	timeout     uint64 // seconds; 0: not sent
	serverFlags uint64
	clientFlags uint64
	fds         []int
	deadConn    uint64 // seconds; 0: not sent
	backend     string // "": not sent
}

func encodeConnect(family uint16, r connectReq) []byte {
	m := newGenlMsg(family, nbdCmdConnect, nbdVersion)
	if r.index >= 0 {
		m.u32(nbdAttrIndex, uint32(r.index))
	}
	m.u64(nbdAttrSizeBytes, r.size)
	m.u64(nbdAttrBlockSizeBytes, r.blockSize)
	if r.timeout > 0 {
		m.u64(nbdAttrTimeout, r.timeout)
	}
	m.u64(nbdAttrServerFlags, r.serverFlags)
	m.u64(nbdAttrClientFlags, r.clientFlags)
	if r.deadConn > 0 {
		m.u64(nbdAttrDeadConnTimeout, r.deadConn)
	}
	end := m.nest(nbdAttrSockets)
	for _, fd := range r.fds {
		endItem := m.nest(nbdSockItem)
		m.u32(nbdSockFD, uint32(fd))
		endItem()
	}
	end()
	if r.backend != "" {
		m.str(nbdAttrBackend, r.backend)
	}
	return m.bytes(0)
}

// encodeResize is NBD_CMD_RECONFIGURE of device index to size bytes. The kernel takes it
// only with the backend name the device was connected with.
func encodeResize(family uint16, index int, size uint64, backend string) []byte {
	m := newGenlMsg(family, nbdCmdReconfigure, nbdVersion)
	m.u32(nbdAttrIndex, uint32(index))
	m.u64(nbdAttrSizeBytes, size)
	if backend != "" {
		m.str(nbdAttrBackend, backend)
	}
	return m.bytes(0)
}

// decodeConnectReply finds NBD_ATTR_INDEX in CONNECT's answer.
func decodeConnectReply(replies [][]byte) (int, error) {
	for _, p := range replies {
		cmd, attrs, err := genlReply(p)
		if err != nil {
			return 0, err
		}
		if cmd != nbdCmdConnect {
			continue
		}
		if idx, ok := attrU32(attrs, nbdAttrIndex); ok {
			return int(idx), nil
		}
	}
	return 0, fmt.Errorf("nbd: CONNECT answered without an index: %w", syscall.EBADMSG)
}

func encodeIndexCmd(family uint16, cmd uint8, index int) []byte {
	m := newGenlMsg(family, cmd, nbdVersion)
	if index >= 0 {
		m.u32(nbdAttrIndex, uint32(index))
	}
	return m.bytes(0)
}

// DeviceStatus is one device of NBD_CMD_STATUS's answer.
type DeviceStatus struct {
	Index     int
	Connected bool
}

func decodeStatusReply(replies [][]byte) ([]DeviceStatus, error) {
	var out []DeviceStatus
	for _, p := range replies {
		cmd, attrs, err := genlReply(p)
		if err != nil {
			return nil, err
		}
		if cmd != nbdCmdStatus {
			continue
		}
		list, ok := findAttr(attrs, nbdAttrDeviceList)
		if !ok {
			continue
		}
		items, err := parseAttrs(list)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			if it.typ != nbdDeviceItem {
				continue
			}
			dev, err := parseAttrs(it.data)
			if err != nil {
				return nil, err
			}
			idx, ok := attrU32(dev, nbdDeviceIndex)
			if !ok {
				return nil, errMalformed
			}
			c, _ := findAttr(dev, nbdDeviceConnected)
			out = append(out, DeviceStatus{Index: int(idx), Connected: len(c) > 0 && c[0] != 0})
		}
	}
	return out, nil
}

// kernelNBD talks to the kernel's NBD family.
type kernelNBD struct {
	x      exchanger
	family uint16
}

// errNoNBD: the kernel has no NBD family (module not loaded and not loadable).
var errNoNBD = errors.New("nbd: the kernel has no generic netlink family \"nbd\" (is the nbd module loaded? modprobe nbd)")

// openKernelNBD opens a generic netlink socket and resolves the NBD family.
func openKernelNBD(ctx context.Context, timeout time.Duration) (*kernelNBD, error) {
	s, err := openGenl(timeout)
	if err != nil {
		return nil, err
	}
	k, err := newKernelNBD(ctx, s)
	if err != nil {
		s.Close()
		return nil, err
	}
	return k, nil
}

func newKernelNBD(ctx context.Context, x exchanger) (*kernelNBD, error) {
	id, _, err := genlFamily(ctx, x, nbdFamily)
	if errors.Is(err, syscall.ENOENT) {
		return nil, fmt.Errorf("%w: %w", errNoNBD, syscall.ENODEV)
	}
	if err != nil {
		return nil, fmt.Errorf("nbd: resolving the netlink family: %w", err)
	}
	return &kernelNBD{x: x, family: id}, nil
}

func (k *kernelNBD) Close() error { return k.x.Close() }

func (k *kernelNBD) connect(ctx context.Context, r connectReq) (int, error) {
	replies, err := k.x.exchange(ctx, encodeConnect(k.family, r))
	if err != nil {
		return -1, err
	}
	return decodeConnectReply(replies)
}

func (k *kernelNBD) disconnect(ctx context.Context, index int) error {
	_, err := k.x.exchange(ctx, encodeIndexCmd(k.family, nbdCmdDisconnect, index))
	return err
}

func (k *kernelNBD) resize(ctx context.Context, index int, size uint64, backend string) error {
	_, err := k.x.exchange(ctx, encodeResize(k.family, index, size, backend))
	return err
}

func (k *kernelNBD) status(ctx context.Context, index int) ([]DeviceStatus, error) {
	replies, err := k.x.exchange(ctx, encodeIndexCmd(k.family, nbdCmdStatus, index))
	if err != nil {
		return nil, err
	}
	return decodeStatusReply(replies)
}
