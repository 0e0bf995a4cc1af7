package uring

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func newRing(t *testing.T, entries, flags uint32) *Ring {
	t.Helper()
	r, err := New(entries, flags)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// wait collects n completions, failing after a generous limit.
func wait(t *testing.T, r *Ring, n int) []CQE {
	t.Helper()
	var got []CQE
	deadline := time.Now().Add(10 * time.Second)
	for len(got) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d completions", len(got), n)
		}
		if _, err := r.Submit(uint32(n-len(got)), time.Second); err != nil {
			t.Fatal(err)
		}
		r.Completions(func(c CQE) { got = append(got, c) })
	}
	return got
}

func TestLayout(t *testing.T) {
	if s := unsafe.Sizeof(SQE{}); s != 64 {
		t.Errorf("SQE is %d bytes", s)
	}
	if s := unsafe.Sizeof(params{}); s != 120 {
		t.Errorf("io_uring_params is %d bytes", s)
	}
	if s := unsafe.Sizeof(getEventsArg{}); s != 24 {
		t.Errorf("io_uring_getevents_arg is %d bytes", s)
	}
	if o := unsafe.Offsetof(SQE{}.UserData); o != 32 {
		t.Errorf("user_data at %d", o)
	}
	if o := unsafe.Offsetof(SQE{}.Addr3); o != 48 {
		t.Errorf("cmd at %d", o)
	}
}

func TestNopsInOrderAndFull(t *testing.T) {
	for _, flags := range []uint32{0, SetupSQE128} {
		r := newRing(t, 8, flags)
		if r.Entries() != 8 {
			t.Fatalf("entries %d", r.Entries())
		}
		if n := len(r.Cmd(r.GetSQE())); (flags == 0 && n != 16) || (flags != 0 && n != 80) {
			t.Errorf("flags %#x: command area %d bytes", flags, n)
		}
		for i := 1; i < 8; i++ {
			r.GetSQE().UserData = uint64(i)
		}
		if r.GetSQE() != nil || r.Free() != 0 {
			t.Fatal("a ninth entry out of eight")
		}
		if n := r.Unsubmitted(); n != 8 {
			t.Errorf("%d unsubmitted before the submit", n)
		}
		got := wait(t, r, 8)
		for i, c := range got {
			if c.UserData != uint64(i) || c.Res != 0 {
				t.Errorf("completion %d: %+v", i, c)
			}
		}
		if r.Free() != 8 || r.Unsubmitted() != 0 {
			t.Errorf("%d free, %d unsubmitted after the submit", r.Free(), r.Unsubmitted())
		}
	}
}

func TestReadWrite(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := newRing(t, 4, 0)
	out := bytes.Repeat([]byte("rtrs"), 1024)
	s := r.GetSQE()
	s.Opcode, s.Fd, s.Off, s.Addr, s.Len, s.UserData = OpWrite, int32(f.Fd()), 4096, uint64(uintptr(unsafe.Pointer(&out[0]))), uint32(len(out)), 1
	if c := wait(t, r, 1)[0]; c.Res != int32(len(out)) {
		t.Fatalf("write: %d (%v)", c.Res, Errno(c.Res))
	}
	in := make([]byte, len(out))
	s = r.GetSQE()
	s.Opcode, s.Fd, s.Off, s.Addr, s.Len, s.UserData = OpRead, int32(f.Fd()), 4096, uint64(uintptr(unsafe.Pointer(&in[0]))), uint32(len(in)), 2
	if c := wait(t, r, 1)[0]; c.Res != int32(len(in)) || !bytes.Equal(in, out) {
		t.Fatalf("read: %d (%v), equal %v", c.Res, Errno(c.Res), bytes.Equal(in, out))
	}
	// An error comes back as a negative errno.
	s = r.GetSQE()
	s.Opcode, s.Fd, s.Addr, s.Len = OpRead, -1, uint64(uintptr(unsafe.Pointer(&in[0]))), 1
	if c := wait(t, r, 1)[0]; Errno(c.Res) != syscall.EBADF {
		t.Fatalf("read of fd -1: %d", c.Res)
	}
}

// readEventfd queues on r a read of a new eventfd (closed when the test ends) into buf, with
// user data ud, and returns the eventfd.
func readEventfd(t *testing.T, r *Ring, buf *[8]byte, ud uint64) int {
	t.Helper()
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(efd) })
	s := r.GetSQE()
	s.Opcode, s.Fd, s.Addr, s.Len, s.UserData = OpRead, int32(efd), uint64(uintptr(unsafe.Pointer(&buf[0]))), 8, ud
	return efd
}

// A wait ends at its timeout with nothing there, and a write to an eventfd another
// goroutine makes ends it early: how ublk's queue loops learn of finished IO.
func TestWaitTimeoutAndWake(t *testing.T) {
	r := newRing(t, 4, 0)
	t0 := time.Now()
	if n, err := r.Submit(1, 50*time.Millisecond); err != nil || n != 0 {
		t.Fatalf("empty wait: %d, %v", n, err)
	}
	if d := time.Since(t0); d < 50*time.Millisecond {
		t.Fatalf("returned after %v", d)
	}
	var buf [8]byte
	efd := readEventfd(t, r, &buf, 7)
	go func() {
		time.Sleep(20 * time.Millisecond)
		var one [8]byte
		binary.LittleEndian.PutUint64(one[:], 1)
		_, _ = unix.Write(efd, one[:])
	}()
	c := wait(t, r, 1)[0]
	if c.UserData != 7 || c.Res != 8 || binary.LittleEndian.Uint64(buf[:]) != 1 {
		t.Fatalf("eventfd read: %+v, %x", c, buf)
	}
}

