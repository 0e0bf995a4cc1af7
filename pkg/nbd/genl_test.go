package nbd

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/testutil"
)

// golden decodes hex laid out by field; '#' starts a comment to the end of the line. The
// bytes are little endian: the tests run on amd64 and arm64.
func golden(t testing.TB, s string) []byte {
	t.Helper()
	var b strings.Builder
	for _, l := range strings.Split(s, "\n") {
		l, _, _ = strings.Cut(l, "#")
		b.WriteString(l + " ")
	}
	return testutil.Unhex(t, b.String())
}

// TestEncodeConnect: NBD_CMD_CONNECT as <linux/nbd-netlink.h> and nla_parse lay it out.
func TestEncodeConnect(t *testing.T) {
	got := encodeConnect(0x1a, connectReq{index: 3, size: 1 << 20, blockSize: 512, timeout: 90,
		serverFlags: 0x12d, fds: []int{7, 8}, backend: "x"})
	want := golden(t, `
		7c000000 1a00 0500 00000000 00000000   # nlmsghdr: length 124, family, REQUEST|ACK, seq, pid
		01 01 0000                             # genlmsghdr: CONNECT, version 1
		0800 0100 03000000                     # INDEX 3
		0c00 0200 0000100000000000             # SIZE_BYTES 1 MiB
		0c00 0300 0002000000000000             # BLOCK_SIZE_BYTES 512
		0c00 0400 5a00000000000000             # TIMEOUT 90
		0c00 0500 2d01000000000000             # SERVER_FLAGS
		0c00 0600 0000000000000000             # CLIENT_FLAGS
		1c00 0780                              # SOCKETS (nested)
		  0c00 0180 0800 0100 07000000         # SOCK_ITEM [SOCK_FD 7]
		  0c00 0180 0800 0100 08000000         # SOCK_ITEM [SOCK_FD 8]
		0600 0a00 7800 0000                    # BACKEND_IDENTIFIER "x\0", padded
	`)
	if !bytes.Equal(got, want) {
		t.Fatalf("CONNECT\n got %x\nwant %x", got, want)
	}
	// Any device: no INDEX; no TIMEOUT when none is asked for; no backend.
	got = encodeConnect(0x1a, connectReq{index: -1, size: 4096, blockSize: 4096, fds: []int{5}})
	want = golden(t, `
		54000000 1a00 0500 00000000 00000000   # length 84
		01 01 0000
		0c00 0200 0010000000000000
		0c00 0300 0010000000000000
		0c00 0500 0000000000000000
		0c00 0600 0000000000000000
		1000 0780 0c00 0180 0800 0100 05000000
	`)
	if !bytes.Equal(got, want) {
		t.Fatalf("CONNECT any\n got %x\nwant %x", got, want)
	}
}

func TestEncodeIndexCmds(t *testing.T) {
	if got, want := encodeIndexCmd(0x1a, nbdCmdDisconnect, 2), golden(t, `
		1c000000 1a00 0500 00000000 00000000  02 01 0000  0800 0100 02000000`); !bytes.Equal(got, want) {
		t.Errorf("DISCONNECT\n got %x\nwant %x", got, want)
	}
	if got, want := encodeIndexCmd(0x1a, nbdCmdStatus, -1), golden(t, `
		14000000 1a00 0500 00000000 00000000  05 01 0000`); !bytes.Equal(got, want) {
		t.Errorf("STATUS\n got %x\nwant %x", got, want)
	}
	if got, want := encodeResize(0x1a, 2, 1<<30, "x"), golden(t, `
		30000000 1a00 0500 00000000 00000000  03 01 0000   # length 48
		0800 0100 02000000                     # INDEX 2
		0c00 0200 0000004000000000             # SIZE_BYTES 1 GiB
		0600 0a00 7800 0000                    # BACKEND_IDENTIFIER "x\0", padded
	`); !bytes.Equal(got, want) {
		t.Errorf("RECONFIGURE\n got %x\nwant %x", got, want)
	}
	m := newGenlMsg(genlIDCtrl, ctrlCmdGetFa, 2)
	m.str(ctrlAFamName, "nbd")
	if got, want := m.bytes(0), golden(t, `
		1c000000 1000 0500 00000000 00000000  03 02 0000  0800 0200 6e626400`); !bytes.Equal(got, want) {
		t.Errorf("GETFAMILY\n got %x\nwant %x", got, want)
	}
}

// TestDecodeReplies: the kernel's answers to CONNECT, STATUS and GETFAMILY, and errors.
func TestDecodeReplies(t *testing.T) {
	// nbd_connect_reply: genlmsghdr CONNECT, INDEX 5.
	idx, err := decodeConnectReply([][]byte{golden(t, "01 01 0000 0800 0100 05000000")})
	if err != nil || idx != 5 {
		t.Fatalf("connect reply: %d %v", idx, err)
	}
	if _, err := decodeConnectReply(nil); !errors.Is(err, syscall.EBADMSG) {
		t.Errorf("connect without an answer: %v", err)
	}
	// nbd_genl_status: DEVICE_LIST (not flagged nested, nla_nest_start_noflag) of two items.
	st, err := decodeStatusReply([][]byte{golden(t, `05 01 0000
		2c00 0900
		  1400 0100 0800 0100 00000000 0500 0200 01 000000
		  1400 0100 0800 0100 01000000 0500 0200 00 000000`)})
	if err != nil || len(st) != 2 || st[0] != (DeviceStatus{0, true}) || st[1] != (DeviceStatus{1, false}) {
		t.Fatalf("status: %+v %v", st, err)
	}
	// CTRL_CMD_NEWFAMILY: FAMILY_ID 0x1a, FAMILY_NAME "nbd", VERSION 1.
	x := &scripted{answers: [][][]byte{{golden(t, `01 02 0000
		0600 0100 1a00 0000  0800 0200 6e626400  0800 0300 01000000`)}}}
	id, ver, err := genlFamily(context.Background(), x, "nbd")
	if err != nil || id != 0x1a || ver != 1 {
		t.Fatalf("family: %#x %d %v", id, ver, err)
	}
	if !bytes.Contains(x.sent[0], []byte("nbd\x00")) {
		t.Errorf("GETFAMILY sent %x", x.sent[0])
	}
	// Malformed attribute runs are errors, never panics.
	for _, b := range []string{"01 01 00", "01 01 0000 0300 0100", "01 01 0000 0900 0100 05000000", "01 01 0000 0800 0100 0500"} {
		if _, err := decodeConnectReply([][]byte{golden(t, b)}); err == nil {
			t.Errorf("%s decoded", b)
		}
	}
}

