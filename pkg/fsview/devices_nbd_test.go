package fsview

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

// fakeAttacher records what the device view asks of it.
type fakeAttacher struct {
	mu      sync.Mutex
	def     control.Attach
	fail    error
	busy    bool
	next    int
	prefix  string // "/dev/nbd" when empty
	devs    map[*rnbd.Device]string
	actions []string
}

func (f *fakeAttacher) Attach(_ context.Context, d *rnbd.Device, at control.Attach) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.actions = append(f.actions, fmt.Sprintf("attach %s %q", d.Path(), at.String()))
	if at == control.AttachDefault {
		at = f.def
	}
	if f.fail != nil {
		return f.fail
	}
	prefix := f.prefix
	if prefix == "" {
		prefix = "/dev/nbd"
	}
	switch {
	case at == control.AttachAuto:
		f.devs[d] = fmt.Sprintf("%s%d", prefix, f.next)
		f.next++
	case at >= 0:
		f.devs[d] = fmt.Sprintf("%s%d", prefix, at)
	}
	return nil
}

func (f *fakeAttacher) Busy(d *rnbd.Device) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.busy && f.devs[d] != "" {
		f.actions = append(f.actions, "busy "+d.Path())
		return fmt.Errorf("%s is in use: %w", f.devs[d], syscall.EBUSY)
	}
	return nil
}

func (f *fakeAttacher) Detach(_ context.Context, d *rnbd.Device, force bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.busy && f.devs[d] != "" && !force {
		return fmt.Errorf("%s is in use: %w", f.devs[d], syscall.EBUSY)
	}
	if force {
		f.actions = append(f.actions, "detach force "+d.Path())
	} else {
		f.actions = append(f.actions, "detach "+d.Path())
	}
	delete(f.devs, d)
	return nil
}

func (f *fakeAttacher) Token(*rnbd.Device) control.Attach { return control.AttachDefault }

func (f *fakeAttacher) Resize(_ context.Context, d *rnbd.Device, size int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.devs[d] == "" {
		return nil
	}
	if f.fail != nil {
		return f.fail
	}
	f.actions = append(f.actions, fmt.Sprintf("resize %s %d", d.Path(), size))
	return nil
}

func (f *fakeAttacher) Attached(d *rnbd.Device) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.devs[d]
}

func (f *fakeAttacher) set(fail error, busy bool) {
	f.mu.Lock()
	f.fail, f.busy = fail, busy
	f.mu.Unlock()
}

func (f *fakeAttacher) log() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := strings.Join(f.actions, "; ")
	f.actions = nil
	return s
}

// TestDeviceViewNBD: nbd= reaches the attacher, ctl/nbd_devices shows the attachments, a
// failed attach leaves no mapping, unmap detaches first and a busy device stays mapped.
func TestDeviceViewNBD(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	fa := &fakeAttacher{def: control.AttachNone, devs: map[*rnbd.Device]string{}}
	dev := mount(t, &DevTree{Ctl: &control.Client{RNBD: tr.client, Attacher: fa}, Timeout: 20 * time.Second})
	p1 := "ip:127.0.0.1@ip:127.0.0.1"
	mapLine := fmt.Sprintf("sessname=n device_path=disk dest_port=%d path=%s", tr.port, p1)

	// A bad token changes nothing.
	shErr(t, "echo '"+mapLine+" nbd=foo' > "+dev+"/ctl/map_device", "Invalid argument")
	if got := mustSh(t, "ls "+dev); got != "ctl\n" || fa.log() != "" {
		t.Fatalf("after a bad nbd=: %q", got)
	}
	// A failing attach: the error, and neither mapping nor session left.
	fa.set(fmt.Errorf("no nbd here: %w", syscall.ENODEV), false)
	shErr(t, "echo '"+mapLine+" nbd=auto' > "+dev+"/ctl/map_device", "No such device")
	if got := mustSh(t, "ls "+dev+"; ls "+tr.cli); got != "ctl\nctl\n" {
		t.Fatalf("after a failed attach: %q", got)
	}
	if len(tr.client.Devices()) != 0 {
		t.Fatalf("devices left: %d", len(tr.client.Devices()))
	}
	if got := fa.log(); got != `attach disk "auto"` {
		t.Errorf("attacher: %s", got)
	}
	fa.set(nil, false)
	mustSh(t, "echo '"+mapLine+" nbd=auto' > "+dev+"/ctl/map_device")
	if got := mustSh(t, "cat "+dev+"/ctl/nbd_devices"); got != "n/disk /dev/nbd0\n" {
		t.Errorf("nbd_devices %q", got)
	}
	if got := mustSh(t, "ls "+dev+"/n"); got != "disk\n" {
		t.Errorf("device file: %q", got)
	}
	// In use: unmap is EBUSY and the device stays.
	fa.set(nil, true)
	fa.log()
	shErr(t, "echo 'sessname=n device_path=disk' > "+dev+"/ctl/unmap_device", "Device or resource busy")
	if got := mustSh(t, "cat "+dev+"/ctl/nbd_devices"); got != "n/disk /dev/nbd0\n" || len(tr.client.Devices()) != 1 {
		t.Errorf("after a busy unmap: %q", got)
	}
	// force unmaps it all the same, without asking whether it is busy.
	mustSh(t, "echo 'sessname=n device_path=disk force' > "+dev+"/ctl/unmap_device")
	if got := fa.log(); got != "busy disk; detach force disk" {
		t.Errorf("attacher: %s", got)
	}
	fa.set(nil, false)
	if got := mustSh(t, "cat "+dev+"/ctl/nbd_devices; ls "+dev); got != "ctl\n" {
		t.Errorf("after unmap: %q", got)
	}
	// Without the token the default applies (the attacher's business), and without an
	// attacher nbd= is refused.
	mustSh(t, "echo '"+mapLine+"' > "+dev+"/ctl/map_device")
	if got := fa.log(); got != `attach disk ""` {
		t.Errorf("attacher: %s", got)
	}
	mustSh(t, "echo 'sessname=n device_path=disk' > "+dev+"/ctl/unmap_device")
	shErr(t, "echo '"+mapLine+" nbd=3' > "+tr.dev+"/ctl/map_device", "Invalid argument")
	mustSh(t, "echo '"+mapLine+" nbd=none' > "+tr.dev+"/ctl/map_device")
	if got := mustSh(t, "cat "+tr.dev+"/ctl/nbd_devices; ls "+tr.dev+"/n"); got != "disk\n" {
		t.Errorf("no attacher: %q", got)
	}
	mustSh(t, "echo 'sessname=n device_path=disk' > "+tr.dev+"/ctl/unmap_device")
}