// An entry still waiting is cancelled by its user data (OpAsyncCancel, as ublk's DEL_DEV
// on kernels before 6.11): the read ends with ECANCELED, the cancel with 0, and the ring
// goes on.
func TestAsyncCancel(t *testing.T) {
	r := newRing(t, 4, 0)
	var buf [8]byte
	readEventfd(t, r, &buf, 5)
	if n, err := r.Submit(1, 20*time.Millisecond); err != nil || n != 1 {
		t.Fatalf("submitting the read: %d, %v", n, err)
	}
	if n := r.Completions(func(CQE) {}); n != 0 {
		t.Fatalf("%d completions of a read with nothing to read", n)
	}
	c := r.GetSQE()
	*c = SQE{Opcode: OpAsyncCancel, Fd: -1, Addr: 5, UserData: 6}
	res := map[uint64]int32{}
	for _, e := range wait(t, r, 2) {
		res[e.UserData] = e.Res
	}
	if Errno(res[5]) != syscall.ECANCELED || res[6] != 0 {
		t.Fatalf("read %d (%v), cancel %d (%v)", res[5], Errno(res[5]), res[6], Errno(res[6]))
	}
	c = r.GetSQE()
	*c = SQE{Opcode: OpAsyncCancel, Fd: -1, Addr: 5, UserData: 7}
	if e := wait(t, r, 1)[0]; Errno(e.Res) != syscall.ENOENT {
		t.Fatalf("cancelling what is gone: %d (%v), want ENOENT", e.Res, Errno(e.Res))
	}
}

// A ring set up for one thread (ublk's queue loops) runs deferred completions on every
// Submit, a wait included, and refuses another thread's submits.
func TestSingleThreadRing(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const single = SetupCoopTaskrun | SetupSingleIssuer | SetupDeferTaskrun
	r, err := New(4, single)
	if errors.Is(err, syscall.EINVAL) {
		t.Skipf("this kernel (before 6.1) has no DEFER_TASKRUN: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for i := range 3 {
		r.GetSQE().UserData = uint64(i)
	}
	// Without a wait: the NOPs complete and their completions are there after the call.
	if n, err := r.Submit(0, 0); err != nil || n != 3 {
		t.Fatalf("submit: %d, %v", n, err)
	}
	var got []uint64
	r.Completions(func(c CQE) { got = append(got, c.UserData) })
	if len(got) != 3 {
		t.Fatalf("completions after a submit without a wait: %v", got)
	}
	// Another thread's submit is refused.
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		r.GetSQE().UserData = 9
		_, err := r.Submit(0, 0)
		errc <- err
	}()
	if err := <-errc; !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("submit from another thread: %v, want EEXIST", err)
	}
}

func TestBadSetup(t *testing.T) {
	if _, err := New(0, 0); err == nil {
		t.Fatal("a ring of 0 entries")
	}
}

// A doorbell rings only for a loop that said it would sleep, and its read in the ring ends
// that loop's wait; Wake rings regardless.
func TestDoorbell(t *testing.T) {
	r := newRing(t, 4, 0)
	d, err := NewDoorbell()
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d.Arm(r, 9)
	d.Ring() // awake: nothing written
	if n, err := r.Submit(1, 30*time.Millisecond); err != nil || n != 1 {
		t.Fatalf("submit: %d, %v", n, err)
	}
	if n := r.Completions(func(CQE) {}); n != 0 {
		t.Fatalf("a ring of an awake loop's bell completed the read (%d)", n)
	}
	d.Sleep()
	rung := make(chan struct{})
	go func() {
		defer close(rung)
		d.Ring()
	}()
	if c := wait(t, r, 1)[0]; c.UserData != 9 || c.Res != 8 {
		t.Fatalf("bell read: %+v", c)
	}
	<-rung
	d.Ring() // the ring above cleared sleeping
	d.Arm(r, 10)
	if _, err := r.Submit(1, 30*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if n := r.Completions(func(CQE) {}); n != 0 {
		t.Fatalf("a second ring without a sleep completed the read (%d)", n)
	}
	d.Wake()
	if c := wait(t, r, 1)[0]; c.UserData != 10 {
		t.Fatalf("wake read: %+v", c)
	}
}

// TestDoorbellWakeAfterClose: a Wake or Ring after Close writes nothing, also not to a file
// that took the closed eventfd's number.
func TestDoorbellWakeAfterClose(t *testing.T) {
	d, err := NewDoorbell()
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
	// The lowest free number: the eventfd's, most likely.
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	d.Sleep()
	d.Ring()
	d.Wake()
	var buf [8]byte
	if n, err := unix.Read(efd, buf[:]); err != unix.EAGAIN {
		t.Fatalf("the file that took the number was written: %d bytes, %v", n, err)
	}
}
