package hostile

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestLateWriteAfterDone: the server answers a READ (WRITE_WITH_IMM response) and right
// behind the answer starts an RDMA WRITE into the READ's buffer under the READ's key, of
// which it sends only the first 4 KiB. The client's reader resolves the key (still valid)
// and blocks placing the payload; the completion handler takes the response meanwhile. Its
// LOCAL_INV cuts the placement (the connection goes to error) before the READ's done hands
// the buffer back: the rest of the payload, sent afterwards, lands nowhere.
func TestLateWriteAfterDone(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	var rest func([]byte)
	started := make(chan struct{})
	s.onReq = func(r *req) {
		if r.desc == nil || r.desc.Len != 64<<10 {
			r.answer(nil, 0) // anything else: answered honestly
			return
		}
		// the response first, then a WRITE of 64 KiB into the READ's buffer, 4 KiB of it now
		rest = r.c.sendTwo(frame{op: fWriteImm, imm: transport.IORspImm(r.permit, 0, false)}, nil,
			frame{op: fWrite, rkey: r.desc.Key, addr: r.desc.Addr}, 64<<10, bytes.Repeat([]byte{0xaa}, 4096))
		close(started)
	}
	sess := open(t, s, 1, nil) // one connection: the permit's and the heartbeats'
	buf := bytes.Repeat([]byte{0x11}, 64<<10)
	done := make(chan error, 1)
	if err := sess.Request(context.Background(), transport.Read, []byte("usr"), buf, func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	<-started
	var err error
	select {
	case err = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the READ was not finished")
	}
	t.Logf("READ done(%v)", err)
	// The caller owns buf again: it reuses it (a pool would hand it to another request).
	for i := range buf {
		buf[i] = 0x22
	}
	rest(bytes.Repeat([]byte{0xbb}, 60<<10))
	time.Sleep(500 * time.Millisecond)
	changed := 0
	for _, b := range buf {
		if b != 0x22 {
			changed++
		}
	}
	if changed > 0 {
		t.Errorf("%d bytes of the buffer were written by the server after the READ's done returned it to the caller (first bytes %x)", changed, buf[4096:4100])
	}
}
