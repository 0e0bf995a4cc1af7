package transport

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"

	"github.com/google/uuid"
)

var (
	uuidA = uuid.UUID{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
	uuidB = uuid.UUID{16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}
)

// Golden bytes written from the offset tables of spec section 1, field by field.
func TestConnReqGolden(t *testing.T) {
	want := testutil.Unhex(t, `
		00 00          bd1b  0002   0100  0300    0200
		000102030405060708090a0b0c0d0e0f
		101112131415161718191a1b1c1d1e1f
		01 0000000000000000000000`)
	m := MsgConnReq{Cid: 1, CidNum: 3, ReconCnt: 2, SessUUID: uuidA, PathsUUID: uuidB, FirstConn: true}
	got := m.Marshal()
	if !bytes.Equal(got, want) || len(got) != 56 {
		t.Fatalf("conn_req\n%x\nwant\n%x", got, want)
	}
	var d MsgConnReq
	if err := d.Unmarshal(want); err != nil || d != m {
		t.Fatalf("decoded %+v %v", d, err)
	}
	// Minor version is ignored; major is checked; magic is checked; short is refused.
	minor := bytes.Clone(want)
	minor[4] = 0x07
	if err := d.Unmarshal(minor); err != nil {
		t.Fatalf("minor version refused: %v", err)
	}
	major := bytes.Clone(want)
	major[5] = 0x03
	bad := bytes.Clone(want)
	bad[2] = 0
	for _, b := range [][]byte{major, bad, want[:55]} {
		if err := d.Unmarshal(b); !errors.Is(err, ErrMsg) {
			t.Fatalf("accepted %x", b)
		}
	}
}

func TestConnRspGolden(t *testing.T) {
	want := testutil.Unhex(t, `bd1b 0002 efff 0002 00f00100 00100000 02000000`+strings.Repeat("00", 36))
	m := MsgConnRsp{Errno: -17, QueueDepth: 512, MaxIOSize: 126976, MaxHdrSize: 4096, Flags: MsgNewRkeyF}
	if got := m.Marshal(); !bytes.Equal(got, want) {
		t.Fatalf("conn_rsp\n%x\nwant\n%x", got, want)
	}
	var d MsgConnRsp
	if err := d.Unmarshal(want); err != nil || d != m {
		t.Fatalf("decoded %+v %v", d, err)
	}
}

func TestInfoGolden(t *testing.T) {
	req := MsgInfoReq{PathName: "sess"}
	b, err := req.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	want := append(testutil.Unhex(t, "0000 73657373"), make([]byte, 272-6)...)
	if !bytes.Equal(b, want) {
		t.Fatalf("info_req %x", b)
	}
	var dr MsgInfoReq
	if err := dr.Unmarshal(b); err != nil || dr.PathName != "sess" {
		t.Fatal(dr, err)
	}
	if _, err := (&MsgInfoReq{PathName: strings.Repeat("x", 255)}).Marshal(); err == nil {
		t.Fatal("255-byte name leaves no terminator")
	}
	full := bytes.Clone(want)
	for i := 2; i < 257; i++ {
		full[i] = 'a'
	}
	if err := dr.Unmarshal(full); !errors.Is(err, ErrMsg) {
		t.Fatal("unterminated name accepted")
	}

	rsp := MsgInfoRsp{Desc: []SgDesc{{Addr: 0x1122334455667788, Key: 0xaabbccdd, Len: 0x20000}, {Addr: 1, Key: 2, Len: 3}}}
	want = testutil.Unhex(t, `0100 0200 00000000
		8877665544332211 ddccbbaa 00000200
		0100000000000000 02000000 03000000`)
	if got := rsp.Marshal(); !bytes.Equal(got, want) {
		t.Fatalf("info_rsp\n%x\nwant\n%x", got, want)
	}
	var d MsgInfoRsp
	if err := d.Unmarshal(want, 2); err != nil || len(d.Desc) != 2 || d.Desc[0] != rsp.Desc[0] {
		t.Fatal(d, err)
	}
	for _, bad := range [][]byte{want[:30], testutil.Unhex(t, "0100 0000 00000000")} {
		if err := d.Unmarshal(bad, 2); !errors.Is(err, ErrMsg) {
			t.Fatalf("accepted %x", bad)
		}
	}
	if err := d.Unmarshal(want, 1); !errors.Is(err, ErrMsg) {
		t.Fatal("more descriptors than the queue depth accepted")
	}
}

func TestIOHeadersGolden(t *testing.T) {
	rd := MsgRdmaRead{UsrLen: 32, Flags: MsgNeedInvalF, Desc: []SgDesc{{Addr: 0x10, Key: 0x20, Len: 0x1000}}}
	b := make([]byte, ReadHdrSize(1))
	rd.Put(b)
	want := testutil.Unhex(t, "0300 2000 0100 0100 1000000000000000 20000000 00100000")
	if !bytes.Equal(b, want) || len(b) != 24 {
		t.Fatalf("read header %x", b)
	}
	var d MsgRdmaRead
	if err := d.Unmarshal(b); err != nil || d.UsrLen != 32 || d.Flags != 1 || d.Desc[0] != rd.Desc[0] {
		t.Fatal(d, err)
	}
	two := testutil.Unhex(t, "0300 2000 0100 0200")
	if err := d.Unmarshal(append(two, make([]byte, 32)...)); !errors.Is(err, ErrMsg) {
		t.Fatal("sg_cnt 2 accepted")
	}
	w := make([]byte, 4)
	PutMsgRdmaWrite(w, 32)
	if !bytes.Equal(w, testutil.Unhex(t, "0200 2000")) {
		t.Fatalf("write header %x", w)
	}
	if typ, n := reqHdr(w); typ != MsgTypeWrite || n != 32 {
		t.Fatalf("write header read as type %d, user header %d", typ, n)
	}
	if typ, n := reqHdr(b); typ != MsgTypeRead || n != 32 {
		t.Fatalf("read header read as type %d, user header %d", typ, n)
	}
	rk := MsgRkeyRsp{BufID: 5, Rkey: 0x12345678}
	r := make([]byte, 8)
	rk.Put(r)
	if !bytes.Equal(r, testutil.Unhex(t, "0400 0500 78563412")) {
		t.Fatalf("rkey_rsp %x", r)
	}
	var dk MsgRkeyRsp
	if err := dk.Unmarshal(r); err != nil || dk != rk {
		t.Fatal(dk, err)
	}
}

func TestImmediates(t *testing.T) {
	if ImmHBMsgValue != 0x80000000 || ImmHBAckValue != 0x90000000 {
		t.Fatal("heartbeat immediates")
	}
	if got := IORspImm(5, -5, false); got != 0x10280005 {
		t.Fatalf("io rsp imm %#x", got)
	}
	if IORspImm(5, 5, false) != IORspImm(5, -5, false) {
		t.Fatal("errno sign must not matter")
	}
	if got := IORspImm(0x7ffff, 0, true); got != 0x2007ffff {
		t.Fatalf("io rsp w/inv imm %#x", got)
	}
	typ, pl := ImmFields(0x10280005)
	if id, errno := IORspFields(pl); typ != ImmIORsp || id != 5 || errno != -5 {
		t.Fatal(typ, id, errno)
	}
	for _, c := range []struct{ qd, bits int }{{1, 0}, {2, 1}, {3, 2}, {512, 9}, {513, 10}, {65535, 16}} {
		if ChunkBits(c.qd) != c.bits {
			t.Errorf("ChunkBits(%d) = %d, want %d", c.qd, ChunkBits(c.qd), c.bits)
		}
	}
	mb := MemBits(512)
	if mb != 19 {
		t.Fatal(mb)
	}
	imm := IOReqImm(3, 0x1004, mb)
	if imm != 0x181004 {
		t.Fatalf("io req imm %#x", imm)
	}
	_, pl = ImmFields(imm)
	if id, off := IOReqFields(pl, mb); id != 3 || off != 0x1004 {
		t.Fatal(id, off)
	}
	if CheckImmBits(512, 128<<10) != nil || CheckImmBits(32768, 8192) != nil {
		t.Fatal("defaults must fit")
	}
	if CheckImmBits(65535, 8192) == nil || CheckImmBits(4096, 1<<17) == nil {
		t.Fatal("28-bit rule not enforced")
	}
}

func FuzzDecoders(f *testing.F) {
	f.Add((&MsgConnReq{Cid: 1, CidNum: 3}).Marshal())
	f.Add((&MsgConnRsp{QueueDepth: 512}).Marshal())
	f.Add((&MsgInfoRsp{Desc: []SgDesc{{1, 2, 3}}}).Marshal())
	f.Add(testutil.Unhex(f, "0300 2000 0100 0100 1000000000000000 20000000 00100000"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var cr, cr2 MsgConnReq
		if cr.Unmarshal(b) == nil && (cr2.Unmarshal(cr.Marshal()) != nil || cr2 != cr) {
			t.Fatal("conn_req round trip")
		}
		var cs, cs2 MsgConnRsp
		if cs.Unmarshal(b) == nil && (cs2.Unmarshal(cs.Marshal()) != nil || cs2 != cs) {
			t.Fatal("conn_rsp round trip")
		}
		var ir MsgInfoReq
		if ir.Unmarshal(b) == nil && len(ir.PathName) >= 255 {
			t.Fatal("name too long")
		}
		var is MsgInfoRsp
		if is.Unmarshal(b, 512) == nil && (len(is.Desc) == 0 || len(is.Desc) > 512) {
			t.Fatal("info_rsp descriptor count")
		}
		var rd MsgRdmaRead
		if rd.Unmarshal(b) == nil && len(rd.Desc) > 1 {
			t.Fatal("read descriptors")
		}
		var rk MsgRkeyRsp
		_ = rk.Unmarshal(b)
		if len(b) >= writeHdrSize {
			typ, n := reqHdr(b)
			w := make([]byte, writeHdrSize)
			PutMsgRdmaWrite(w, uint16(n))
			if typ == MsgTypeWrite && !bytes.Equal(w, b[:writeHdrSize]) {
				t.Fatal("write header round trip")
			}
		}
	})
}
