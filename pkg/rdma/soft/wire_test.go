package soft

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/sockread"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Golden headers, written from the layout table in docs/soft-rdma.md.
func TestHeaderGolden(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    frameHdr
		hex  string
	}{
		{"RDMA_WRITE_WITH_IMM", frameHdr{op: fWriteImm, flags: flagAckReq, len: 0x1000, seq: 7, ack: 5, imm: 0x80000000, rkey: 0x1234, addr: 0x10002000},
			"0e020000" + "00001000" + "0000000000000007" + "0000000000000005" + "80000000" + "00001234" + "0000000010002000"},
		{"READ_REQ", frameHdr{op: fReadReq, len: 0x20000, seq: 1 << 40, rkey: 0xabcdef01, addr: 0xffffffffffff0000},
			"0f000000" + "00020000" + "0000010000000000" + "0000000000000000" + "00000000" + "abcdef01" + "ffffffffffff0000"},
		{"TERMINATE", frameHdr{op: fTerminate, seq: 3, imm: uint32(rdma.WCRemAccessErr)},
			"12000000" + "00000000" + "0000000000000003" + "0000000000000000" + "0000000a" + "00000000" + "0000000000000000"},
		{"CONN_REQ", frameHdr{op: fConnReq, len: 56, imm: protoVersion, addr: cmMagic},
			"01000000" + "00000038" + "0000000000000000" + "0000000000000000" + "00000001" + "00000000" + "534f465452444d41"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b [hdrLen]byte
			tc.h.encode(b[:])
			if got := hex.EncodeToString(b[:]); got != tc.hex {
				t.Fatalf("encoded\n%s\nwant\n%s", got, tc.hex)
			}
			want, _ := hex.DecodeString(tc.hex)
			h, err := decodeHdr(want)
			if err != nil || h != tc.h {
				t.Fatalf("decoded %+v %v, want %+v", h, err, tc.h)
			}
		})
	}
}

// enc encodes a header.
func enc(h frameHdr) []byte {
	b := make([]byte, hdrLen)
	h.encode(b)
	return b
}

func TestHeaderRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"short", make([]byte, hdrLen-1)},
		{"zero opcode", make([]byte, hdrLen)},
		{"unknown opcode", enc(frameHdr{op: 200})},
		{"reserved set", func() []byte { b := enc(frameHdr{op: fSend}); b[3] = 1; return b }()},
		{"unknown flag", enc(frameHdr{op: fSend, flags: 0x80})},
		{"oversized payload", enc(frameHdr{op: fWrite, len: maxMsgSize + 1})},
		{"oversized private data", enc(frameHdr{op: fConnReq, len: rdma.MaxPrivateData + 1, addr: cmMagic})},
		{"CM without magic", enc(frameHdr{op: fConnAcc})},
		{"ack with payload", enc(frameHdr{op: fAck, len: 1})},
		{"disconnect with seq", enc(frameHdr{op: fDisc, seq: 1})},
		{"terminate with payload", enc(frameHdr{op: fTerminate, len: 4})},
		{"terminate status out of range", enc(frameHdr{op: fTerminate, imm: 300})},
	} {
		if _, err := decodeHdr(tc.b); !errors.Is(err, errFrame) {
			t.Errorf("%s: decoded without error (%v)", tc.name, err)
		}
	}
}

// FuzzDecodeHdr: the decoder never panics, and whatever it accepts re-encodes to the same
// bytes with a bounded payload length.
func FuzzDecodeHdr(f *testing.F) {
	var b [hdrLen]byte
	(&frameHdr{op: fWriteImm, len: 4096, seq: 1, imm: 1}).encode(b[:])
	f.Add(b[:])
	(&frameHdr{op: fConnReq, len: 56, imm: protoVersion, addr: cmMagic}).encode(b[:])
	f.Add(b[:])
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := decodeHdr(in)
		if err != nil {
			return
		}
		if h.payloadLen() > maxMsgSize {
			t.Fatalf("accepted payload of %d", h.payloadLen())
		}
		var out [hdrLen]byte
		h.encode(out[:])
		if !bytes.Equal(out[:], in[:hdrLen]) {
			t.Fatalf("re-encoded %x from %x", out, in[:hdrLen])
		}
	})
}

// unstartedQP makes a QP, with its PD, that no connection has started yet.
func unstartedQP(t testing.TB) (*qp, rdma.PD) {
	p := New(Options{RNRTimer: time.Millisecond})
	dev := p.device("lo")
	pdv, _ := dev.AllocPD()
	c, _ := dev.CreateCQ(64)
	q, err := newQP(dev, pdv.(*pd), qpAttr(c))
	if err != nil {
		t.Fatal(err)
	}
	return q, pdv
}

// responderUnderTest runs a server-side QP, as after an accepted connection, over one end of
// an in-memory pipe; the returned conn is the peer's end.
func responderUnderTest(t testing.TB, rnrRetry uint8) (*qp, net.Conn, rdma.MR) {
	q, pdv := unstartedQP(t)
	m, _ := pdv.AllocMR(4096, all)
	buf, _ := pdv.AllocMR(4096, lw)
	for i := 0; i < 4; i++ {
		_, _ = q.PostRecv([]rdma.RecvWR{{ID: uint64(i), SGList: []rdma.SGE{rdma.SGEOf(buf, 0, 4096)}}})
	}
	local, peer := net.Pipe()
	q.start(local, sockread.New(local, 4096), rnrRetry)
	return q, peer, m
}

