package nbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"golang.org/x/sys/unix"
)

// fakeKernel plays the kernel's NBD family over the exchanger interface: it decodes the
// requests as nbd_genl_connect does, takes the socket descriptors (duplicates: the caller
// closes its own after the answer), shows the backend name in a sysfs of its own, and
// sends DISC and closes the sockets on NBD_CMD_DISCONNECT.
type fakeKernel struct {
	t        *testing.T
	sys      string
	mu       sync.Mutex
	devs     map[int]*fakeDev
	failNext error // the next CONNECT fails with this errno
	loseNext bool  // the next CONNECT succeeds but its answer is lost
	disconns []int
}

type fakeDev struct {
	size, bs, timeout, flags uint64
	backend                  string
	socks                    []net.Conn
}

const fakeFamily = 0x1b

func (k *fakeKernel) Close() error { return nil }

func (k *fakeKernel) exchange(_ context.Context, req []byte) ([][]byte, error) {
	msgs, err := splitMsgs(req)
	if err != nil || len(msgs) != 1 || msgs[0].flags != nlmFRequest|nlmFAck {
		k.t.Errorf("request %x: %v", req, err)
		return nil, syscall.EINVAL
	}
	cmd, attrs, err := genlReply(msgs[0].payload)
	if err != nil {
		return nil, syscall.EINVAL
	}
	if msgs[0].typ == genlIDCtrl {
		if name, _ := findAttr(attrs, ctrlAFamName); string(name) != "nbd\x00" {
			return nil, syscall.ENOENT
		}
		m := newGenlMsg(0, 1, 2)
		m.attr(ctrlAFamID, nle.AppendUint16(nil, fakeFamily))
		return [][]byte{m.bytes(0)[nlmsgHdrLen:]}, nil
	}
	if msgs[0].typ != fakeFamily || msgs[0].payload[1] != nbdVersion {
		return nil, syscall.EOPNOTSUPP
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	switch cmd {
	case nbdCmdConnect:
		return k.connect(attrs)
	case nbdCmdDisconnect:
		idx, ok := attrU32(attrs, nbdAttrIndex)
		if !ok {
			return nil, syscall.EINVAL
		}
		k.disconns = append(k.disconns, int(idx))
		if d := k.devs[int(idx)]; d != nil {
			for _, c := range d.socks {
				var disc [requestSize]byte
				Request{Type: CmdDisc}.Put(disc[:])
				_, _ = c.Write(disc[:])
				c.Close()
			}
			delete(k.devs, int(idx))
			os.RemoveAll(filepath.Join(k.sys, "nbd"+strconv.Itoa(int(idx))))
		}
		return nil, nil
	case nbdCmdReconfigure:
		// As nbd_genl_reconfigure: an index, and the backend the device was connected with.
		idx, ok := attrU32(attrs, nbdAttrIndex)
		d := k.devs[int(idx)]
		if !ok || d == nil {
			return nil, syscall.EINVAL
		}
		if b, _ := findAttr(attrs, nbdAttrBackend); d.backend != "" && strings.TrimRight(string(b), "\x00") != d.backend {
			return nil, syscall.EINVAL
		}
		if b, ok := findAttr(attrs, nbdAttrSizeBytes); ok && len(b) == 8 {
			d.size = nle.Uint64(b)
		}
		return nil, nil
	}
	return nil, syscall.EOPNOTSUPP
}

func (k *fakeKernel) connect(attrs []nlAttr) ([][]byte, error) {
	if err := k.failNext; err != nil {
		k.failNext = nil
		return nil, err
	}
	u64 := func(typ uint16) uint64 {
		d, _ := findAttr(attrs, typ)
		if len(d) != 8 {
			return 0
		}
		return nle.Uint64(d)
	}
	d := &fakeDev{size: u64(nbdAttrSizeBytes), bs: u64(nbdAttrBlockSizeBytes), timeout: u64(nbdAttrTimeout), flags: u64(nbdAttrServerFlags)}
	if b, ok := findAttr(attrs, nbdAttrBackend); ok {
		d.backend = strings.TrimRight(string(b), "\x00")
	}
	socks, _ := findAttr(attrs, nbdAttrSockets)
	items, err := parseAttrs(socks)
	if err != nil || len(items) == 0 {
		return nil, syscall.EINVAL
	}
	for _, it := range items {
		sub, err := parseAttrs(it.data)
		fd, ok := attrU32(sub, nbdSockFD)
		if it.typ != nbdSockItem || err != nil || !ok {
			return nil, syscall.EINVAL
		}
		nfd, err := unix.Dup(int(fd))
		if err != nil {
			return nil, syscall.EBADF
		}
		f := os.NewFile(uintptr(nfd), "kernel")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			return nil, syscall.ENOTSOCK
		}
		d.socks = append(d.socks, c)
	}
	idx := 0
	if i, ok := attrU32(attrs, nbdAttrIndex); ok {
		idx = int(i)
		if k.devs[idx] != nil {
			for _, c := range d.socks {
				c.Close()
			}
			return nil, syscall.EBUSY
		}
	} else {
		for k.devs[idx] != nil {
			idx++
		}
	}
	k.devs[idx] = d
	dir := filepath.Join(k.sys, "nbd"+strconv.Itoa(idx))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		k.t.Error(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "backend"), []byte(d.backend+"\n"), 0o644); err != nil {
		k.t.Error(err)
	}
	if k.loseNext {
		k.loseNext = false
		return nil, errTimeout
	}
	m := newGenlMsg(0, nbdCmdConnect, nbdVersion)
	m.u32(nbdAttrIndex, uint32(idx))
	return [][]byte{m.bytes(0)[nlmsgHdrLen:]}, nil
}

