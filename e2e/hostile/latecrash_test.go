package hostile

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestLateWriteCrash: as TestLateWriteAfterDone, with the READ's buffer an anonymous
// mapping (what a ublk queue maps for its tags over the soft provider) that its owner unmaps
// once the request is done (a ublk device stopped: queue.release). The server sends the rest
// of its WRITE in small pieces; had the placement not been cut, the soft reader would copy
// them into the unmapped memory and the process would die (SIGSEGV, not recoverable). Run in
// a child process, which must survive.
func TestLateWriteCrash(t *testing.T) {
	if os.Getenv("HOSTILE_CHILD") == "1" {
		lateWriteCrashChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLateWriteCrash$", "-test.v")
	cmd.Env = append(os.Environ(), "HOSTILE_CHILD=1")
	out, err := cmd.CombinedOutput()
	s := string(out)
	if i := strings.Index(s, "unexpected fault address"); i >= 0 {
		t.Fatalf("the client process crashed (%v):\n%s", err, s[i:min(len(s), i+1500)])
	}
	if err != nil || !strings.Contains(s, "child survived") {
		t.Fatalf("child: %v\n%s", err, s)
	}
}

func lateWriteCrashChild(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	var rest func([]byte)
	var conn *rconn // the READ's connection (a reconnect adds others to s.conns)
	started := make(chan struct{})
	s.onReq = func(r *req) {
		if r.desc == nil || r.desc.Len != 64<<10 {
			r.answer(nil, 0)
			return
		}
		conn = r.c
		rest = r.c.sendTwo(frame{op: fWriteImm, imm: transport.IORspImm(r.permit, 0, false)}, nil,
			frame{op: fWrite, rkey: r.desc.Key, addr: r.desc.Addr}, 16<<10, bytes.Repeat([]byte{0xaa}, 4096))
		close(started)
	}
	sess := open(t, s, 1, nil)
	buf, err := unix.Mmap(-1, 0, 64<<10, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	if err := sess.Request(context.Background(), transport.Read, []byte("usr"), buf, func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	<-started
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("not finished")
	}
	if err := unix.Munmap(buf); err != nil { // the owner lets go of its memory
		t.Fatal(err)
	}
	// dribble the rest (12 KiB, below sockread.DirectMin): each piece is read through the reader's buffer and copied
	r := rest
	for i := 0; i < 12; i++ {
		r(bytes.Repeat([]byte{0xbb}, 1024))
		time.Sleep(5 * time.Millisecond)
		r = func(b []byte) { _, _ = conn.nc.Write(b) }
	}
	time.Sleep(time.Second)
	t.Log("child survived")
}
