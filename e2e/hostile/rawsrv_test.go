// Package hostile tests the client against a hostile RTRS/RNBD server: one speaking the soft
// provider's frames over plain TCP by hand (docs/soft-rdma.md), so that a test controls every
// byte and every moment, what the real server and the soft QP never send (a frame cut half
// way, an answer before its data, limits of one block, a request never answered). Each test
// asserts what the client does instead of being harmed (docs/security.md, the client).
package hostile

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// soft frame opcodes (pkg/rdma/soft/wire.go)
const (
	fConnReq  = 1
	fConnAcc  = 2
	fConnRTU  = 4
	fSend     = 10
	fSendImm  = 11
	fSendInv  = 12
	fWrite    = 13
	fWriteImm = 14
	fReadReq  = 15
	fReadResp = 16
	fAck      = 17
	fTerm     = 18
	fDisc     = 19

	flagAckReq = 1 << 1
	hdrLen     = 40
	cmMagic    = 0x534f465452444d41
)

type frame struct {
	op    uint8
	flags uint8
	len   uint32
	seq   uint64
	ack   uint64
	imm   uint32
	rkey  uint32
	addr  uint64
}

func (h frame) bytes() []byte {
	b := make([]byte, hdrLen)
	b[0], b[1] = h.op, h.flags
	binary.BigEndian.PutUint32(b[4:], h.len)
	binary.BigEndian.PutUint64(b[8:], h.seq)
	binary.BigEndian.PutUint64(b[16:], h.ack)
	binary.BigEndian.PutUint32(b[24:], h.imm)
	binary.BigEndian.PutUint32(b[28:], h.rkey)
	binary.BigEndian.PutUint64(b[32:], h.addr)
	return b
}

func parse(b []byte) frame {
	return frame{op: b[0], flags: b[1], len: binary.BigEndian.Uint32(b[4:]), seq: binary.BigEndian.Uint64(b[8:]),
		ack: binary.BigEndian.Uint64(b[16:]), imm: binary.BigEndian.Uint32(b[24:]), rkey: binary.BigEndian.Uint32(b[28:]),
		addr: binary.BigEndian.Uint64(b[32:])}
}

// req is one RTRS request the client sent.
type req struct {
	c      *rconn
	permit uint32
	typ    uint16 // transport.MsgTypeWrite / MsgTypeRead
	usr    []byte
	data   []byte            // WRITE data
	desc   *transport.SgDesc // READ buffer
}

// server is the hostile server's configuration and hooks.
type server struct {
	t   *testing.T
	ln  net.Listener
	rsp transport.MsgConnRsp // what CONN_RSP says
	// info builds the INFO_RSP; nil: one descriptor over all chunks.
	info func(qd, chunk int) []byte
	// onReq handles a request; nil: answer it with success (READ data: zeroes).
	onReq func(r *req)
	// silentHB: do not answer heartbeats.
	silentHB bool

	mu    sync.Mutex
	conns []*rconn
	reqs  chan *req
}

const chunkBase = 0x7000_0000_0000

func newServer(t *testing.T, qd uint16, maxIO uint32) *server {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{t: t, ln: ln, rsp: transport.MsgConnRsp{QueueDepth: qd, MaxIOSize: maxIO, MaxHdrSize: 4096},
		reqs: make(chan *req, 1024)}
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.nc.Close()
		}
		s.mu.Unlock()
	})
	go s.accept()
	return s
}

func (s *server) port() uint16 { return uint16(s.ln.Addr().(*net.TCPAddr).Port) }

func (s *server) chunk() int { return int(s.rsp.MaxIOSize) + int(s.rsp.MaxHdrSize) }

func (s *server) accept() {
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			return
		}
		c := &rconn{s: s, nc: nc, br: bufio.NewReaderSize(nc, 1<<20), seq: 0}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		go c.run()
	}
}

// rconn is one QP's connection, server side.
type rconn struct {
	s       *server
	nc      net.Conn
	br      *bufio.Reader
	wmu     sync.Mutex
	seq     uint64 // our last request seq
	peerSeq uint64 // the client's last request executed
	cid     uint16
	mem     []byte // the chunks, at chunkBase
}

// send writes one of our request frames (seq assigned) and its payload.
func (c *rconn) send(h frame, payload []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.seq++
	h.seq = c.seq
	h.ack = c.peerSeq
	h.len = uint32(len(payload))
	c.nc.Write(append(h.bytes(), payload...))
}

// sendTwo writes a request frame and, in the same write, the header and the first part of
// a WRITE frame announcing n bytes; the rest is sent by the returned function.
func (c *rconn) sendTwo(h1 frame, p1 []byte, h frame, n uint32, first []byte) (rest func(b []byte)) {
	c.wmu.Lock()
	c.seq++
	h1.seq, h1.ack, h1.len = c.seq, c.peerSeq, uint32(len(p1))
	b := append(h1.bytes(), p1...)
	c.seq++
	h.seq, h.ack, h.len = c.seq, c.peerSeq, n
	b = append(append(b, h.bytes()...), first...)
	c.nc.Write(b)
	return func(b []byte) { c.nc.Write(b); c.wmu.Unlock() }
}

func (c *rconn) ackNow() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.nc.Write(frame{op: fAck, ack: c.peerSeq}.bytes())
}