func (k *fakeKernel) dev(i int) *fakeDev { k.mu.Lock(); defer k.mu.Unlock(); return k.devs[i] }

func useFakeKernel(t *testing.T) *fakeKernel {
	k := &fakeKernel{t: t, sys: t.TempDir(), devs: map[int]*fakeDev{}}
	oldOpen, oldSys, oldDev := openKernel, sysBlock, devDir
	openKernel = func(ctx context.Context, _ time.Duration) (*kernelNBD, error) { return newKernelNBD(ctx, k) }
	sysBlock, devDir = k.sys, t.TempDir()
	t.Cleanup(func() { openKernel, sysBlock, devDir = oldOpen, oldSys, oldDev })
	return k
}

func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestAttachFakeKernel: what Attach hands the kernel, IO from the kernel's side of the
// sockets on every connection, and Detach.
func TestAttachFakeKernel(t *testing.T) {
	leakcheck.Check(t)
	k := useFakeKernel(t)
	s := NewServer(Options{Exports: func() []Export { return nil }})
	defer s.Close()
	dev := &memDev{b: make([]byte, 1<<20)}
	e := Export{Name: "s1/disk", Dev: dev}
	ctx := context.Background()
	a, err := s.Attach(ctx, e, AttachOptions{Index: -1, Conns: 2, Timeout: 89500 * time.Millisecond, Backend: "test s1/disk"})
	if err != nil {
		t.Fatal(err)
	}
	if a.Index() != 0 || a.Device() != filepath.Join(devDir, "nbd0") || a.Conns() != 2 {
		t.Fatalf("index %d device %s conns %d", a.Index(), a.Device(), a.Conns())
	}
	d := k.dev(0)
	if d.size != 1<<20 || d.bs != 512 || d.timeout != 90 || d.flags != uint64(TransmissionFlags(e)) || d.backend != "test s1/disk" || len(d.socks) != 2 {
		t.Fatalf("kernel got %+v", d)
	}
	if d.flags&tflagCanMultiConn == 0 || d.flags&tflagReadOnly != 0 {
		t.Fatalf("flags %#x", d.flags)
	}
	// The kernel's requests, without a handshake: a FUA write on one socket, read back on
	// the other, a flush and a trim.
	c0, c1 := &client{t: t, c: d.socks[0]}, &client{t: t, c: d.socks[1]}
	data := bytes.Repeat([]byte{0xa5}, 4096)
	c0.send(Request{Type: CmdWrite, Flags: CmdFlagFUA, Cookie: 1, Offset: 8192, Length: 4096}, data)
	if ck, en, _ := c0.recv(0); ck != 1 || en != 0 {
		t.Fatalf("write: %d %d", ck, en)
	}
	c1.send(Request{Type: CmdRead, Cookie: 2, Offset: 8192, Length: 4096}, nil)
	if ck, en, got := c1.recv(4096); ck != 2 || en != 0 || !bytes.Equal(got, data) {
		t.Fatalf("read: %d %d", ck, en)
	}
	c1.send(Request{Type: CmdFlush, Cookie: 3}, nil)
	c0.send(Request{Type: CmdTrim, Cookie: 4, Offset: 8192, Length: 512}, nil)
	if ck, en, _ := c1.recv(0); ck != 3 || en != 0 {
		t.Fatalf("flush: %d %d", ck, en)
	}
	if ck, en, _ := c0.recv(0); ck != 4 || en != 0 {
		t.Fatalf("trim: %d %d", ck, en)
	}
	c0.send(Request{Type: CmdRead, Cookie: 5, Offset: 1 << 20, Length: 512}, nil)
	if ck, en, _ := c0.recv(0); ck != 5 || en != errInval {
		t.Fatalf("read past the end: %d %d", ck, en)
	}
	dev.mu.Lock()
	fua, flushes, b0, b1 := dev.fua, dev.flushes, dev.b[8192], dev.b[8192+512]
	dev.mu.Unlock()
	if fua != 1 || flushes != 1 || b0 != 0 || b1 != 0xa5 {
		t.Fatalf("device: fua %d flushes %d", fua, flushes)
	}
	if a.Busy() {
		t.Error("busy without a device node")
	}
	// Resize: the kernel takes the new size with the backend name; part of a block, none
	// at all, and a detached device are refused before the kernel is asked.
	if err := a.Resize(ctx, 2<<20); err != nil || k.dev(0).size != 2<<20 {
		t.Fatalf("resize: %v, kernel has %d", err, k.dev(0).size)
	}
	for _, bad := range []int64{0, -512, 2<<20 + 100} {
		if err := a.Resize(ctx, bad); !errors.Is(err, syscall.EINVAL) || k.dev(0).size != 2<<20 {
			t.Fatalf("resize to %d: %v, kernel has %d", bad, err, k.dev(0).size)
		}
	}
	k.mu.Lock()
	k.devs[0].backend = "someone else"
	k.mu.Unlock()
	if err := a.Resize(ctx, 4096); !errors.Is(err, syscall.EINVAL) || k.dev(0).size != 2<<20 {
		t.Fatalf("resize of a device with another backend: %v", err)
	}
	k.mu.Lock()
	k.devs[0].backend = "test s1/disk"
	k.mu.Unlock()
	if err := a.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Resize(ctx, 4096); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("resize after Detach: %v", err)
	}
	select {
	case <-a.Done():
	default:
		t.Fatal("connections still served after Detach")
	}
	if fmt.Sprint(k.disconns) != "[0]" || k.dev(0) != nil {
		t.Fatalf("disconnects %v", k.disconns)
	}
	if err := a.Detach(ctx); err != nil || len(k.disconns) != 1 {
		t.Fatalf("second Detach: %v %v", err, k.disconns)
	}
	// The index is free again, and a given one is taken.
	a2, err := s.Attach(ctx, e, AttachOptions{Index: 7, Conns: 1})
	if err != nil || a2.Index() != 7 || !strings.Contains(k.dev(7).backend, "export s1/disk #") {
		t.Fatalf("index 7: %v", err)
	}
	if err := a2.Detach(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestAttachFailures: refused exports, a refusing kernel, a lost answer: nothing is left
// attached and no descriptor stays open.
func TestAttachFailures(t *testing.T) {
	leakcheck.Check(t)
	k := useFakeKernel(t)
	s := NewServer(Options{Exports: func() []Export { return nil }})
	defer s.Close()
	ctx := context.Background()
	// A first attachment: the runtime's poller exists before descriptors are counted.
	a, err := s.Attach(ctx, Export{Name: "d", Dev: &memDev{b: make([]byte, 4096)}}, AttachOptions{Index: 1})
	if err != nil {
		t.Fatal(err)
	}
	fds := openFDs(t)
	for _, e := range []Export{
		{Name: "big blocks", Dev: &bigBlocks{memDev{b: make([]byte, 1<<20)}}},
		{Name: "empty", Dev: &memDev{}},
		{Name: "none"},
	} {
		if _, err := s.Attach(ctx, e, AttachOptions{Index: -1}); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: %v", e.Name, err)
		}
	}
	e := Export{Name: "s/d", Dev: &memDev{b: make([]byte, 1<<20)}}
	if _, err := s.Attach(ctx, e, AttachOptions{Index: 1 << 20}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("index 1<<20: %v", err)
	}
	_, err = s.Attach(ctx, e, AttachOptions{Index: 1, Conns: 3})
	if !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "/dev/nbd1") {
		t.Errorf("busy index: %v", err)
	}
	k.mu.Lock()
	k.failNext = syscall.EPERM
	k.mu.Unlock()
	if _, err := s.Attach(ctx, e, AttachOptions{Index: -1}); !errors.Is(err, syscall.EPERM) {
		t.Errorf("refused: %v", err)
	}
	// The kernel took the device but the answer never came: the device showing our
	// backend name is disconnected again.
	k.mu.Lock()
	k.loseNext = true
	k.mu.Unlock()
	if _, err := s.Attach(ctx, e, AttachOptions{Index: -1, Backend: "lost"}); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Errorf("lost answer: %v", err)
	}
	if fmt.Sprint(k.disconns) != "[0]" || k.dev(0) != nil {
		t.Errorf("after a lost answer: disconnects %v", k.disconns)
	}
	testutil.WaitFor(t, 5*time.Second, "descriptors closed", func() bool { return openFDs(t) == fds })
	// A device that is no longer ours (its backend name changed) is not disconnected.
	if err := os.WriteFile(filepath.Join(k.sys, "nbd1", "backend"), []byte("someone else\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Detach(ctx); err != nil || len(k.disconns) != 1 {
		t.Fatalf("detach of a device taken over: %v %v", err, k.disconns)
	}
	for _, c := range k.dev(1).socks {
		c.Close()
	}
}

