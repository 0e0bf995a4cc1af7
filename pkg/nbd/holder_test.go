package nbd

import (
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
)

// heldDev is a memDev that counts its openers as rnbd.Device does, refuses new ones once
// closed, and revokes them on unmap.
type heldDev struct {
	*memDev
	mu      sync.Mutex
	holders []string
	revoke  []func()
	closed  bool
}

func (d *heldDev) Hold(who string, revoke func()) (func(), error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("being unmapped: %w", syscall.ENODEV)
	}
	d.holders = append(d.holders, who)
	d.revoke = append(d.revoke, revoke)
	return func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		i := slices.Index(d.holders, who)
		d.holders = slices.Delete(d.holders, i, i+1)
	}, nil
}

// unmap refuses new openers and revokes the ones there are.
func (d *heldDev) unmap() {
	d.mu.Lock()
	d.closed = true
	rv := d.revoke
	d.revoke = nil
	d.mu.Unlock()
	for _, f := range rv {
		f()
	}
}

func (d *heldDev) list() []string { d.mu.Lock(); defer d.mu.Unlock(); return slices.Clone(d.holders) }

// waitHolders waits up to 5 s for the device's openers to be want.
func (d *heldDev) waitHolders(t *testing.T, want []string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Equal(d.list(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("holders %q, want %q", d.list(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSocketClientsHold: a socket client holds its export's device from its GO to its
// disconnect, named by its pid; an unmap under it closes its connection; a GO for a device
// that takes no opener (being unmapped) is answered with an error; an attachment's
// transmission takes no hold.
func TestSocketClientsHold(t *testing.T) {
	leakcheck.Check(t)
	dev := &heldDev{memDev: &memDev{b: make([]byte, 1<<20)}}
	exp := Export{Name: "d", Dev: dev}
	sock, srv := startServerOpts(t, Options{}, exp)
	me := []string{fmt.Sprintf("NBD client pid %d at connect", os.Getpid())}

	c1 := hello(t, sock)
	sendOpt(t, c1, optInfo, goData("d"))
	for {
		if _, typ, _ := readOptReply(t, c1); typ == repAck {
			break
		}
	}
	if got := dev.list(); len(got) != 0 {
		t.Fatalf("held after NBD_OPT_INFO: %q", got)
	}
	cl := goOn(t, c1, "d")
	dev.waitHolders(t, me)
	cl.send(Request{Type: CmdRead, Cookie: 1, Length: 512}, nil)
	if _, e, _ := cl.recv(512); e != 0 {
		t.Fatalf("read: errno %d", e)
	}
	cl.send(Request{Type: CmdDisc}, nil)
	c1.Close()
	dev.waitHolders(t, nil)

	// Unmapped under a client: its connection is closed.
	c2 := hello(t, sock)
	defer c2.Close()
	goOn(t, c2, "d")
	dev.waitHolders(t, me)
	dev.unmap()
	_ = c2.SetDeadline(time.Now().Add(5 * time.Second))
	var b [1]byte
	if _, err := c2.Read(b[:]); err != io.EOF {
		t.Errorf("a client of a device unmapped under it: %v, want EOF", err)
	}
	dev.waitHolders(t, nil)

	// A device that takes no opener: GO is refused with an error reply.
	c3 := hello(t, sock)
	defer c3.Close()
	sendOpt(t, c3, optGo, goData("d"))
	if _, typ, data := readOptReply(t, c3); typ != repErrUnknwn || !strings.Contains(string(data), "unmapped") {
		t.Errorf("GO for a device being unmapped: reply %#x %q", typ, data)
	}
	if got := dev.list(); len(got) != 0 {
		t.Errorf("holders %q", got)
	}

	// The kernel's attachment is served without a hold (its front end answers for it).
	dev.mu.Lock()
	dev.closed = false
	dev.mu.Unlock()
	ours, theirs := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- srv.ServeTransmission(ours, exp) }()
	cl = &client{t: t, c: theirs}
	cl.send(Request{Type: CmdRead, Cookie: 3, Length: 512}, nil)
	if _, e, _ := cl.recv(512); e != 0 {
		t.Fatalf("read: errno %d", e)
	}
	if got := dev.list(); len(got) != 0 {
		t.Errorf("an attachment holds: %q", got)
	}
	// DISC, then close: a close right after the reply may race the pipe's write of it, which
	// a pipe (unlike a socket) fails once the other end has gone.
	cl.send(Request{Type: CmdDisc}, nil)
	if err := <-served; err != nil {
		t.Error(err)
	}
	theirs.Close()
}
