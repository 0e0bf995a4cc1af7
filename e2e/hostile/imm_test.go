package hostile

import (
	"context"
	"encoding/binary"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestBadResponses: out-of-range ids, unknown immediates, garbage rkey responses, answers
// twice: no panic, the path goes down with the reason logged, and comes back after the
// reconnect delay (not in a tight loop).
func TestBadResponses(t *testing.T) {
	cases := []struct {
		name   string
		newKey bool
		bad    func(r *req)
	}{
		{"msg id past qd", false, func(r *req) { r.c.send(frame{op: fWriteImm, imm: transport.IORspImm(0x7ffff, 0, false)}, nil) }},
		{"imm type 5", false, func(r *req) { r.c.send(frame{op: fWriteImm, imm: 5 << 28}, nil) }},
		{"imm type 15", false, func(r *req) { r.c.send(frame{op: fWriteImm, imm: 0xffffffff}, nil) }},
		{"errno 511", false, func(r *req) { r.c.send(frame{op: fWriteImm, imm: transport.IORspImm(r.permit, 511, false)}, nil) }},
		{"send_imm payload without always_invalidate", false, func(r *req) {
			r.c.send(frame{op: fSendImm, imm: transport.IORspImm(r.permit, 0, false)}, make([]byte, 8))
		}},
		{"send_inv of a key not granted", false, func(r *req) { r.c.send(frame{op: fSendInv, imm: 0x12345678}, nil) }},
		{"read of the header buffer", false, func(r *req) { r.c.send(frame{op: fReadReq, rkey: 1, addr: 0}, nil) }},
		{"terminate bogus", false, func(r *req) { r.c.send(frame{op: fTerm, imm: 3}, nil) }},
		{"rkey rsp wrong buf id", true, func(r *req) {
			b := make([]byte, 8)
			binary.LittleEndian.PutUint16(b, transport.MsgTypeRkeyRsp)
			binary.LittleEndian.PutUint16(b[2:], uint16(r.permit+1))
			r.c.send(frame{op: fSendImm, imm: transport.IORspImm(r.permit, 0, false)}, b)
		}},
		{"rkey rsp 4 bytes", true, func(r *req) {
			r.c.send(frame{op: fSendImm, imm: transport.IORspImm(r.permit, 0, false)}, make([]byte, 4))
		}},
		{"rkey rsp 9 bytes", true, func(r *req) {
			r.c.send(frame{op: fSendImm, imm: transport.IORspImm(r.permit, 0, false)}, make([]byte, 9))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newServer(t, 8, 64<<10)
			if c.newKey {
				s.rsp.Flags = transport.MsgNewRkeyF
			}
			var bad atomic.Bool
			bad.Store(true)
			s.onReq = func(r *req) {
				if bad.Swap(false) {
					c.bad(r)
					return
				}
				if c.newKey {
					b := make([]byte, 8)
					binary.LittleEndian.PutUint16(b, transport.MsgTypeRkeyRsp)
					binary.LittleEndian.PutUint16(b[2:], uint16(r.permit))
					binary.LittleEndian.PutUint32(b[4:], 0x100)
					if r.desc != nil {
						r.c.send(frame{op: fWrite, rkey: r.desc.Key, addr: r.desc.Addr}, make([]byte, r.desc.Len))
					}
					r.c.send(frame{op: fSendImm, imm: transport.IORspImm(r.permit, 0, false)}, b)
					return
				}
				r.answer(make([]byte, 4096), 0)
			}
			sess := open(t, s, 2, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			p := sess.Paths()[0]
			err := sess.Do(ctx, transport.Read, []byte("usr"), make([]byte, 4096))
			t.Logf("first request: %v", err)
			if c.name == "errno 511" {
				// An errno is an answer, not a fault: the path stays.
				if !errors.Is(err, syscall.Errno(511)) || p.State() != transport.StateConnected {
					t.Fatalf("errno 511: %v, path %v", err, p.State())
				}
			} else {
				if err == nil {
					t.Fatal("a request the server answered wrongly succeeded")
				}
				testutil.WaitFor(t, 10*time.Second, "the path back after its reconnect delay", func() bool {
					return p.State() == transport.StateConnected && p.Stats.ReconnectOK.Total() >= 1
				})
			}
			if err := sess.Do(ctx, transport.Read, []byte("usr"), make([]byte, 4096)); err != nil {
				t.Fatalf("the request after: %v", err)
			}
		})
	}
}
