package ntcopy

import (
	"bytes"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestCopyMatchesBuiltin: every length around Min and the 128-byte blocks, every alignment of
// either side, and destinations shorter or longer than the source copy what the built-in
// copy does and touch nothing else.
func TestCopyMatchesBuiltin(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	src := make([]byte, 140<<10)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	fill := bytes.Repeat([]byte{0xee}, len(src)+256)
	want := make([]byte, len(fill))
	got := make([]byte, len(fill))
	lengths := []int{0, 1, 127, Min - 1, Min, Min + 1, Min + 63, Min + 127, Min + 128, 64 << 10, 128<<10 + 77, 140<<10 - 64}
	for _, n := range lengths {
		for _, da := range []int{0, 1, 15, 16, 63, 64, 100} {
			for _, sa := range []int{0, 3, 32, 64} {
				for _, dlen := range []int{n, n - 5, n + 9} {
					if dlen < 0 || sa+n > len(src) || da+dlen > len(got) {
						continue
					}
					copy(got, fill)
					copy(want, fill)
					wn := copy(want[da:da+dlen], src[sa:sa+n])
					gn := Copy(got[da:da+dlen], src[sa:sa+n])
					if gn != wn || !bytes.Equal(got, want) {
						t.Fatalf("n %d, dst offset %d, src offset %d, dst length %d: copied %d (want %d), contents differ: %v",
							n, da, sa, dlen, gn, wn, !bytes.Equal(got, want))
					}
				}
			}
		}
	}
}

// TestCopyOverlapping: overlapping buffers are copied as the built-in copy copies them
// (memmove), forwards and backwards.
func TestCopyOverlapping(t *testing.T) {
	for _, shift := range []int{-4096, -1, 1, 64, 8192} {
		a := make([]byte, 64<<10)
		for i := range a {
			a[i] = byte(i * 7)
		}
		b := bytes.Clone(a)
		lo, hi := 16<<10, 48<<10
		copy(b[lo+shift:hi+shift], b[lo:hi])
		if n := Copy(a[lo+shift:hi+shift], a[lo:hi]); n != hi-lo {
			t.Fatalf("shift %d: copied %d", shift, n)
		}
		if !bytes.Equal(a, b) {
			t.Fatalf("shift %d: an overlapping copy differs from the built-in one", shift)
		}
	}
}

// TestCopyFaultRecovers: a destination page past the end of a shrunk file faults inside the
// copy; with SetPanicOnFault that is a panic carrying the address, which the caller recovers
// (the memory-backed export's write turns it into an IO error), and the process goes on.
func TestCopyFaultRecovers(t *testing.T) {
	const size = 256 << 10
	f, m := mapFile(t, t.TempDir(), size)
	src := bytes.Repeat([]byte{0x5a}, 128<<10)
	if n := Copy(m[64<<10:], src); n != len(src) || !bytes.Equal(m[64<<10:192<<10], src) {
		t.Fatalf("copy into the mapping: %d bytes, equal %v", n, bytes.Equal(m[64<<10:192<<10], src))
	}
	if err := f.Truncate(64 << 10); err != nil {
		t.Fatal(err)
	}
	var addr uintptr
	func() {
		defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
		defer func() {
			r := recover()
			fault, ok := r.(interface{ Addr() uintptr })
			if !ok {
				t.Fatalf("recovered %v, want a fault with its address", r)
			}
			addr = fault.Addr()
			// On amd64 the fault must have come from the non-temporal stores, not a plain copy.
			if st := string(debug.Stack()); runtime.GOARCH == "amd64" && !strings.Contains(st, "ntStore") {
				t.Fatalf("the fault did not come from ntStore:\n%s", st)
			}
		}()
		Copy(m[64<<10:], src)
	}()
	if base := uintptr(unsafe.Pointer(&m[0])); addr < base+64<<10 || addr >= base+size {
		t.Fatalf("fault at %#x, outside the truncated part [%#x, %#x)", addr, base+64<<10, base+size)
	}
}

// mapFile makes a file of size bytes in dir, removed at the end, and maps it shared.
func mapFile(tb testing.TB, dir string, size int) (*os.File, []byte) {
	f, err := os.CreateTemp(dir, "ntcopy")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		f.Close()
		os.Remove(f.Name())
	})
	if err := f.Truncate(int64(size)); err != nil {
		tb.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { unix.Munmap(m) })
	return f, m
}