// TestAttachKernelDrops: the kernel shutting the sockets down (timeouts, a disconnect from
// elsewhere) ends the attachment's connections.
func TestAttachKernelDrops(t *testing.T) {
	leakcheck.Check(t)
	k := useFakeKernel(t)
	s := NewServer(Options{Exports: func() []Export { return nil }})
	defer s.Close()
	a, err := s.Attach(context.Background(), Export{Name: "d", Dev: &memDev{b: make([]byte, 1<<20)}}, AttachOptions{Index: -1, Conns: 2})
	if err != nil {
		t.Fatal(err)
	}
	d := k.dev(0)
	d.socks[0].Close()
	testutil.WaitFor(t, 5*time.Second, "one connection left", func() bool { return a.Conns() == 1 })
	d.socks[1].Close()
	select {
	case <-a.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed")
	}
	// Detach still cleans the kernel's side: the device shows our name.
	if err := a.Detach(context.Background()); err != nil || fmt.Sprint(k.disconns) != "[0]" {
		t.Fatalf("%v %v", err, k.disconns)
	}
}

type bigBlocks struct{ memDev }

func (*bigBlocks) BlockSize() int { return 64 << 10 }

// TestDisconnectStale: only the devices the predicate names are disconnected.
func TestDisconnectStale(t *testing.T) {
	k := useFakeKernel(t)
	if got, err := DisconnectStale(context.Background(), func(string) bool { return true }); got != nil || err != nil {
		t.Fatalf("no devices: %v %v", got, err)
	}
	for i, b := range []string{"old 1", "mine", "old 2"} {
		dir := filepath.Join(k.sys, "nbd"+strconv.Itoa(i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "backend"), []byte(b+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := DisconnectStale(context.Background(), func(b string) bool { return strings.HasPrefix(b, "old ") })
	if err != nil || fmt.Sprint(got) != "[0 2]" || fmt.Sprint(k.disconns) != "[0 2]" {
		t.Fatalf("%v %v %v", got, err, k.disconns)
	}
}
