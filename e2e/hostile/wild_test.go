package hostile

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestWildConnInfo: wild CONN_RSP and INFO_RSP values are refused without a panic, and the
// open fails in bounded time.
func TestWildConnInfo(t *testing.T) {
	type tc struct {
		name string
		rsp  transport.MsgConnRsp
		info func(qd, chunk int) []byte
	}
	desc := func(ds ...transport.SgDesc) func(int, int) []byte {
		return func(int, int) []byte { return (&transport.MsgInfoRsp{Desc: ds}).Marshal() }
	}
	ok := transport.MsgConnRsp{QueueDepth: 8, MaxIOSize: 64 << 10, MaxHdrSize: 4096}
	ch := 64<<10 + 4096
	cases := []tc{
		{"qd 0", transport.MsgConnRsp{QueueDepth: 0, MaxIOSize: 64 << 10, MaxHdrSize: 4096}, nil},
		{"qd 65535 tiny chunks", transport.MsgConnRsp{QueueDepth: 65535, MaxIOSize: 0, MaxHdrSize: 8192}, nil},
		{"max io 0", transport.MsgConnRsp{QueueDepth: 1, MaxIOSize: 0, MaxHdrSize: 8192}, nil},
		{"hdr 0", transport.MsgConnRsp{QueueDepth: 8, MaxIOSize: 64 << 10, MaxHdrSize: 0}, nil},
		{"sizes max", transport.MsgConnRsp{QueueDepth: 8, MaxIOSize: 0xffffffff, MaxHdrSize: 0xffffffff}, nil},
		{"one 200M chunk", transport.MsgConnRsp{QueueDepth: 1, MaxIOSize: 200 << 20, MaxHdrSize: 4096}, nil},
		{"flags all", transport.MsgConnRsp{QueueDepth: 8, MaxIOSize: 64 << 10, MaxHdrSize: 4096, Flags: 0xfffffffd}, nil},
		{"errno in accept", transport.MsgConnRsp{Errno: -5, QueueDepth: 8, MaxIOSize: 64 << 10, MaxHdrSize: 4096}, nil},
		{"info 0 desc", ok, func(int, int) []byte { b := make([]byte, 8); binary.LittleEndian.PutUint16(b, 1); return b }},
		{"info sg_cnt 9 > qd", ok, func(int, int) []byte {
			b := make([]byte, 8+16*9)
			binary.LittleEndian.PutUint16(b, 1)
			binary.LittleEndian.PutUint16(b[2:], 9)
			return b
		}},
		{"info sg_cnt 65535 short", ok, func(int, int) []byte {
			b := make([]byte, 8+16)
			binary.LittleEndian.PutUint16(b, 1)
			binary.LittleEndian.PutUint16(b[2:], 65535)
			return b
		}},
		{"info desc len 0", ok, desc(transport.SgDesc{Addr: chunkBase, Key: 1})},
		{"info desc len odd", ok, desc(transport.SgDesc{Addr: chunkBase, Key: 1, Len: uint32(8*ch) - 1})},
		{"info 3 descs qd 8", ok, desc(transport.SgDesc{Len: uint32(ch)}, transport.SgDesc{Len: uint32(ch)}, transport.SgDesc{Len: uint32(6 * ch)})},
		{"info 2 descs too much", ok, desc(transport.SgDesc{Len: uint32(8 * ch)}, transport.SgDesc{Len: uint32(8 * ch)})},
		{"info addr wraps", ok, desc(transport.SgDesc{Addr: ^uint64(0) - 10, Key: 1, Len: uint32(8 * ch)})},
		{"info wrong type", ok, func(int, int) []byte {
			b := (&transport.MsgInfoRsp{Desc: []transport.SgDesc{{Len: uint32(8 * ch)}}}).Marshal()
			b[0] = 7
			return b
		}},
		{"info too long", ok, func(int, int) []byte { return make([]byte, 1<<20) }},
		{"info short", ok, func(int, int) []byte { return []byte{1} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newServer(t, 8, 64<<10)
			s.rsp = c.rsp
			s.info = c.info
			o := transport.ClientOptions{Provider: soft.New(soft.Options{}), SessName: "victim", Port: s.port(),
				Paths: []transport.PathAddrs{{Dst: dst(t)}}, ConPerPath: 2, MaxReconnectAttempts: -1, Timings: fast()}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			t0 := time.Now()
			sess, err := transport.Open(ctx, o)
			// Unknown flags are ignored, as the kernel's client does; chunk addresses are
			// where the client writes on the server, which only the server can check.
			accept := c.name == "flags all" || c.name == "info addr wraps"
			if err == nil {
				sess.Close()
				if !accept {
					t.Fatalf("accepted (qd %d, max io %d)", sess.QueueDepth(), sess.MaxIOSize())
				}
				return
			}
			if accept {
				t.Fatalf("refused: %v", err)
			}
			if d := time.Since(t0); d > 5*time.Second {
				t.Fatalf("refused after %v: %v", d, err)
			}
			t.Logf("refused in %v: %v", time.Since(t0).Round(time.Millisecond), err)
		})
	}
}
