package transport

import (
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// Raw soft-provider frames, for a peer the provider's own code would never be (wire.go in
// pkg/rdma/soft lays them out: op, flags, two spare bytes, length, seq, ack, imm, rkey, addr,
// big-endian).
const rawHdr = 40

func rawFrame(b []byte, op uint8, ln uint32, seq, ack uint64, imm, rkey uint32, addr uint64) {
	b[0], b[1], b[2], b[3] = op, 0, 0, 0
	binary.BigEndian.PutUint32(b[4:], ln)
	binary.BigEndian.PutUint64(b[8:], seq)
	binary.BigEndian.PutUint64(b[16:], ack)
	binary.BigEndian.PutUint32(b[24:], imm)
	binary.BigEndian.PutUint32(b[28:], rkey)
	binary.BigEndian.PutUint64(b[32:], addr)
}

// frameConnect connects one raw soft connection with conn_req m and sends the RTU.
func frameConnect(t *testing.T, e *env, m MsgConnReq) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(e.srv.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	pd := m.Marshal()
	b := make([]byte, rawHdr+len(pd))
	rawFrame(b, 1, uint32(len(pd)), 0, 0, 1, 0, 0x534f465452444d41) // CONN_REQ, the provider's magic
	copy(b[rawHdr:], pd)
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var h [rawHdr]byte
	if _, err := io.ReadFull(c, h[:]); err != nil || h[0] != 2 {
		t.Fatalf("accept: op %d %v", h[0], err)
	}
	if _, err := io.ReadFull(c, make([]byte, binary.BigEndian.Uint32(h[4:]))); err != nil {
		t.Fatal(err)
	}
	rawFrame(h[:], 4, 0, 0, 0, 0, 0, 0) // RTU
	if _, err := c.Write(h[:]); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestAckOfUnsentFrames: a client that sends heartbeats, acknowledges the server's answers to
// them without ever reading them (it can count them: one per heartbeat), and never reads its
// socket, must not make the server queue frames for it without bound. An ack of frames not yet
// written is held back, so the send queue fills and bounds them (the heap grew by 1.3 GiB in
// 9 s before).
func TestAckOfUnsentFrames(t *testing.T) {
	leakcheck.Check(t)
	e := newLimitedEnv(t, func(o *ServerOptions) { o.Timings.ZombieTimeout = 60 * time.Second })
	c := frameConnect(t, e, MsgConnReq{Cid: 0, CidNum: 1, SessUUID: uuid.New(), PathsUUID: uuid.New(), FirstConn: true})
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	const lag, batch = 4096, 1024
	buf := make([]byte, batch*rawHdr)
	seq := uint64(0)
	for range 2000 { // two million heartbeats, if the server takes them
		for i := range batch {
			seq++
			ack := uint64(0)
			if seq > lag {
				ack = seq - lag
			}
			rawFrame(buf[i*rawHdr:], 14, 0, seq, ack, ImmHBMsgValue, 0, 0) // WRITE_WITH_IMM
		}
		_ = c.SetWriteDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write(buf); err != nil {
			t.Logf("the server stopped taking heartbeats after %d: %v", seq, err)
			break
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	t.Logf("%d heartbeats sent; server heap in use %d MiB -> %d MiB", seq, base>>20, ms.HeapInuse>>20)
	if ms.HeapInuse > base+64<<20 {
		t.Errorf("the server's heap grew by %d MiB for a client that reads nothing", (ms.HeapInuse-base)>>20)
	}
	_ = c.Close()
}