func (c *rconn) run() {
	s := c.s
	var hb [hdrLen]byte
	// CM
	if _, err := io.ReadFull(c.br, hb[:]); err != nil {
		return
	}
	h := parse(hb[:])
	pd := make([]byte, h.len)
	io.ReadFull(c.br, pd)
	var cr transport.MsgConnReq
	if err := cr.Unmarshal(pd); err != nil {
		s.t.Logf("conn req: %v", err)
		return
	}
	c.cid = cr.Cid
	priv := s.rsp.Marshal()
	c.nc.Write(append(frame{op: fConnAcc, len: uint32(len(priv)), imm: 1, addr: cmMagic}.bytes(), priv...))
	if _, err := io.ReadFull(c.br, hb[:]); err != nil || hb[0] != fConnRTU {
		return
	}
	qd := int(s.rsp.QueueDepth)
	c.mem = make([]byte, min(qd*s.chunk(), 64<<20)) // the harness's own bound
	for {
		if _, err := io.ReadFull(c.br, hb[:]); err != nil {
			return
		}
		h := parse(hb[:])
		var payload []byte
		if h.op != fReadReq && h.len > 0 {
			payload = make([]byte, h.len)
			if _, err := io.ReadFull(c.br, payload); err != nil {
				return
			}
		}
		switch h.op {
		case fSend, fSendImm, fSendInv, fWrite, fWriteImm, fReadReq:
			c.wmu.Lock()
			c.peerSeq = h.seq
			c.wmu.Unlock()
		case fDisc:
			c.nc.Close()
			return
		}
		switch h.op {
		case fSend: // INFO_REQ
			var ir transport.MsgInfoReq
			if err := ir.Unmarshal(payload); err != nil {
				s.t.Logf("info req: %v", err)
			}
			var b []byte
			if s.info != nil {
				b = s.info(qd, s.chunk())
			} else {
				b = (&transport.MsgInfoRsp{Desc: []transport.SgDesc{{Addr: chunkBase, Key: 0x100, Len: uint32(qd * s.chunk())}}}).Marshal()
			}
			c.send(frame{op: fSend}, b)
		case fWrite, fWriteImm:
			if h.len > 0 {
				if off := h.addr - chunkBase; off < uint64(len(c.mem)) {
					copy(c.mem[off:], payload)
				}
			}
			if h.op == fWriteImm {
				c.onImm(h.imm)
			}
		}
		if h.flags&flagAckReq != 0 {
			c.ackNow()
		}
	}
}

func (c *rconn) onImm(imm uint32) {
	s := c.s
	typ, payload := transport.ImmFields(imm)
	switch typ {
	case transport.ImmHBMsg:
		if !s.silentHB {
			c.send(frame{op: fWriteImm, imm: transport.ImmHBAckValue}, nil)
		}
		return
	case transport.ImmHBAck:
		return
	case transport.ImmIOReq:
	default:
		s.t.Logf("imm %#x", imm)
		return
	}
	qd := int(s.rsp.QueueDepth)
	id, off := transport.IOReqFields(payload, transport.MemBits(qd))
	if (int(id)+1)*s.chunk() > len(c.mem) {
		return
	}
	ch := c.mem[int(id)*s.chunk():][:s.chunk()]
	typ16 := binary.LittleEndian.Uint16(ch[off:])
	usrLen := int(binary.LittleEndian.Uint16(ch[off+2:]))
	r := &req{c: c, permit: id, typ: typ16}
	if typ16 == transport.MsgTypeWrite {
		r.usr = append([]byte(nil), ch[int(off)-usrLen:off]...)
		r.data = append([]byte(nil), ch[:int(off)-usrLen]...)
	} else {
		var m transport.MsgRdmaRead
		if err := m.Unmarshal(ch[off:]); err != nil {
			s.t.Logf("read hdr: %v", err)
			return
		}
		// the READ's user header begins at chunk + len(data): off - usrLen
		r.usr = append([]byte(nil), ch[int(off)-usrLen:off]...)
		if len(m.Desc) == 1 {
			d := m.Desc[0]
			r.desc = &d
		}
	}
	select {
	case s.reqs <- r:
	default:
	}
	if s.onReq != nil {
		s.onReq(r)
		return
	}
	r.answer(nil, 0)
}

// answer writes data (READ) and sends the response with errno.
func (r *req) answer(data []byte, errno int) {
	if r.desc != nil && len(data) > 0 {
		r.c.send(frame{op: fWrite, rkey: r.desc.Key, addr: r.desc.Addr}, data[:min(len(data), int(r.desc.Len))])
	}
	r.c.send(frame{op: fWriteImm, imm: transport.IORspImm(r.permit, errno, false)}, nil)
}

// rnbdHandler answers SESS_INFO and OPEN as an RNBD server would, with geo; IO goes to io.
func rnbdHandler(geo rnbd.MsgOpenRsp, io func(r *req, m rnbd.MsgIO)) func(r *req) {
	return func(r *req) {
		t, _ := rnbd.PeekType(r.usr)
		switch t {
		case rnbd.MsgTypeSessInfo:
			b := make([]byte, rnbd.SessInfoRspSize)
			rnbd.MsgSessInfo{Ver: 2}.Put(b, rnbd.MsgTypeSessInfoRsp)
			r.answer(b, 0)
		case rnbd.MsgTypeOpen:
			b := make([]byte, rnbd.OpenRspSize)
			geo.Put(b)
			r.answer(b, 0)
		case rnbd.MsgTypeClose:
			r.answer(nil, 0)
		case rnbd.MsgTypeIO:
			var m rnbd.MsgIO
			_ = m.Unmarshal(r.usr)
			if io != nil {
				io(r, m)
			} else {
				r.answer(make([]byte, m.BiSize), 0)
			}
		default:
			r.answer(nil, 0)
		}
	}
}

func dst(t *testing.T) transport.Addr { return dstN(t, 1) }

func dstN(t *testing.T, n int) transport.Addr {
	a, err := transport.ParseAddr(fmt.Sprintf("ip:127.0.0.%d", n))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

var _ = netip.Addr{}
var _ = fmt.Sprint
var _ = time.Second
