package rnbd

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// Golden bytes written from the offset tables of rnbd-proto.h (spec section 7), little-endian.
func TestGoldenIO(t *testing.T) {
	b := make([]byte, IOSize)
	for i := range b {
		b[i] = 0xee // the tail padding must come out zeroed
	}
	MsgIO{DeviceID: 0x11223344, Sector: 0x0102030405060708, RW: uint32(OpWrite) | FlagFUA | FlagSync, BiSize: 0x1000, Prio: 3}.Put(b)
	want := testutil.Unhex(t, `0400 0000  44332211  0807060504030201  01030000  00100000  0300 000000000000`)
	if !bytes.Equal(b, want) {
		t.Fatalf("rnbd_msg_io\n got %x\nwant %x", b, want)
	}
	var m MsgIO
	if err := m.Unmarshal(b); err != nil || m.Op() != OpWrite || m.RW&FlagFUA == 0 || m.Sector != 0x0102030405060708 || m.BiSize != 4096 || m.Prio != 3 {
		t.Fatalf("decoded %+v, %v", m, err)
	}
}

func TestGoldenControl(t *testing.T) {
	b := make([]byte, SessInfoSize)
	MsgSessInfo{Ver: 2}.Put(b, MsgTypeSessInfo)
	if want := append(testutil.Unhex(t, "0000 0000 02"), make([]byte, 31)...); !bytes.Equal(b, want) {
		t.Fatalf("sess_info %x", b)
	}
	b = make([]byte, CloseSize)
	MsgClose{DeviceID: 7}.Put(b)
	if want := testutil.Unhex(t, "0500 0000 07000000"); !bytes.Equal(b, want) {
		t.Fatalf("close %x", b)
	}
	b = make([]byte, OpenSize)
	if err := (MsgOpen{AccessMode: AccessMigration, DevName: "/dev/ram0"}).Put(b); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, OpenSize)
	copy(want, testutil.Unhex(t, "0200 0000 02 00"))
	copy(want[6:], "/dev/ram0")
	if !bytes.Equal(b, want) {
		t.Fatalf("open %x", b)
	}
	b = make([]byte, OpenRspSize)
	MsgOpenRsp{DeviceID: 9, NSectors: 0x10000, MaxHWSectors: 248, MaxWriteZeroesSectors: 1, MaxDiscardSectors: 2,
		DiscardGranularity: 4096, DiscardAlignment: 5, PhysicalBlockSize: 4096, LogicalBlockSize: 512,
		MaxSegments: 128, SecureDiscard: 1, CachePolicy: CacheFUA | CacheWriteback}.Put(b)
	want = testutil.Unhex(t, `0300 0000 09000000 0000010000000000 f8000000 01000000 02000000 00100000 05000000
		0010 0002 8000 0100 00 03 00000000000000000000`)
	if !bytes.Equal(b, want) {
		t.Fatalf("open_rsp\n got %x\nwant %x", b, want)
	}
	var r MsgOpenRsp
	if err := r.Unmarshal(b); err != nil || r.MaxHWSectors != 248 || r.LogicalBlockSize != 512 || r.CachePolicy != 3 {
		t.Fatalf("%+v %v", r, err)
	}
}

func TestDecodersReject(t *testing.T) {
	io := make([]byte, IOSize)
	MsgIO{RW: uint32(OpRead)}.Put(io)
	var m MsgIO
	if err := m.Unmarshal(io[:31]); !errors.Is(err, syscall.EBADMSG) {
		t.Errorf("short io: %v", err)
	}
	bad := append([]byte(nil), io...)
	bad[16] = 9 // op beyond the last
	if err := m.Unmarshal(bad); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("op 9: %v", err)
	}
	bad[16], bad[18] = 0, 1 // a flag bit nobody defined
	if err := m.Unmarshal(bad); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("flag bit 16: %v", err)
	}
	bad = append([]byte(nil), io...)
	bad[0] = byte(MsgTypeClose)
	if err := m.Unmarshal(bad); !errors.Is(err, syscall.EBADMSG) {
		t.Errorf("wrong type: %v", err)
	}

	open := make([]byte, OpenSize)
	if err := (MsgOpen{DevName: "x"}).Put(open); err != nil {
		t.Fatal(err)
	}
	var o MsgOpen
	unterminated := append([]byte(nil), open...)
	for i := 6; i < 6+NameMax; i++ {
		unterminated[i] = 'a'
	}
	if err := o.Unmarshal(unterminated); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("unterminated name: %v", err)
	}
	empty := append([]byte(nil), open...)
	empty[6] = 0
	if err := o.Unmarshal(empty); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("empty name: %v", err)
	}
	mode := append([]byte(nil), open...)
	mode[4] = 3
	if err := o.Unmarshal(mode); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("mode 3: %v", err)
	}
	if err := (MsgOpen{DevName: strings.Repeat("a", NameMax)}).Put(open); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("255-byte name: %v", err)
	}

	rsp := make([]byte, OpenRspSize)
	var r MsgOpenRsp
	for _, g := range []MsgOpenRsp{
		{LogicalBlockSize: 0},
		{LogicalBlockSize: 1000},
		{LogicalBlockSize: 4096, PhysicalBlockSize: 512},
		{LogicalBlockSize: 4096, NSectors: 9},
		{LogicalBlockSize: 512, NSectors: 1 << 54}, // 2^63 bytes
		{LogicalBlockSize: 4096, MaxHWSectors: 1},  // no IO of one block fits
		{LogicalBlockSize: 4096, MaxHWSectors: 7},
	} {
		g.Put(rsp)
		if err := r.Unmarshal(rsp); !errors.Is(err, syscall.EBADMSG) {
			t.Errorf("%+v: %v", g, err)
		}
	}
	// A discard or write-zeroes limit below one block is taken as none announced.
	MsgOpenRsp{LogicalBlockSize: 4096, NSectors: 8, MaxHWSectors: 8, MaxDiscardSectors: 7, MaxWriteZeroesSectors: 1}.Put(rsp)
	if err := r.Unmarshal(rsp); err != nil || r.MaxDiscardSectors != 0 || r.MaxWriteZeroesSectors != 0 || r.MaxHWSectors != 8 {
		t.Errorf("limits below a block: %+v, %v", r, err)
	}
	// A discard granularity the block layer cannot round with is taken as none announced.
	for g, keep := range map[uint32]bool{0: true, 4096: true, 1 << 30: true, 3000: false, 0xffffffff: false, 1 << 31: false} {
		MsgOpenRsp{LogicalBlockSize: 512, NSectors: 8, DiscardGranularity: g, DiscardAlignment: 512, MaxDiscardSectors: 8}.Put(rsp)
		if err := r.Unmarshal(rsp); err != nil || (r.DiscardGranularity == g) != keep || !keep && r.DiscardAlignment != 0 {
			t.Errorf("discard granularity %d: %+v, %v", g, r, err)
		}
	}
}

