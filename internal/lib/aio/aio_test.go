package aio

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestLayout(t *testing.T) {
	if s := unsafe.Sizeof(IOCB{}); s != 64 {
		t.Fatalf("IOCB is %d bytes, want 64", s)
	}
	if s := unsafe.Sizeof(Event{}); s != 32 {
		t.Fatalf("Event is %d bytes, want 32", s)
	}
	if o := unsafe.Offsetof(IOCB{}.Opcode); o != 16 {
		t.Fatalf("aio_lio_opcode at %d, want 16", o)
	}
	if o := unsafe.Offsetof(IOCB{}.ResFd); o != 60 {
		t.Fatalf("aio_resfd at %d, want 60", o)
	}
}

// TestWriteRead writes a block and reads it back, each request signalling an eventfd when it
// completes (FlagResFd), and Ready finding its completion, with its Data, without waiting.
func TestWriteRead(t *testing.T) {
	c, err := New(8)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Destroy()
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	want := bytes.Repeat([]byte("aio!"), 1024)
	got := make([]byte, len(want))
	ev := make([]Event, 4)
	if n, err := c.Ready(ev); n != 0 || err != nil {
		t.Fatalf("Ready with nothing submitted: %d, %v", n, err)
	}
	do := func(cb *IOCB) Event {
		t.Helper()
		cb.Flags, cb.ResFd = FlagResFd, uint32(efd)
		if n, err := c.Submit([]*IOCB{cb}); n != 1 || err != nil {
			t.Fatalf("submit: %d, %v", n, err)
		}
		pfd := []unix.PollFd{{Fd: int32(efd), Events: unix.POLLIN}}
		if n, err := unix.Poll(pfd, 5000); n != 1 || err != nil {
			t.Fatalf("the eventfd was not signalled: %d, %v", n, err)
		}
		var cnt [8]byte
		if _, err := unix.Read(efd, cnt[:]); err != nil || binary.LittleEndian.Uint64(cnt[:]) != 1 {
			t.Fatalf("eventfd read %v, count %d", err, binary.LittleEndian.Uint64(cnt[:]))
		}
		n, err := c.Ready(ev)
		if n != 1 || err != nil {
			t.Fatalf("events: %d, %v", n, err)
		}
		if ev[0].Data != cb.Data {
			t.Fatalf("completion of %d, want %d", ev[0].Data, cb.Data)
		}
		return ev[0]
	}
	w := do(&IOCB{Data: 1, Opcode: CmdPwrite, Fd: uint32(f.Fd()), Buf: uint64(uintptr(unsafe.Pointer(&want[0]))), Nbytes: uint64(len(want)), Offset: 4096})
	r := do(&IOCB{Data: 2, Opcode: CmdPread, Fd: uint32(f.Fd()), Buf: uint64(uintptr(unsafe.Pointer(&got[0]))), Nbytes: uint64(len(got)), Offset: 4096})
	if w.Res != int64(len(want)) || r.Res != int64(len(got)) || !bytes.Equal(got, want) {
		t.Fatalf("write %d, read %d, data equal %v", w.Res, r.Res, bytes.Equal(got, want))
	}
	if n, err := c.Ready(ev); n != 0 || err != nil {
		t.Fatalf("Ready after both were taken: %d, %v", n, err)
	}
	// A read of a bad descriptor is refused at submission.
	if n, err := c.Submit([]*IOCB{{Opcode: CmdPread, Fd: 1 << 30, Buf: uint64(uintptr(unsafe.Pointer(&got[0]))), Nbytes: 1}}); n != 0 || err == nil {
		t.Fatalf("bad descriptor: %d, %v", n, err)
	}
}
