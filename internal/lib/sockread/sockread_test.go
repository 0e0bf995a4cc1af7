package sockread

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// TestReader reads a stream of small and large pieces, as frames are, and checks every
// byte and that a large piece takes at most SpillMax bytes beyond itself.
func TestReader(t *testing.T) {
	for _, kind := range []string{"tcp", "pipe"} {
		t.Run(kind, func(t *testing.T) {
			var w, r net.Conn
			if kind == "tcp" {
				w, r = testutil.TCPPair(t)
			} else {
				w, r = net.Pipe()
				t.Cleanup(func() { w.Close(); r.Close() })
			}
			rng := rand.New(rand.NewPCG(1, 2))
			var sizes []int
			total := 0
			for range 400 {
				n := 40
				switch rng.IntN(4) {
				case 0:
					n = 1 + rng.IntN(200)
				case 1:
					n = DirectMin + rng.IntN(256<<10)
				case 2:
					n = rng.IntN(DirectMin)
				}
				sizes = append(sizes, n)
				total += n
			}
			data := make([]byte, total)
			for i := range data {
				data[i] = byte(rng.Uint32())
			}
			go func() {
				// Odd write sizes, so that pieces arrive split.
				for b := data; len(b) > 0; {
					k := min(len(b), 1+rng.IntN(100<<10))
					if _, err := w.Write(b[:k]); err != nil {
						return
					}
					b = b[k:]
				}
			}()
			fr := New(r, 64<<10)
			if (kind == "tcp") != (fr.raw != nil) {
				t.Fatalf("%s: raw conn %v", kind, fr.raw != nil)
			}
			off := 0
			for i, n := range sizes {
				got := make([]byte, n)
				before := fr.Buffered()
				if err := fr.ReadFull(got); err != nil {
					t.Fatalf("piece %d (%d bytes): %v", i, n, err)
				}
				if !bytes.Equal(got, data[off:off+n]) {
					t.Fatalf("piece %d (%d bytes at %d): wrong bytes", i, n, off)
				}
				off += n
				if kind == "tcp" && n-before >= DirectMin && fr.Buffered() > SpillMax {
					t.Fatalf("piece %d (%d bytes): %d bytes buffered after it, more than %d", i, n, fr.Buffered(), SpillMax)
				}
			}
			w.Close()
			if err := fr.ReadFull(make([]byte, 1)); err != io.EOF {
				t.Fatalf("read after the end: %v", err)
			}
		})
	}
}

// TestReaderShort: the stream ending inside a piece is io.ErrUnexpectedEOF.
func TestReaderShort(t *testing.T) {
	for _, n := range []int{100, 3 * DirectMin} {
		w, r := testutil.TCPPair(t)
		if _, err := w.Write(make([]byte, n-10)); err != nil {
			t.Fatal(err)
		}
		w.Close()
		fr := New(r, 64<<10)
		if err := fr.ReadFull(make([]byte, n)); err != io.ErrUnexpectedEOF {
			t.Fatalf("%d bytes from %d: %v", n, n-10, err)
		}
	}
}

// fillNowEmpty checks that FillNow on fr's empty socket returns at once with nothing; if it
// waits, unstick runs before the test fails.
func fillNowEmpty(t *testing.T, fr *Reader, unstick func()) {
	t.Helper()
	done := make(chan int, 1)
	go func() { done <- fr.FillNow() }()
	select {
	case n := <-done:
		if n != 0 {
			t.Fatalf("FillNow on an empty socket: %d bytes", n)
		}
	case <-time.After(5 * time.Second):
		unstick()
		t.Fatal("FillNow waited on an empty socket")
	}
}

// TestFillNow: FillNow takes what the socket has without waiting, and nothing when it has
// nothing; reads after it see the bytes in order.
func TestFillNow(t *testing.T) {
	w, r := testutil.TCPPair(t)
	fr := New(r, 64<<10)
	fillNowEmpty(t, fr, func() {})
	if _, err := w.Write([]byte("abcdef")); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "bytes through FillNow", func() bool {
		fr.FillNow()
		return fr.Buffered() >= 6
	})
	got := make([]byte, 6)
	if err := fr.ReadFull(got); err != nil || string(got) != "abcdef" {
		t.Fatalf("read %q, %v", got, err)
	}
}

// blockingConn is a net.Conn whose descriptor, as its SyscallConn shows it, blocks.
type blockingConn struct {
	net.Conn
	f *os.File
}

func (c blockingConn) SyscallConn() (syscall.RawConn, error) { return c.f.SyscallConn() }

// TestRawNeverBlocks: the raw read never waits, even on a socket whose descriptor blocks
// (O_NONBLOCK is the open file's, and a dup's Fd() elsewhere clears it): FillNow on an empty
// blocking socket returns at once, and what the peer sends is read; a conn whose descriptor
// is no socket is read through its own Read.
func TestRawNeverBlocks(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "blocking")
	defer f.Close()
	defer unix.Close(fds[1])
	if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK != 0 {
		t.Fatalf("the socket's flags %#x, %v: want it blocking", fl, err)
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	fr := New(blockingConn{Conn: b, f: f}, 4096)
	if fr.raw == nil {
		t.Fatal("a socket is read without the raw recvmsg")
	}
	// A thread stuck in the kernel is let go before the test fails.
	fillNowEmpty(t, fr, func() { _, _ = unix.Write(fds[1], []byte("x")) })
	if _, err := unix.Write(fds[1], []byte("xyz")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 3)
	if err := fr.ReadFull(got); err != nil || string(got) != "xyz" {
		t.Fatalf("read %q, %v", got, err)
	}

	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()
	fp := New(blockingConn{Conn: b, f: pr}, 4096)
	if fp.raw != nil {
		t.Fatal("a pipe is read with the raw recvmsg")
	}
	go func() { _, _ = a.Write([]byte("abc")) }()
	if err := fp.ReadFull(got); err != nil || string(got) != "abc" {
		t.Fatalf("read %q, %v through the conn's Read", got, err)
	}
}
