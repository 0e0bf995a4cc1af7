package main

import (
	"errors"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/ublk"
)

// TestUblkClaim: an attach told ublk=N takes device N over only when it is the same mapping's
// (its mark, logical block and read-only mode, whatever its size: the export may have been
// resized meanwhile), or an older daemon's of the mapping's size; it deletes one of its own left
// added but never started, whatever its size, and refuses anything else, so that waiting IO and mounted file
// systems never resume against another volume.
func TestUblkClaim(t *testing.T) {
	const sess, path, size = "store1", "/dev/vol1", 64 << 20
	own := ublkOwner(sess, path)
	if uint32(own) != ublkMark || own>>32 == 0 {
		t.Fatalf("mark %#x: want ublkMark in the low half and a mapping in the high", own)
	}
	for _, other := range []uint64{ublkOwner("store2", path), ublkOwner(sess, "/dev/vol2"), ublkOwner(sess+"/dev", "vol1")} {
		if other == own {
			t.Fatalf("two mappings share the mark %#x", own)
		}
	}
	live := func(flags uint64) ublk.DevInfo { return ublk.DevInfo{SrvFlags: flags, State: ublk.StateQuiesced} }
	sized := func(sectors uint64) ublk.Params {
		return ublk.Params{Basic: ublk.ParamBasic{DevSectors: sectors, LogicalBSShift: 9}}
	}
	want := sized(size >> 9)
	bigBlocks, ro := want, want
	bigBlocks.Basic.LogicalBSShift = 12
	ro.Basic.Attrs |= ublk.AttrReadOnly
	for _, c := range []struct {
		name string
		info ublk.DevInfo
		p    ublk.Params
		want claim
	}{
		{"its own", live(own), sized(size >> 9), claimRecover},
		{"an older daemon's", live(ublkMark), sized(size >> 9), claimLegacy},
		{"its own, never started", ublk.DevInfo{SrvFlags: own, State: ublk.StateDead}, sized(size >> 9), claimDelete},
		{"its own, dead before its parameters", ublk.DevInfo{SrvFlags: own, State: ublk.StateDead}, sized(0), claimDelete},
		{"another mapping's of the same size", live(ublkOwner("store2", path)), sized(size >> 9), claimRefuse},
		{"another mapping's, never started", ublk.DevInfo{SrvFlags: ublkOwner("store2", path), State: ublk.StateDead}, sized(size >> 9), claimRefuse},
		{"another program's", live(0), sized(size >> 9), claimRefuse},
		{"its own, another size (resized on the server meanwhile)", live(own), sized(size>>9 + 8), claimRecover},
		{"an older daemon's, another size", live(ublkMark), sized(size >> 10), claimRefuse},
		{"its own, another logical block", live(own), bigBlocks, claimRefuse},
		{"its own, read-only where the mapping is not", live(own), ro, claimRefuse},
	} {
		got, err := ublkClaim(c.info, c.p, sess, path, want)
		if got != c.want {
			t.Errorf("%s: claim %d (%v), want %d", c.name, got, err, c.want)
		}
		if (got == claimRefuse) != (err != nil) || got == claimRefuse && !errors.Is(err, syscall.EEXIST) {
			t.Errorf("%s: error %v with claim %d", c.name, err, got)
		}
	}
}

// TestUblkParams: the device's limits as the server gave them, in whole blocks: a discard or
// write-zeroes limit of less than one block is none (no request could keep to it); io_opt is
// the largest IO, as the kernel's client gives it, in the power of two ublk takes.
func TestUblkParams(t *testing.T) {
	g := rnbd.MsgOpenRsp{NSectors: 1 << 20, LogicalBlockSize: 4096, PhysicalBlockSize: 4096, MaxDiscardSectors: 1,
		MaxWriteZeroesSectors: 15, DiscardGranularity: 4096, CachePolicy: rnbd.CacheWriteback}
	p := ublkParamsOf(g, false, 124<<10)
	if p.Types&ublk.ParamTypeDiscard == 0 || p.Discard.MaxDiscardSectors != 0 || p.Discard.MaxDiscardSegments != 0 || p.Discard.MaxWriteZeroesSectors != 8 {
		t.Fatalf("a discard limit of one sector and zeroes of 15, with 4 KiB blocks: %+v", p.Discard)
	}
	if p.Basic.IOOptShift != 16 || p.Basic.IOMinShift != 12 || p.Basic.MaxSectors != 248 {
		t.Fatalf("io_opt 2^%d, io_min 2^%d, max %d sectors: want 2^16 (64 KiB, under 124), 2^12, 248", p.Basic.IOOptShift, p.Basic.IOMinShift, p.Basic.MaxSectors)
	}
	if p.Basic.Attrs&ublk.AttrVolatileCache == 0 || p.Basic.Attrs&ublk.AttrFUA != 0 {
		t.Fatalf("attrs %#x: a volatile cache without FUA", p.Basic.Attrs)
	}
	g.MaxWriteZeroesSectors = 7
	if p := ublkParamsOf(g, true, 1<<20); p.Types&ublk.ParamTypeDiscard != 0 || p.Basic.Attrs&ublk.AttrReadOnly == 0 || p.Basic.IOOptShift != 20 {
		t.Fatalf("both limits under a block, read-only: types %#x attrs %#x io_opt 2^%d", p.Types, p.Basic.Attrs, p.Basic.IOOptShift)
	}
}
