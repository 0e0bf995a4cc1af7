package aio

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"
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

// TestWriteReadPoll writes a block, reads it back, and polls an eventfd, each completion
// carrying its request's Data.
func TestWriteReadPoll(t *testing.T) {
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
	want := bytes.Repeat([]byte("aio!"), 1024)
	got := make([]byte, len(want))
	ev := make([]Event, 4)
	do := func(cb *IOCB) Event {
		t.Helper()
		if n, err := c.Submit([]*IOCB{cb}); n != 1 || err != nil {
			t.Fatalf("submit: %d, %v", n, err)
		}
		n, err := c.GetEvents(ev, 5*time.Second)
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
	// A read of a bad descriptor is refused at submission.
	if n, err := c.Submit([]*IOCB{{Opcode: CmdPread, Fd: 1 << 30, Buf: uint64(uintptr(unsafe.Pointer(&got[0]))), Nbytes: 1}}); n != 0 || err == nil {
		t.Fatalf("bad descriptor: %d, %v", n, err)
	}

	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	if n, err := c.Submit([]*IOCB{{Data: 3, Opcode: CmdPoll, Fd: uint32(efd), Buf: unix.POLLIN}}); n != 1 || err != nil {
		t.Fatalf("poll: %d, %v", n, err)
	}
	if n, err := c.GetEvents(ev, 20*time.Millisecond); n != 0 || err != nil {
		t.Fatalf("before the eventfd is written: %d events, %v", n, err)
	}
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	if _, err := unix.Write(efd, one[:]); err != nil {
		t.Fatal(err)
	}
	n, err := c.GetEvents(ev, 5*time.Second)
	if n != 1 || err != nil || ev[0].Data != 3 || ev[0].Res&unix.POLLIN == 0 {
		t.Fatalf("poll completion: %d, %v, %+v", n, err, ev[0])
	}
	if _, err := unix.Read(efd, one[:]); err != nil {
		t.Fatal(err)
	}

	// A request with FlagResFd adds one to the eventfd when it completes; Ready then finds
	// its completion without waiting, and nothing after it.
	if n, err := c.Ready(ev); n != 0 || err != nil {
		t.Fatalf("Ready with nothing done: %d, %v", n, err)
	}
	cb := &IOCB{Data: 4, Opcode: CmdPread, Fd: uint32(f.Fd()), Buf: uint64(uintptr(unsafe.Pointer(&got[0]))), Nbytes: uint64(len(got)), Offset: 4096,
		Flags: FlagResFd, ResFd: uint32(efd)}
	if n, err := c.Submit([]*IOCB{cb}); n != 1 || err != nil {
		t.Fatalf("read with an eventfd: %d, %v", n, err)
	}
	pfd := []unix.PollFd{{Fd: int32(efd), Events: unix.POLLIN}}
	if n, err := unix.Poll(pfd, 5000); n != 1 || err != nil {
		t.Fatalf("the eventfd was not signalled: %d, %v", n, err)
	}
	if _, err := unix.Read(efd, one[:]); err != nil || binary.LittleEndian.Uint64(one[:]) != 1 {
		t.Fatalf("eventfd read %v, count %d", err, binary.LittleEndian.Uint64(one[:]))
	}
	if n, err := c.Ready(ev); n != 1 || err != nil || ev[0].Data != 4 || ev[0].Res != int64(len(got)) {
		t.Fatalf("Ready after the eventfd: %d, %v, %+v", n, err, ev[0])
	}
}