func TestAckErrors(t *testing.T) {
	mk := func(flags uint16, payload string) nlReply {
		return nlReply{typ: nlmsgError, flags: flags, payload: golden(t, payload)}
	}
	if err := ackError(mk(0, "00000000 1c000000 1a00 0500 01000000 00000000")); err != nil {
		t.Errorf("ACK: %v", err)
	}
	// -EBUSY with the request's header (capped) and an extended ack message.
	err := ackError(mk(nlmFCapped|nlmFAckTLVs, `f0ffffff 1c000000 1a00 0500 01000000 00000000
		0900 0100 62757379 00 000000`))
	if !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "busy") {
		t.Errorf("EBUSY: %v", err)
	}
	if err := ackError(mk(0, "eaffffff 1c000000 1a00 0500 01000000 00000000")); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("EINVAL: %v", err)
	}
	for _, p := range []string{"00", "01000000", "00f0ffff"} {
		if err := ackError(mk(0, p)); !errors.Is(err, syscall.EBADMSG) {
			t.Errorf("%s: %v", p, err)
		}
	}
	// Answers to other requests are dropped; the ACK ends the answer.
	var out [][]byte
	msgs, err := splitMsgs(golden(t, `
		18000000 1a00 0000 06000000 00000000  01 01 0000 aaaaaaaa
		18000000 1a00 0000 07000000 00000000  01 01 0000 bbbbbbbb
		24000000 0200 0001 07000000 00000000  00000000 1c000000 1a00 0500 07000000 00000000`))
	if err != nil || len(msgs) != 3 {
		t.Fatalf("split: %d %v", len(msgs), err)
	}
	done, err := collect(msgs, 7, &out)
	if !done || err != nil || len(out) != 1 || !bytes.Equal(out[0], golden(t, "01 01 0000 bbbbbbbb")) {
		t.Errorf("collect: %v %v %x", done, err, out)
	}
	if _, err := splitMsgs(golden(t, "ff000000 1a00 0000 07000000 00000000")); err == nil {
		t.Error("overlong message split")
	}
}

func FuzzGenlDecode(f *testing.F) {
	f.Add([]byte{5, 1, 0, 0, 0x18, 0, 9, 0, 0x14, 0, 1, 0, 8, 0, 1, 0, 0, 0, 0, 0, 5, 0, 2, 0, 1, 0, 0, 0})
	f.Add([]byte{1, 1, 0, 0, 8, 0, 1, 0, 5, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = decodeConnectReply([][]byte{b})
		_, _ = decodeStatusReply([][]byte{b})
		if msgs, err := splitMsgs(b); err == nil {
			var out [][]byte
			_, _ = collect(msgs, 0, &out)
			for _, m := range msgs {
				_ = ackError(nlReply{typ: nlmsgError, flags: nlmFAckTLVs, payload: m.payload})
			}
		}
	})
}

// scripted is an exchanger answering from a list.
type scripted struct {
	answers [][][]byte
	errs    []error
	sent    [][]byte
}

func (s *scripted) exchange(_ context.Context, req []byte) ([][]byte, error) {
	i := len(s.sent)
	s.sent = append(s.sent, append([]byte(nil), req...))
	var err error
	if i < len(s.errs) {
		err = s.errs[i]
	}
	if i < len(s.answers) {
		return s.answers[i], err
	}
	return nil, err
}

func (s *scripted) Close() error { return nil }

// TestNoNBDFamily: a kernel without the family is a clear ENODEV.
func TestNoNBDFamily(t *testing.T) {
	_, err := newKernelNBD(context.Background(), &scripted{errs: []error{syscall.ENOENT}})
	if !errors.Is(err, syscall.ENODEV) || !strings.Contains(err.Error(), "modprobe nbd") {
		t.Fatalf("%v", err)
	}
}

// TestGenlSocket talks to this machine's kernel: the controller resolves itself, and a
// family that does not exist is ENOENT.
func TestGenlSocket(t *testing.T) {
	s, err := openGenl(5 * time.Second)
	if err != nil {
		t.Skipf("no generic netlink socket here: %v", err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	id, _, err := genlFamily(ctx, s, "nlctrl")
	if err != nil || id != genlIDCtrl {
		t.Fatalf("nlctrl: %#x %v", id, err)
	}
	if _, _, err := genlFamily(ctx, s, "rtrs-nofamily"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("missing family: %v", err)
	}
	// An expired context sends nothing.
	dead, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, _, err := genlFamily(dead, s, "nlctrl"); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
}
