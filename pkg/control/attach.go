package control

import (
	"context"
	"fmt"
	"strconv"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

// Attach is map_device's nbd= or ublk= token, extensions of ours: whether and where a
// mapping is attached to a kernel block device by that attach front end.
type Attach int

// Values of Attach besides an index (>= 0: nbd=<index> is /dev/nbd<index>, ublk=<index>
// /dev/ublkb<index>).
const (
	AttachDefault Attach = -3 // no nbd= token: the front end's default
	AttachNone    Attach = -2 // nbd=none
	AttachAuto    Attach = -1 // nbd=auto: any free device
)

// attachMaxIndex is the largest index nbd= takes (MINORMASK; the kernel may refuse less).
const attachMaxIndex = 1<<20 - 1

// ParseAttach reads nbd='s or ublk='s value: auto, none, or a device index (no leading zeros).
func ParseAttach(v string) (Attach, error) {
	switch v {
	case "auto":
		return AttachAuto, nil
	case "none":
		return AttachNone, nil
	}
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil || n > attachMaxIndex || (len(v) > 1 && v[0] == '0') {
		return AttachNone, fmt.Errorf("%q: auto, none or an index 0..%d: %w", v, attachMaxIndex, syscall.EINVAL)
	}
	return Attach(n), nil
}

// String is the token's value ("" for AttachDefault).
func (a Attach) String() string {
	switch {
	case a == AttachAuto:
		return "auto"
	case a == AttachNone:
		return "none"
	case a >= 0:
		return strconv.Itoa(int(a))
	}
	return ""
}

// Attacher is an attach front end: it gives mapped devices a kernel block device (NBD's
// /dev/nbdX, ublk's /dev/ublkbX). The control layer owns this interface; rtrs-clientd plugs
// its front ends in.
type Attacher interface {
	// Attach attaches d as at says (AttachDefault: as the front end's default is;
	// AttachNone: not) and remembers at; on error nothing of the attach is left.
	Attach(ctx context.Context, d *rnbd.Device, at Attach) error
	// Busy is an EBUSY error naming d's kernel device while it is in use, else nil.
	Busy(d *rnbd.Device) error
	// Detach detaches d if it is attached; while the kernel's device is in use it fails
	// with EBUSY and d stays attached, unless force says to detach it all the same (its
	// users' IO then fails).
	Detach(ctx context.Context, d *rnbd.Device, force bool) error
	// Attached is d's kernel device ("/dev/nbd0", "/dev/ublkb0"), or "".
	Attached(d *rnbd.Device) string
	// Resize gives d's kernel device, if it has one, size bytes: an error (EOPNOTSUPP
	// when the kernel's driver cannot) leaves it as it was.
	Resize(ctx context.Context, d *rnbd.Device, size int64) error
	// Token is what the write-back records for d: at as map_device gave it (AttachDefault
	// when none), or the device it got where a restart must find that one again (ublk).
	Token(d *rnbd.Device) Attach
}
