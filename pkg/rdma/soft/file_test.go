package soft

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// fileWith writes data to a new file and returns it opened for reading.
func fileWith(t *testing.T, data []byte) *os.File {
	t.Helper()
	name := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(name, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// regFile registers n bytes of f from off on e, deregistered when the test ends.
func (e *end) regFile(t *testing.T, f *os.File, off int64, n int) rdma.MR {
	t.Helper()
	m, err := e.pd.RegFileMR(f, off, n, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Dereg() })
	return m
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestFileRegion sends from a registered file: RDMA WRITEs and a SEND whose SGEs mix file
// pieces and memory land byte for byte, many megabytes in flight at once (more than the
// socket holds, so sendfile stops part way and the flusher finishes), and the region's
// descriptor closes when the region is deregistered and its sends are done.
func TestFileRegion(t *testing.T) {
	leakcheck.Check(t)
	const fileOff, size = 8192, 3<<20 + 4096
	data := make([]byte, fileOff+size+100)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	f := fileWith(t, data)
	pr := newPair(t, New(Options{}))
	fds := openFDs(t)
	fm, err := pr.cli.pd.RegFileMR(f, fileOff, size, 0)
	if err != nil {
		t.Fatal(err)
	}
	if fm.Len() != size || fm.Bytes() != nil || fm.Access() != 0 {
		t.Fatalf("file MR: len %d bytes %d access %v", fm.Len(), len(fm.Bytes()), fm.Access())
	}
	_ = f.Close() // the region keeps its own descriptor
	file := data[fileOff : fileOff+size]
	mem := pr.cli.reg(t, 4096, lw)
	fill(mem.Bytes(), 9)
	dst := pr.srv.reg(t, 8<<20, rw)

	// One WRITE: file, memory, file.
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList:     []rdma.SGE{rdma.SGEOf(fm, 0, 1<<20+5), rdma.SGEOf(mem, 100, 100), rdma.SGEOf(fm, 2<<20, 1<<20-7)},
		RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	pr.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCSuccess)
	pr.sync(t)
	want := append(append(append([]byte{}, file[:1<<20+5]...), mem.Bytes()[100:200]...), file[2<<20:3<<20-7]...)
	if !bytes.Equal(dst.Bytes()[:len(want)], want) {
		t.Fatal("WRITE from file, memory, file: data differs")
	}

	// Sixteen 512 KiB WRITEs at odd offsets in flight together, then a SEND from the file.
	clear(dst.Bytes())
	for i := range 16 {
		pr.cli.postRetry(t, rdma.SendWR{ID: uint64(10 + i), Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
			SGList:     []rdma.SGE{rdma.SGEOf(fm, i*131071, 512<<10)},
			RemoteAddr: dst.Addr() + uint64(i)*512<<10, RKey: dst.RKey()})
	}
	rbuf := pr.srv.reg(t, 64<<10, lw)
	pr.srv.recv(t, 99, rbuf, 0, 64<<10)
	pr.cli.post(t, rdma.SendWR{ID: 40, Opcode: rdma.OpSendWithImm, Imm: 5, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(mem, 0, 10), rdma.SGEOf(fm, size-50000, 50000)}})
	got := map[uint64]rdma.WCStatus{40: rdma.WCSuccess}
	for i := range 16 {
		got[uint64(10+i)] = rdma.WCSuccess
	}
	pr.cli.expectSet(t, got)
	wc := pr.srv.expect(t, 99, rdma.WCRecv, rdma.WCSuccess)
	if wc.ByteLen != 50010 || !bytes.Equal(rbuf.Bytes()[:10], mem.Bytes()[:10]) || !bytes.Equal(rbuf.Bytes()[10:50010], file[size-50000:]) {
		t.Fatalf("SEND from memory and file: %d bytes, data differs", wc.ByteLen)
	}
	for i := range 16 {
		if !bytes.Equal(dst.Bytes()[i*512<<10:(i+1)*512<<10], file[i*131071:i*131071+512<<10]) {
			t.Fatalf("WRITE %d from the file: data differs", i)
		}
	}

	if err := fm.Dereg(); err != nil {
		t.Fatal(err)
	}
	if n := openFDs(t); n != fds-1 { // f closed, the region's own gone
		t.Fatalf("%d descriptors open after dereg, %d before the region with f open", n, fds)
	}
	// A deregistered region is refused.
	pr.cli.post(t, rdma.SendWR{ID: 50, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(fm, 0, 10)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	pr.cli.expect(t, 50, rdma.WCRDMAWrite, rdma.WCLocProtErr)
	pr.cli.expectEvent(t, rdma.EventDisconnected)
}

// TestFileRegionBounds: an SGE past the end of a file region is a local protection error.
func TestFileRegionBounds(t *testing.T) {
	leakcheck.Check(t)
	f := fileWith(t, make([]byte, 8192))
	pr := newPair(t, New(Options{}))
	fm := pr.cli.regFile(t, f, 4096, 4096)
	dst := pr.srv.reg(t, 8192, rw)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(fm, 4000, 97)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	pr.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCLocProtErr)
	pr.cli.expectEvent(t, rdma.EventDisconnected)
}

// TestFileRegionAsTarget: data may not land in a file region, neither from an RDMA READ nor
// from a receive.
func TestFileRegionAsTarget(t *testing.T) {
	leakcheck.Check(t)
	f := fileWith(t, make([]byte, 8192))
	pr := newPair(t, New(Options{}))
	fm := pr.cli.regFile(t, f, 0, 8192)
	src := pr.srv.reg(t, 4096, rr)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMARead, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(fm, 0, 4096)}, RemoteAddr: src.Addr(), RKey: src.RKey()})
	pr.cli.expect(t, 1, rdma.WCRDMARead, rdma.WCLocProtErr)
	pr.cli.expectEvent(t, rdma.EventDisconnected)

	pr2 := newPair(t, New(Options{}))
	fm2 := pr2.srv.regFile(t, f, 0, 8192)
	pr2.srv.recv(t, 7, fm2, 0, 100)
	mem := pr2.cli.reg(t, 100, lw)
	pr2.cli.post(t, rdma.SendWR{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(mem, 0, 100)}})
	pr2.srv.expect(t, 7, rdma.WCRecv, rdma.WCLocProtErr)
}