// FuzzResponder feeds arbitrary bytes to a live responder as if from a hostile peer: it must
// never panic, never touch memory outside what its keys grant, and always end the connection
// cleanly (reader gone, disconnect reported).
func FuzzResponder(f *testing.F) {
	frame := func(h frameHdr, payload []byte) []byte { return append(enc(h), payload...) }
	f.Add(frame(frameHdr{op: fSend, len: 8, seq: 1}, []byte("12345678")))
	f.Add(frame(frameHdr{op: fWrite, len: 16, seq: 1, rkey: 0x101, addr: 0x10000000}, make([]byte, 16)))
	f.Add(append(frame(frameHdr{op: fReadReq, len: 64, seq: 1, rkey: 0x101}, nil), frame(frameHdr{op: fAck, flags: flagAckReq}, nil)...))
	f.Add(frame(frameHdr{op: fReadResp, len: 1 << 20, seq: 9}, nil))
	f.Add(frame(frameHdr{op: fSendImm, len: 5000, seq: 1}, make([]byte, 5000)))
	f.Fuzz(func(t *testing.T, in []byte) {
		q, peer, m := responderUnderTest(t, 0)
		before := append([]byte(nil), m.Bytes()...)
		go func() { _, _ = io.Copy(io.Discard, peer) }()
		_ = peer.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, _ = peer.Write(in)
		_ = peer.Close()
		select {
		case ev := <-q.events:
			if ev.Type != rdma.EventDisconnected {
				t.Fatalf("event %v", ev.Type)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("responder did not end the connection")
		}
		q.wg.Wait()
		// Only a write that named this MR's key could have changed it, and the
		// initial key is index<<8|1 within a fresh device: check the writes that
		// did not name it left it alone.
		if !bytes.Contains(in, []byte{0, 0, 0x01, 0x01}) && !bytes.Equal(before, m.Bytes()) {
			t.Fatal("memory changed without its key on the wire")
		}
	})
}

// TestHostilePeer drives a responder with specific malformed streams and checks each is
// refused by ending the connection, with the cause reported.
func TestHostilePeer(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []byte
		want string
	}{
		{"garbage", bytes.Repeat([]byte{0xff}, 100), "malformed"},
		{"request out of order", enc(frameHdr{op: fSend, seq: 5}), "seq 5"},
		{"ack of nothing sent", enc(frameHdr{op: fAck, ack: 3}), "ack of seq 3"},
		{"read response to nothing", enc(frameHdr{op: fReadResp, len: 10, seq: 1}), "nothing outstanding"},
		{"terminate of nothing", enc(frameHdr{op: fTerminate, seq: 1, imm: 10}), "terminate of seq 1"},
		{"CM frame after setup", enc(frameHdr{op: fConnReq, addr: cmMagic}), "unexpected CONN_REQ"},
		{"write to an unknown key", append(enc(frameHdr{op: fWrite, len: 4, seq: 1, rkey: 0xdead00}), 1, 2, 3, 4), "remote access error"},
		{"payload cut short", append(enc(frameHdr{op: fSend, len: 100, seq: 1}), 1, 2, 3), "EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, peer, _ := responderUnderTest(t, 0)
			go func() { _, _ = io.Copy(io.Discard, peer) }()
			_, _ = peer.Write(tc.in)
			if tc.want == "EOF" {
				_ = peer.Close()
			}
			select {
			case ev := <-q.events:
				if ev.Err == nil || !strings.Contains(ev.Err.Error(), tc.want) {
					t.Fatalf("disconnect cause %v, want %q", ev.Err, tc.want)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("hostile stream not refused")
			}
			_ = peer.Close()
			q.wg.Wait()
			if q.State() != rdma.QPSErr {
				t.Fatalf("state %v", q.State())
			}
		})
	}
}

// deafConn ignores read deadlines, as a TLS connection does while its reader, inside a
// read, answers a KeyUpdate on a socket the peer does not read.
type deafConn struct{ net.Conn }

func (deafConn) SetReadDeadline(time.Time) error { return nil }

// TestToErrorPlacementPastDeadline: a placement that the read deadline cannot cut short does
// not hold ToError for ever: past a bound the connection is closed, the placement ends, and
// nothing more lands.
func TestToErrorPlacementPastDeadline(t *testing.T) {
	q, pdv := unstartedQP(t)
	const n = 64 << 10
	m, _ := pdv.AllocMR(n, all)
	local, peer := net.Pipe()
	q.start(deafConn{local}, sockread.New(local, 4096), 0)
	go func() { _, _ = io.Copy(io.Discard, peer) }()
	_ = peer.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := peer.Write(append(enc(frameHdr{op: fWrite, len: n, seq: 1, rkey: m.RKey(), addr: m.Addr()}), bytes.Repeat([]byte{0xaa}, 4096)...)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); q.placingWrite.TryLock(); time.Sleep(time.Millisecond) {
		q.placingWrite.Unlock()
		if time.Now().After(deadline) {
			t.Fatal("the write's placement never began")
		}
	}
	returned := make(chan struct{})
	go func() { q.ToError(); close(returned) }()
	select {
	case <-returned:
	case <-time.After(20 * time.Second):
		t.Fatal("ToError waited for ever on a placement out of its read deadline's reach")
	}
	before := bytes.Clone(m.Bytes())
	_ = peer.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = peer.Write(bytes.Repeat([]byte{0xbb}, n-4096))
	_ = peer.Close()
	q.wg.Wait()
	if !bytes.Equal(m.Bytes(), before) {
		t.Fatal("the write went on landing in memory after ToError returned")
	}
}