// FuzzDecoders feeds arbitrary bytes to every decoder: none may panic, and whatever decodes
// re-encodes to the same meaning.
func FuzzDecoders(f *testing.F) {
	io := make([]byte, IOSize)
	MsgIO{DeviceID: 1, Sector: 8, RW: uint32(OpWrite) | FlagFUA, BiSize: 4096}.Put(io)
	f.Add(io)
	open := make([]byte, OpenSize)
	_ = MsgOpen{AccessMode: AccessRW, DevName: "disk"}.Put(open)
	f.Add(open)
	rsp := make([]byte, OpenRspSize)
	MsgOpenRsp{NSectors: 8, LogicalBlockSize: 512, PhysicalBlockSize: 4096}.Put(rsp)
	f.Add(rsp)
	f.Add([]byte{5, 0, 0, 0, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m MsgIO
		if m.Unmarshal(b) == nil {
			out := make([]byte, IOSize)
			m.Put(out)
			var m2 MsgIO
			if err := m2.Unmarshal(out); err != nil || m2 != m {
				t.Fatalf("io %+v → %+v %v", m, m2, err)
			}
		}
		var o MsgOpen
		if o.Unmarshal(b) == nil {
			if len(o.DevName) == 0 || len(o.DevName) >= NameMax || strings.IndexByte(o.DevName, 0) >= 0 {
				t.Fatalf("open name %q", o.DevName)
			}
			out := make([]byte, OpenSize)
			if err := o.Put(out); err != nil {
				t.Fatal(err)
			}
		}
		var r MsgOpenRsp
		if r.Unmarshal(b) == nil && (r.LogicalBlockSize < SectorSize || r.NSectors%uint64(r.LogicalBlockSize/SectorSize) != 0 ||
			int64(r.NSectors)*SectorSize < 0 || r.MaxHWSectors != 0 && int(r.MaxHWSectors)*SectorSize < int(r.LogicalBlockSize) ||
			r.MaxDiscardSectors != 0 && int(r.MaxDiscardSectors)*SectorSize < int(r.LogicalBlockSize)) {
			t.Fatalf("open_rsp %+v", r)
		}
		var c MsgClose
		_ = c.Unmarshal(b)
		var s MsgSessInfo
		_ = s.Unmarshal(b, MsgTypeSessInfo)
	})
}

// TestIOFlagsPerVersion decodes rnbd_msg_io.rw as each kernel's client sends it: 6.1's (2.0:
// SYNC, FUA), 6.12's (2.0 with WRITE_ZEROES as op 5) and 7.2's (2.2: PREFLUSH, NOUNMAP).
func TestIOFlagsPerVersion(t *testing.T) {
	for _, tc := range []struct {
		name string
		rw   uint32
		ok   bool
	}{
		{"6.1 flush", 0x302, true},                // FLUSH | SYNC | FUA
		{"6.1 fua write", 0x301, true},            // WRITE | SYNC | FUA
		{"6.12 write zeroes", 0x005, true},        // WRITE_ZEROES, no flags
		{"7.2 flush", 0x702, true},                // FLUSH | SYNC | FUA | PREFLUSH
		{"7.2 preflush write", 0x501, true},       // WRITE | SYNC | PREFLUSH
		{"7.2 write zeroes nounmap", 0x805, true}, // WRITE_ZEROES | NOUNMAP
		{"7.2 discard", 0x003, true},
		{"nounmap on a write", 0x801, false},
		{"nounmap on a discard", 0x803, false},
		{"bit 12", 0x1001, false},
		{"bit 31", 0x80000001, false},
		{"op 6", 0x006, false},
	} {
		b := make([]byte, IOSize)
		MsgIO{DeviceID: 1, Sector: 8, RW: tc.rw}.Put(b)
		if binary.LittleEndian.Uint32(b[16:]) != tc.rw {
			t.Fatalf("%s: rw not at offset 16", tc.name)
		}
		var m MsgIO
		err := m.Unmarshal(b)
		if tc.ok && (err != nil || m.RW != tc.rw) {
			t.Errorf("%s (%#x): %v", tc.name, tc.rw, err)
		}
		if !tc.ok && !errors.Is(err, syscall.EOPNOTSUPP) {
			t.Errorf("%s (%#x): %v, want EOPNOTSUPP", tc.name, tc.rw, err)
		}
	}
}