// TestDeviceViewTwoFrontEnds: nbd= and ublk= each reach their front end; when the second
// attach fails the first is detached and nothing stays mapped; a busy ublk device keeps
// unmap from touching either front end.
func TestDeviceViewTwoFrontEnds(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	fa := &fakeAttacher{def: control.AttachNone, devs: map[*rnbd.Device]string{}}
	fu := &fakeAttacher{def: control.AttachNone, prefix: "/dev/ublkb", devs: map[*rnbd.Device]string{}}
	dev := mount(t, &DevTree{Ctl: &control.Client{RNBD: tr.client, Attacher: fa, Ublk: fu}, Timeout: 20 * time.Second})
	mapLine := fmt.Sprintf("sessname=n device_path=disk dest_port=%d path=ip:127.0.0.1@ip:127.0.0.1 nbd=auto ublk=auto", tr.port)

	fu.set(fmt.Errorf("no ublk here: %w", syscall.ENODEV), false)
	shErr(t, "echo '"+mapLine+"' > "+dev+"/ctl/map_device", "No such device")
	if got := fa.log() + " | " + fu.log(); got != `attach disk "auto"; detach force disk | attach disk "auto"` {
		t.Errorf("front ends: %s", got)
	}
	if got := mustSh(t, "ls "+dev+"; cat "+dev+"/ctl/nbd_devices "+dev+"/ctl/ublk_devices"); got != "ctl\n" || len(tr.client.Devices()) != 0 {
		t.Fatalf("after a failed ublk attach: %q, %d devices", got, len(tr.client.Devices()))
	}

	fu.set(nil, false)
	mustSh(t, "echo '"+mapLine+"' > "+dev+"/ctl/map_device")
	if got := mustSh(t, "cat "+dev+"/ctl/nbd_devices "+dev+"/ctl/ublk_devices"); got != "n/disk /dev/nbd1\nn/disk /dev/ublkb0\n" { // nbd0 went with the failed map
		t.Errorf("nbd_devices and ublk_devices: %q", got)
	}
	fa.log()
	fu.log()
	// resize reaches both front ends; when the second cannot follow, the first gets the
	// old size back and the device keeps it.
	if err := os.Truncate(filepath.Join(tr.exports, "disk"), 8<<20); err != nil {
		t.Fatal(err)
	}
	rs := dev + "/ctl/mapped/disk@n/resize"
	fu.set(fmt.Errorf("no UPDATE_SIZE: %w", syscall.EOPNOTSUPP), false)
	shErr(t, "echo 16384 > "+rs, "Operation not supported")
	if got := fa.log() + " | " + fu.log(); got != "resize disk 8388608; resize disk 4194304 | " || tr.client.Devices()[0].Size() != 4<<20 {
		t.Errorf("a resize the second front end refused: %s, size %d", got, tr.client.Devices()[0].Size())
	}
	fu.set(nil, false)
	mustSh(t, "echo 16384 > "+rs)
	if got := fa.log() + " | " + fu.log(); got != "resize disk 8388608 | resize disk 8388608" || tr.client.Devices()[0].Size() != 8<<20 {
		t.Errorf("resize: %s, size %d", got, tr.client.Devices()[0].Size())
	}
	fu.set(nil, true)
	shErr(t, "echo 'sessname=n device_path=disk' > "+dev+"/ctl/unmap_device", "Device or resource busy")
	if got := fa.log() + " | " + fu.log(); got != " | busy disk" || len(tr.client.Devices()) != 1 {
		t.Errorf("a busy unmap: %s, %d devices", got, len(tr.client.Devices()))
	}
	fu.set(nil, false)
	mustSh(t, "echo 'sessname=n device_path=disk' > "+dev+"/ctl/unmap_device")
	if got := fa.log() + " | " + fu.log(); got != "detach disk | detach disk" {
		t.Errorf("unmap: %s", got)
	}
	if got := mustSh(t, "cat "+dev+"/ctl/nbd_devices "+dev+"/ctl/ublk_devices"); got != "" {
		t.Errorf("after unmap: %q", got)
	}
}
