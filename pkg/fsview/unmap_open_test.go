package fsview

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/pkg/control"
)

// TestUnmapOpenDevice: while a device-view file is open a normal unmap_device is EBUSY,
// names the opener and changes nothing; once it is closed the unmap goes through. force
// unmaps an open device: the open file's IO then fails (ENODEV), also after the same name
// is mapped again, which a new open reaches.
func TestUnmapOpenDevice(t *testing.T) {
	leakcheck.Check(t)
	tr := mountTrees(t)
	mapLine := fmt.Sprintf("sessname=n device_path=disk dest_port=%d path=ip:127.0.0.1@ip:127.0.0.1", tr.port)
	unmap := "echo 'sessname=n device_path=disk' > " + tr.dev + "/ctl/unmap_device"
	file := tr.dev + "/n/disk"
	mustSh(t, "echo '"+mapLine+"' > "+tr.dev+"/ctl/map_device")

	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	// A file left open on a failure would keep the mount from going away.
	defer func() { f.Close() }()
	data := bytes.Repeat([]byte{0x5a}, 4096)
	if _, err := f.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	shErr(t, unmap, "Device or resource busy")
	ctl := &control.Client{RNBD: tr.client}
	err = ctl.Unmap(t.Context(), control.UnmapRequest{SessName: "n", DevicePath: "disk"})
	if !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "device view file ×1") {
		t.Errorf("unmap of an open device: %v", err)
	}
	// Nothing changed: still mapped, and the open file still works.
	got := make([]byte, 4096)
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after a refused unmap: %v", err)
	}
	if got := mustSh(t, "cat "+tr.dev+"/ctl/devices"); got != "n/disk open rw\n" {
		t.Errorf("devices after a refused unmap: %q", got)
	}
	// Closed, then unmapped at once: the release FUSE sends after close(2) is waited for.
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	mustSh(t, unmap)
	if n := len(tr.client.Devices()); n != 0 {
		t.Fatalf("%d devices after the unmap", n)
	}

	// force: the open file's IO fails from then on, even once the name is mapped again.
	mustSh(t, "echo '"+mapLine+"' > "+tr.dev+"/ctl/map_device")
	f, err = os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	shErr(t, "echo 'sessname=n device_path=disk normal' > "+tr.dev+"/ctl/unmap_device", "Device or resource busy")
	shErr(t, "echo 'sessname=n device_path=disk force normal' > "+tr.dev+"/ctl/unmap_device", "Invalid argument")
	mustSh(t, "echo 'sessname=n device_path=disk force' > "+tr.dev+"/ctl/unmap_device")
	if _, err := f.ReadAt(got, 0); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("read of a force-unmapped device: %v, want ENODEV", err)
	}
	mustSh(t, "echo '"+mapLine+"' > "+tr.dev+"/ctl/map_device")
	if _, err := f.WriteAt(data, 0); !errors.Is(err, syscall.ENODEV) {
		t.Errorf("write through a file of the unmapped device: %v, want ENODEV", err)
	}
	if got := mustSh(t, "dd if="+file+" bs=4096 count=1 iflag=direct status=none | od -An -tx1 | head -1"); !strings.Contains(got, "5a 5a") {
		t.Errorf("the device mapped again: %q", got)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	mustSh(t, unmap)
}
