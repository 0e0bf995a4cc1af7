package rnbd

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestRawPreadv2: the raw preadv2 reads what was written, at offsets past 4 GiB too, on tmpfs
// (where the server uses it) and on the temporary directory's file system, with its flags
// passed through (RWF_NOWAIT on cached pages), and gives the end of the file as 0 bytes and a
// bad descriptor as its errno.
func TestRawPreadv2(t *testing.T) {
	nowait := 0
	for _, dir := range []string{tmpfsDir(t), t.TempDir()} {
		f, err := os.Create(filepath.Join(dir, "sparse"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		want := bytes.Repeat([]byte("0123456789abcdef"), 256)
		offs := []int64{0, 4096, 1<<32 - 2048, 1<<32 + 8192, 5<<32 + 512}
		for _, off := range offs {
			if _, err := f.WriteAt(want, off); err != nil {
				t.Fatal(err)
			}
		}
		for _, off := range offs {
			for _, flags := range []int{0, unix.RWF_NOWAIT} {
				got := make([]byte, len(want))
				n, err := rawPreadv2(int(f.Fd()), got, off, flags)
				if flags != 0 && (err == unix.EOPNOTSUPP || err == unix.EAGAIN) {
					continue // RWF_NOWAIT refused by the file system, or the page not cached
				}
				if err != nil || n != len(want) || !bytes.Equal(got, want) {
					t.Fatalf("%s at %d, flags %#x: %d bytes, %v; equal: %v", dir, off, flags, n, err, bytes.Equal(got, want))
				}
				if flags != 0 {
					nowait++
				}
			}
		}
		end := 5<<32 + 512 + int64(len(want))
		if n, err := rawPreadv2(int(f.Fd()), make([]byte, 512), end, 0); n != 0 || err != nil {
			t.Fatalf("%s: read at the end: %d, %v", dir, n, err)
		}
	}
	if nowait == 0 {
		t.Fatal("no RWF_NOWAIT read was taken on either file system: that path went untested")
	}
	if _, err := rawPreadv2(-1, make([]byte, 512), 0, 0); err != unix.EBADF {
		t.Fatalf("a bad descriptor: %v, want EBADF", err)
	}
}

// TestSplitWindow: a range split into many pieces has at most splitWindow of them in flight,
// every piece is run once, and after an error no new piece starts.
func TestSplitWindow(t *testing.T) {
	var mu sync.Mutex
	var now, peak, ran int
	seen := map[int64]bool{}
	err := split(0, 10000*512, 512, func(off int64, n int) error {
		mu.Lock()
		if seen[off] || n != 512 || off%512 != 0 {
			mu.Unlock()
			return fmt.Errorf("piece %d+%d again or misplaced", off, n)
		}
		seen[off] = true
		now++
		ran++
		peak = max(peak, now)
		mu.Unlock()
		time.Sleep(10 * time.Microsecond)
		mu.Lock()
		now--
		mu.Unlock()
		return nil
	})
	if err != nil || ran != 10000 || peak > splitWindow {
		t.Fatalf("err %v, %d pieces run, %d at once (window %d)", err, ran, peak, splitWindow)
	}
	ran = 0
	boom := errors.New("boom")
	err = split(0, 10000*512, 512, func(off int64, n int) error {
		mu.Lock()
		ran++
		mu.Unlock()
		if off == 512*100 {
			return boom
		}
		return nil
	})
	// How many start between the failing piece's return and its error being seen is the
	// scheduler's (two windows on a quiet machine, 1499 of 10000 seen under load): the
	// split must stop well short of the whole range.
	if !errors.Is(err, boom) || ran >= 5000 {
		t.Fatalf("after an error: %v, %d pieces run of 10000", err, ran)
	}
}
