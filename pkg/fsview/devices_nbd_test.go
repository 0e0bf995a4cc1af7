package fsview

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

func TestParseMapRequestNBD(t *testing.T) {
	base := "sessname=s device_path=d path=ip:10.0.0.1 "
	for v, want := range map[string]NBDAttach{
		"": NBDDefault, "nbd=auto": NBDAuto, "nbd=none": NBDNone, "nbd=0": 0, "nbd=15": 15, "nbd=1048575": 1<<20 - 1,
	} {
		r, err := ParseMapRequest(base + v)
		if err != nil || r.NBD != want || r.SessName != "s" || r.DevicePath != "d" || len(r.Paths) != 1 {
			t.Errorf("%q: %+v %v", v, r, err)
		}
		if want != NBDDefault && r.NBD.String() != strings.TrimPrefix(v, "nbd=") {
			t.Errorf("%q: String %q", v, r.NBD.String())
		}
	}
	for _, v := range []string{"nbd=", "nbd=-1", "nbd=1048576", "nbd=x", "nbd=AUTO", "nbd=01", "nbd=+1", "nbd=auto nbd=none", "nbd=/dev/nbd0"} {
		if _, err := ParseMapRequest(base + v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%q: %v", v, err)
		}
	}
	// The kernel's parser (ParseMapDevice) knows no nbd=.
	if _, err := ParseMapDevice(base + "nbd=auto"); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("ParseMapDevice took nbd=: %v", err)
	}
	// The kernel's tokens are unchanged.
	o, err := ParseMapDevice("sessname=s device_path=/dev/x dest_port=11 path=ip:10.0.0.1 access_mode=ro nr_poll_queues=2")
	if err != nil || o.Port != 11 || o.AccessMode != rnbd.AccessRO {
		t.Errorf("kernel tokens: %+v %v", o, err)
	}
}

// fakeAttacher records what the device view asks of it.
type fakeAttacher struct {
	mu      sync.Mutex
	def     NBDAttach
	fail    error
	busy    bool
	next    int
	devs    map[*rnbd.Device]string
	actions []string
}

func (f *fakeAttacher) Attach(_ context.Context, d *rnbd.Device, at NBDAttach) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.actions = append(f.actions, fmt.Sprintf("attach %s %q", d.Path(), at.String()))
	if at == NBDDefault {
		at = f.def
	}
	if f.fail != nil {
		return f.fail
	}
	switch {
	case at == NBDAuto:
		f.devs[d] = fmt.Sprintf("/dev/nbd%d", f.next)
		f.next++
	case at >= 0:
		f.devs[d] = fmt.Sprintf("/dev/nbd%d", at)
	}
	return nil
}

func (f *fakeAttacher) Detach(_ context.Context, d *rnbd.Device) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.actions = append(f.actions, "detach "+d.Path())
	if f.busy && f.devs[d] != "" {
		return fmt.Errorf("%s is in use: %w", f.devs[d], syscall.EBUSY)
	}
	delete(f.devs, d)
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
	fa := &fakeAttacher{def: NBDNone, devs: map[*rnbd.Device]string{}}
	dev := mount(t, &DevTree{C: &ClientTree{C: tr.client, Timeout: 20 * time.Second}, NBD: fa})
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
	fa.set(nil, false)
	mustSh(t, "echo 'sessname=n device_path=disk' > "+dev+"/ctl/unmap_device")
	if got := fa.log(); got != "detach disk; detach disk" {
		t.Errorf("attacher: %s", got)
	}
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

// Names a config file could not carry back are refused before anything is done with them:
// "disk#x" written to the config would come back as "disk" after a restart.
func TestControlFileNamesRefused(t *testing.T) {
	for _, v := range []string{
		"sessname=s device_path=disk#x path=ip:10.0.0.1 access_mode=ro",
		"sessname=s#1 device_path=disk path=ip:10.0.0.1",
		"sessname=s device_path=disk\x01 path=ip:10.0.0.1",
		"sessname=s device_path=d\xffisk path=ip:10.0.0.1",
	} {
		if _, err := ParseMapRequest(v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("map_device %q: %v, want EINVAL", v, err)
		}
	}
	for _, v := range []string{"sessname=s#1 path=ip:10.0.0.1", "sessname=s\x7f path=ip:10.0.0.1"} {
		if _, _, _, err := ParseOpenSession(v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("open_session %q: %v, want EINVAL", v, err)
		}
	}
	if _, _, err := parseUnmap("sessname=s device_path=disk#x"); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("unmap of disk#x: %v", err)
	}
}
