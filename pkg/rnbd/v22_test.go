package rnbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/errno"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestProtocol22Server sends what a 7.2 client sends, raw through the session: PREFLUSH
// flushes before the write lands, a flush with PREFLUSH is one flush, WRITE_ZEROES with
// NOUNMAP keeps the range allocated and without it punches it, DISCARD punches; bi_size
// without data for DISCARD and WRITE_ZEROES, and refusals where bi_size and data disagree
// or the range leaves the export.
func TestProtocol22Server(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 4<<20)
	c := e.client(t, time.Second)
	d := mustMap(t, e, c, "v22", "disk", AccessRW)
	s := c.Session("v22")
	st := &e.server().Stats
	ctx := context.Background()
	send := func(m MsgIO, dir transport.Dir, data []byte) error {
		usr := make([]byte, IOSize)
		m.DeviceID = d.ID()
		m.Put(usr)
		return s.Do(ctx, dir, usr, data)
	}
	path := filepath.Join(e.dir, "disk")
	blocks := func() int64 {
		var s syscall.Stat_t
		if err := syscall.Stat(path, &s); err != nil {
			t.Fatal(err)
		}
		return s.Blocks
	}

	// SESS_INFO is answered with the lower of the two versions, as the kernel's server does.
	for _, v := range []struct{ ask, want uint8 }{{1, 1}, {2, 2}, {3, 2}} {
		var usr [SessInfoSize]byte
		var rsp [SessInfoRspSize]byte
		MsgSessInfo{Ver: v.ask}.Put(usr[:], MsgTypeSessInfo)
		var m MsgSessInfo
		if err := s.Do(ctx, transport.Read, usr[:], rsp[:]); err != nil || m.Unmarshal(rsp[:], MsgTypeSessInfoRsp) != nil || m.Ver != v.want {
			t.Fatalf("SESS_INFO of version %d: %v, answered %d, want %d", v.ask, err, m.Ver, v.want)
		}
	}
	// Back to 2 for what follows.
	var usr [SessInfoSize]byte
	MsgSessInfo{Ver: 2}.Put(usr[:], MsgTypeSessInfo)
	if err := s.Do(ctx, transport.Read, usr[:], make([]byte, SessInfoRspSize)); err != nil {
		t.Fatal(err)
	}

	pattern := bytes.Repeat([]byte("2.2!"), 1024)
	if err := send(MsgIO{Sector: 16, RW: uint32(OpWrite) | FlagSync | FlagPreflush, BiSize: 4096}, transport.Write, pattern); err != nil {
		t.Fatal(err)
	}
	if err := send(MsgIO{RW: uint32(OpFlush) | FlagSync | FlagFUA | FlagPreflush}, transport.Write, nil); err != nil {
		t.Fatal(err)
	}
	if st.Preflushes.Value() != 2 || st.Flushes.Value() != 1 || st.Writes.Value() != 1 {
		t.Errorf("preflushes %d flushes %d writes %d, want 2 1 1", st.Preflushes.Value(), st.Flushes.Value(), st.Writes.Value())
	}
	if f, _ := os.ReadFile(path); !bytes.Equal(f[16*512:16*512+4096], pattern) {
		t.Error("PREFLUSH write not in the file")
	}

	before := blocks()
	if err := send(MsgIO{Sector: 2048, RW: uint32(OpWriteZeroes) | FlagNoUnmap, BiSize: 1 << 20}, transport.Write, nil); err != nil {
		t.Fatal(err)
	}
	if b := blocks(); b < before {
		t.Errorf("WRITE_ZEROES with NOUNMAP deallocated: %d → %d blocks", before, b)
	}
	before = blocks()
	if err := send(MsgIO{Sector: 4096, RW: uint32(OpWriteZeroes), BiSize: 1 << 20}, transport.Write, nil); err != nil {
		t.Fatal(err)
	}
	if b := blocks(); b > before-(1<<20)/512 {
		t.Errorf("WRITE_ZEROES without NOUNMAP kept its blocks: %d → %d", before, b)
	}
	before = blocks()
	if err := send(MsgIO{Sector: 6144, RW: uint32(OpDiscard), BiSize: 512 << 10}, transport.Write, nil); err != nil {
		t.Fatal(err)
	}
	if b := blocks(); b > before-(512<<10)/512 {
		t.Errorf("DISCARD kept its blocks: %d → %d", before, b)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if h, err := unix.Seek(int(f.Fd()), 2<<20, unix.SEEK_HOLE); err != nil || h != 2<<20 {
		t.Errorf("no hole where WRITE_ZEROES without NOUNMAP ran: %d %v", h, err)
	}
	// (SEEK_DATA is no witness for the NOUNMAP range: tmpfs reports allocated pages never
	// written as a hole. st_blocks above is.)
	data, _ := os.ReadFile(path)
	if !bytes.Equal(data[1<<20:3<<20+512<<10], make([]byte, 2<<20+512<<10)) || data[1<<20-1] == 0 && data[1<<20-2] == 0 {
		t.Error("zeroed ranges do not read as zeroes, or the zeroing spilled over")
	}
	if st.WriteZeroes.Value() != 2 || st.NoUnmapZeroes.Value() != 1 || st.Discards.Value() != 1 {
		t.Errorf("write zeroes %d (nounmap %d) discards %d", st.WriteZeroes.Value(), st.NoUnmapZeroes.Value(), st.Discards.Value())
	}

	for _, tc := range []struct {
		name string
		m    MsgIO
		data []byte
		want syscall.Errno
	}{
		{"write zeroes with data", MsgIO{RW: uint32(OpWriteZeroes), BiSize: 512}, make([]byte, 512), syscall.EINVAL},
		{"discard with data", MsgIO{RW: uint32(OpDiscard), BiSize: 512}, make([]byte, 512), syscall.EINVAL},
		{"preflush write bi_size mismatch", MsgIO{RW: uint32(OpWrite) | FlagPreflush, BiSize: 1024}, make([]byte, 512), syscall.EINVAL},
		{"write zeroes past the end", MsgIO{Sector: 8191, RW: uint32(OpWriteZeroes) | FlagNoUnmap, BiSize: 1024}, nil, syscall.EINVAL},
		{"write zeroes above the limit", MsgIO{RW: uint32(OpWriteZeroes), BiSize: maxRangeSectors*SectorSize + 512}, nil, syscall.EINVAL},
		{"nounmap on a write", MsgIO{RW: uint32(OpWrite) | FlagNoUnmap, BiSize: 512}, make([]byte, 512), syscall.EOPNOTSUPP},
		{"undefined bit 12", MsgIO{RW: uint32(OpWrite) | 1<<12, BiSize: 512}, make([]byte, 512), syscall.EOPNOTSUPP},
	} {
		if err := send(tc.m, transport.Write, tc.data); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestClientNegotiation: the client sends WRITE_ZEROES only to a server that announced a
// write-zeroes limit in the open response (6.12, 7.2, ours), never to one that did not (6.1,
// whose op 5 was WRITE_SAME), and NOUNMAP only when asked for.
func TestClientNegotiation(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "disk", 1<<20)
	e.file(t, "old", 1<<20)
	// The export "old" is opened as a 6.1 server answers: max_write_zeroes_sectors 0.
	rs := e.server()
	like61 := func(r *transport.SrvRequest) bool {
		var m MsgOpen
		if typ, _ := PeekType(r.Usr); typ != MsgTypeOpen || m.Unmarshal(r.Usr) != nil || m.DevName != "old" {
			return false
		}
		go func() {
			err := rs.processOpen(r)
			if err == nil {
				binary.LittleEndian.PutUint32(r.Data[20:], 0)
			}
			r.Respond(errno.Neg(err))
		}()
		return true
	}
	e.intercept.Store(&like61)
	c := e.client(t, time.Second)
	ctx := context.Background()
	st := &rs.Stats

	d := mustMap(t, e, c, "neg", "disk", AccessRW)
	if !d.CanWriteZeroes() || !d.CanDiscard() {
		t.Fatal("2.2 server: write zeroes or discard not offered")
	}
	if err := d.WriteZeroes(ctx, 0, 64<<10, true); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteZeroes(ctx, 64<<10, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	if st.WriteZeroes.Value() != 2 || st.NoUnmapZeroes.Value() != 1 {
		t.Errorf("write zeroes %d, nounmap %d; want 2, 1", st.WriteZeroes.Value(), st.NoUnmapZeroes.Value())
	}

	old := mustMap(t, e, c, "neg", "old", AccessRW)
	if old.CanWriteZeroes() || !old.CanDiscard() {
		t.Fatalf("6.1-like server: write zeroes %v discard %v", old.CanWriteZeroes(), old.CanDiscard())
	}
	if err := old.WriteZeroes(ctx, 0, 4096, true); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("write zeroes to a 6.1-like server: %v", err)
	}
	if st.WriteZeroes.Value() != 2 {
		t.Error("a WRITE_ZEROES reached the 6.1-like server")
	}
	if err := old.Discard(ctx, 0, 4096); err != nil {
		t.Errorf("discard to a 6.1-like server: %v", err)
	}
}

// TestWriteZeroesDiskFile runs writeZeroes on a file of the disk's file system (the test's
// temporary directory), where FALLOC_FL_ZERO_RANGE serves NOUNMAP, unlike tmpfs.
func TestWriteZeroesDiskFile(t *testing.T) {
	dir := t.TempDir()
	data := bytes.Repeat([]byte{0x5a}, 4<<20)
	if err := os.WriteFile(filepath.Join(dir, "disk"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	root, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	b, err := openBeneath(root, "disk", true)
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	if err := b.flush(); err != nil { // allocate the written blocks
		t.Fatal(err)
	}
	blocks := func() int64 {
		var st unix.Stat_t
		if err := unix.Fstat(b.fd, &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks
	}
	before := blocks()
	if err := b.writeZeroes(1<<20, 1<<20, true); err != nil {
		t.Fatal(err)
	}
	if after := blocks(); after < before {
		t.Errorf("NOUNMAP zeroing deallocated: %d → %d blocks", before, after)
	}
	if err := b.writeZeroes(2<<20, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if after := blocks(); after > before-(1<<20)/512 {
		t.Errorf("zeroing without NOUNMAP kept its blocks: %d → %d", before, after)
	}
	if h, err := unix.Seek(b.fd, 2<<20, unix.SEEK_HOLE); err != nil || h != 2<<20 {
		t.Errorf("no hole at 2 MiB: %d %v", h, err)
	}
	got := make([]byte, 4<<20)
	if err := b.readAt(got, 0, false); err != nil {
		t.Fatal(err)
	}
	want := append(append(bytes.Repeat([]byte{0x5a}, 1<<20), make([]byte, 2<<20)...), bytes.Repeat([]byte{0x5a}, 1<<20)...)
	if !bytes.Equal(got, want) {
		t.Error("zeroed ranges wrong or spilled over")
	}
}

// TestNoUnmapRefusedFallback maps a device on a server that announces WRITE_ZEROES but refuses
// RNBD_F_NOUNMAP, as ours did before protocol 2.2: the client writes the zeroes as data instead,
// asks once per open, and never sends NOUNMAP again until the next open.
func TestNoUnmapRefusedFallback(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	data := e.file(t, "disk", 4<<20)
	rs := e.server()
	var refused atomic.Int32
	pre22 := func(r *transport.SrvRequest) bool {
		var m MsgIO
		if typ, _ := PeekType(r.Usr); typ != MsgTypeIO || m.Unmarshal(r.Usr) != nil || m.RW&FlagNoUnmap == 0 {
			return false
		}
		refused.Add(1)
		r.Respond(-int(syscall.EOPNOTSUPP))
		return true
	}
	e.intercept.Store(&pre22)
	defer e.intercept.Store(nil)
	c := e.client(t, time.Second)
	ctx := context.Background()
	st := &rs.Stats

	d := mustMap(t, e, c, "old22", "disk", AccessRW)
	writes := st.Writes.Value()
	// 1.5 MiB: more than one data write, and more than one window of them for a small maxIO.
	if err := d.WriteZeroes(ctx, 1<<20, 3<<19, true); err != nil {
		t.Fatal(err)
	}
	if err := d.WriteZeroes(ctx, 3<<20, 4096, true); err != nil {
		t.Fatal(err)
	}
	if n := refused.Load(); n != 1 {
		t.Errorf("NOUNMAP sent %d times, want once", n)
	}
	if st.WriteZeroes.Value() != 0 || st.Writes.Value()-writes < 2 {
		t.Errorf("server saw %d WRITE_ZEROES and %d writes; want 0 and the zeroes as writes", st.WriteZeroes.Value(), st.Writes.Value()-writes)
	}
	got := make([]byte, 4<<20)
	if err := d.ReadAtContext(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), data...)
	clear(want[1<<20 : 1<<20+3<<19])
	clear(want[3<<20 : 3<<20+4096])
	if !bytes.Equal(got, want) {
		t.Error("zeroed ranges wrong or spilled over")
	}
	// Without NOUNMAP the server is asked as before.
	if err := d.WriteZeroes(ctx, 0, 4096, false); err != nil {
		t.Fatal(err)
	}
	if st.WriteZeroes.Value() != 1 {
		t.Errorf("WRITE_ZEROES without NOUNMAP: server saw %d, want 1", st.WriteZeroes.Value())
	}
}

// TestOpenRspRefused: an open response no IO could use (a max_hw_sectors below one block)
// fails the map with EBADMSG, and the device the server opened for it is closed again.
func TestOpenRspRefused(t *testing.T) {
	leakcheck.Check(t)
	e := newTestEnv(t)
	e.file(t, "tiny", 1<<20)
	e.file(t, "keep", 1<<20)
	rs := e.server()
	tiny := func(r *transport.SrvRequest) bool {
		var m MsgOpen
		if typ, _ := PeekType(r.Usr); typ != MsgTypeOpen || m.Unmarshal(r.Usr) != nil || m.DevName != "tiny" {
			return false
		}
		go func() {
			err := rs.processOpen(r)
			if err == nil {
				binary.LittleEndian.PutUint16(r.Data[36:], 4096) // physical and logical blocks 4 KiB
				binary.LittleEndian.PutUint16(r.Data[38:], 4096)
				binary.LittleEndian.PutUint32(r.Data[16:], 1) // max_hw_sectors: one sector, below a block
			}
			r.Respond(errno.Neg(err))
		}()
		return true
	}
	e.intercept.Store(&tiny)
	defer e.intercept.Store(nil)
	c := e.client(t, time.Second)
	// Another device keeps the session open: the server then closes the refused one only
	// because the client says so.
	mustMap(t, e, c, "tiny", "keep", AccessRW)
	if _, err := e.mapDev(t, c, "tiny", "tiny", AccessRW); !errors.Is(err, syscall.EBADMSG) {
		t.Fatalf("map with max_hw_sectors 1 and 4 KiB blocks: %v, want EBADMSG", err)
	}
	testutil.WaitFor(t, 5*time.Second, "the refused device closed on the server", func() bool {
		devs := rs.Devices()
		return len(devs) == 1 && devs[0].Path == "keep"
	})
}