// TestFileRegionShrinks: a file cut short under a send it was promised for ends the
// connection (the frame's length cannot be kept), without harm to the process.
func TestFileRegionShrinks(t *testing.T) {
	leakcheck.Check(t)
	f := fileWith(t, make([]byte, 1<<20))
	pr := newPair(t, New(Options{}))
	fm := pr.cli.regFile(t, f, 0, 1<<20)
	if err := os.Truncate(f.Name(), 4096); err != nil {
		t.Fatal(err)
	}
	dst := pr.srv.reg(t, 1<<20, rw)
	pr.cli.post(t, rdma.SendWR{ID: 1, Opcode: rdma.OpRDMAWrite, Flags: rdma.SendSignaled,
		SGList: []rdma.SGE{rdma.SGEOf(fm, 0, 1<<20)}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	pr.cli.expect(t, 1, rdma.WCRDMAWrite, rdma.WCFlushErr)
	ev := pr.cli.expectEvent(t, rdma.EventDisconnected)
	if ev.Err == nil {
		t.Fatal("no cause reported")
	}
	pr.srv.expectEvent(t, rdma.EventDisconnected)
}

func TestFileRegionValidation(t *testing.T) {
	p := New(Options{})
	dev, err := p.OpenDevice("soft_lo")
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	f := fileWith(t, make([]byte, 4096))
	for _, tc := range []struct {
		name   string
		off    int64
		n      int
		access rdma.Access
	}{
		{"remote read", 0, 4096, rdma.AccessRemoteRead},
		{"local write", 0, 4096, rdma.AccessLocalWrite},
		{"negative offset", -1, 4096, 0},
		{"empty", 0, 0, 0},
	} {
		if _, err := pd.RegFileMR(f, tc.off, tc.n, tc.access); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	if _, err := pd.RegFileMR(dir, 0, 4096, 0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("directory: %v", err)
	}
	pr, pw, _ := os.Pipe()
	defer pr.Close()
	defer pw.Close()
	if _, err := pd.RegFileMR(pr, 0, 4096, 0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("pipe: %v", err)
	}
	m, err := pd.RegFileMR(f, 0, 4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Dereg(); err != nil {
		t.Fatal(err)
	}
	if err := m.Dereg(); !errors.Is(err, rdma.ErrClosed) {
		t.Fatalf("double dereg: %v", err)
	}
}
