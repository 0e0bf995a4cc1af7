package control

import (
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

func TestParseMapRequestAttach(t *testing.T) {
	base := "sessname=s device_path=d path=ip:10.0.0.1 "
	for v, want := range map[string]Attach{
		"": AttachDefault, "nbd=auto": AttachAuto, "nbd=none": AttachNone, "nbd=0": 0, "nbd=15": 15, "nbd=1048575": 1<<20 - 1,
	} {
		r, err := ParseMapRequest(base + v)
		if err != nil || r.Attach != want || r.SessName != "s" || r.DevicePath != "d" || len(r.Paths) != 1 {
			t.Errorf("%q: %+v %v", v, r, err)
		}
		if want != AttachDefault && r.Attach.String() != strings.TrimPrefix(v, "nbd=") {
			t.Errorf("%q: String %q", v, r.Attach.String())
		}
	}
	for _, v := range []string{"nbd=", "nbd=-1", "nbd=1048576", "nbd=x", "nbd=AUTO", "nbd=01", "nbd=+1", "nbd=auto nbd=none", "nbd=/dev/nbd0"} {
		if _, err := ParseMapRequest(base + v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%q: %v", v, err)
		}
	}
	// The kernel's parser (ParseMapDevice) knows no nbd= or ublk=.
	for _, v := range []string{"nbd=auto", "ublk=auto"} {
		if _, err := ParseMapDevice(base + v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("ParseMapDevice took %s: %v", v, err)
		}
	}
	// ublk= is read as nbd= is, on its own, and both may be given.
	for v, want := range map[string][2]Attach{
		"": {AttachDefault, AttachDefault}, "ublk=auto": {AttachDefault, AttachAuto}, "ublk=none": {AttachDefault, AttachNone},
		"ublk=7 nbd=3": {3, 7}, "nbd=none ublk=auto": {AttachNone, AttachAuto},
	} {
		r, err := ParseMapRequest(base + v)
		if err != nil || r.Attach != want[0] || r.Ublk != want[1] {
			t.Errorf("%q: nbd %v ublk %v, %v", v, r.Attach, r.Ublk, err)
			continue
		}
		if back, err := ParseMapRequest(r.String()); err != nil || back.Attach != r.Attach || back.Ublk != r.Ublk {
			t.Errorf("%q: %q reads back as %+v, %v", v, r.String(), back, err)
		}
	}
	for _, v := range []string{"ublk=", "ublk=-1", "ublk=x", "ublk=auto ublk=none", "ublk=/dev/ublkb0", "ublk=01"} {
		if _, err := ParseMapRequest(base + v); !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "ublk=") {
			t.Errorf("%q: %v", v, err)
		}
	}
	// The kernel's tokens are unchanged.
	o, err := ParseMapDevice("sessname=s device_path=/dev/x dest_port=11 path=ip:10.0.0.1 access_mode=ro nr_poll_queues=1")
	if err != nil || o.Port != 11 || o.AccessMode != rnbd.AccessRO {
		t.Errorf("kernel tokens: %+v %v", o, err)
	}
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
		if _, err := ParseOpenSession(v); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("open_session %q: %v, want EINVAL", v, err)
		}
	}
	if _, err := ParseUnmapRequest("sessname=s device_path=disk#x"); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("unmap of disk#x: %v", err)
	}
}
