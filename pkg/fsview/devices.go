package fsview

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Usage texts of the device view's control files.
const (
	mapUsage   = "Usage: echo \"sessname=<name> device_path=<path> [path=<[src@]dst>...] [dest_port=<port>] [access_mode=<ro|rw|migration>] [nr_poll_queues=<n>] [nbd=<auto|none|index>]\" > map_device\n"
	unmapUsage = "Usage: echo \"sessname=<name> device_path=<path>\" > unmap_device\n"
	// rnbdMaxPaths is how many path= tokens map_device takes; the next is ENOMEM.
	rnbdMaxPaths = 6
)

// DevTree is the device view: ctl/map_device and ctl/unmap_device, ctl/nbd_devices, and a
// file per mapped device under its session's directory, usable by dd, fio or losetup.
type DevTree struct {
	C        *ClientTree
	OnChange func()
	// NBD attaches mappings to the kernel's NBD devices (map_device's nbd= token) and
	// detaches them before they are unmapped; nil refuses nbd= other than none.
	NBD NBDAttacher
}

// NBDAttach is map_device's nbd= token, an extension of ours: whether and where a mapping
// is attached to a kernel NBD device.
type NBDAttach int

// Values of NBDAttach besides an index (>= 0: nbd=<index>, /dev/nbd<index>).
const (
	NBDDefault NBDAttach = -3 // no nbd= token: the daemon's default
	NBDNone    NBDAttach = -2 // nbd=none
	NBDAuto    NBDAttach = -1 // nbd=auto: any free /dev/nbdX
)

// nbdMaxIndex is the largest index nbd= takes (MINORMASK; the kernel may refuse less).
const nbdMaxIndex = 1<<20 - 1

// ParseNBDAttach reads nbd='s value: auto, none, or a device index.
func ParseNBDAttach(v string) (NBDAttach, error) {
	switch v {
	case "auto":
		return NBDAuto, nil
	case "none":
		return NBDNone, nil
	}
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil || n > nbdMaxIndex || (len(v) > 1 && v[0] == '0') {
		return NBDNone, fmt.Errorf("nbd=%q: auto, none or an index 0..%d: %w", v, nbdMaxIndex, syscall.EINVAL)
	}
	return NBDAttach(n), nil
}

// String is the token's value ("" for NBDDefault).
func (a NBDAttach) String() string {
	switch {
	case a == NBDAuto:
		return "auto"
	case a == NBDNone:
		return "none"
	case a >= 0:
		return strconv.Itoa(int(a))
	}
	return ""
}

// NBDAttacher attaches mapped devices to kernel NBD devices (rtrs-clientd's does it over
// the kernel's NBD netlink family).
type NBDAttacher interface {
	// Attach attaches d as at says (NBDDefault: as the attacher's default is; NBDNone:
	// not) and remembers at; on error nothing of the attach is left.
	Attach(ctx context.Context, d *rnbd.Device, at NBDAttach) error
	// Detach detaches d if it is attached; while the kernel's device is in use (mounted)
	// it fails with EBUSY and d stays attached.
	Detach(ctx context.Context, d *rnbd.Device) error
	// Attached is d's kernel device ("/dev/nbd0"), or "".
	Attached(d *rnbd.Device) string
}

// MapRequest is a map_device line: the kernel's tokens and nbd=.
type MapRequest struct {
	rnbd.MapOptions
	NBD NBDAttach
}

// MapDevice maps r and attaches it as r.NBD says. When the attach fails the device is
// unmapped again (the session goes with it if the mapping opened it) and the attach's
// error returned: a failed map_device leaves nothing behind.
func MapDevice(ctx context.Context, c *rnbd.Client, nb NBDAttacher, r MapRequest) (*rnbd.Device, error) {
	if nb == nil && r.NBD != NBDDefault && r.NBD != NBDNone {
		return nil, fmt.Errorf("nbd=%v: no NBD attach here: %w", r.NBD, syscall.EINVAL)
	}
	d, err := c.Map(ctx, r.MapOptions)
	if err != nil || nb == nil {
		return d, err
	}
	if err := nb.Attach(ctx, d, r.NBD); err != nil {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if uerr := d.Unmap(uctx); uerr != nil {
			err = fmt.Errorf("%w (unmapping %s again: %v)", err, r.DevicePath, uerr)
		}
		return nil, err
	}
	return d, nil
}

// DeviceFileName is the file name of a mapped device: its path without leading slashes,
// with '/' shown as '!' (as the kernel names block devices like cciss!c0d0).
func DeviceFileName(devicePath string) string {
	return strings.ReplaceAll(strings.TrimLeft(devicePath, "/"), "/", "!")
}

// Entries lists ctl/ and the sessions that have devices.
func (t *DevTree) Entries() []Entry {
	out := []Entry{{Name: "ctl", Dir: DirFunc(t.ctl)}}
	bySess := map[string][]Entry{}
	var order []string
	for _, d := range t.C.C.Devices() {
		if d.State() == rnbd.StateUnmapped || !d.Opened() {
			continue
		}
		name := DeviceFileName(d.Path())
		if !ValidName(name) {
			continue
		}
		if _, ok := bySess[d.Session()]; !ok {
			order = append(order, d.Session())
		}
		bySess[d.Session()] = append(bySess[d.Session()], Entry{Name: name, Block: d})
	}
	for _, s := range order {
		ents := bySess[s]
		out = append(out, Entry{Name: s, Dir: DirFunc(func() []Entry { return ents })})
	}
	return out
}

func (t *DevTree) changed() {
	if t.OnChange != nil {
		t.OnChange()
	}
}

func (t *DevTree) ctl() []Entry {
	return []Entry{
		{Name: "map_device", Attr: &Attr{Mode: 0o644, Show: usage(mapUsage), Store: func(v string) error {
			r, err := ParseMapRequest(v)
			if err != nil {
				return err
			}
			ctx, cancel := t.C.ctx()
			defer cancel()
			if _, err := MapDevice(ctx, t.C.C, t.NBD, r); err != nil {
				return err
			}
			t.changed()
			return nil
		}}},
		{Name: "devices", Attr: &Attr{Mode: 0o444, Show: t.devices}},
		{Name: "nbd_devices", Attr: &Attr{Mode: 0o444, Show: t.nbdDevices}},
		{Name: "unmap_device", Attr: &Attr{Mode: 0o644, Show: usage(unmapUsage), Store: func(v string) error {
			sess, dev, err := parseUnmap(v)
			if err != nil {
				return err
			}
			for _, d := range t.C.C.Devices() {
				if d.Session() == sess && (d.Path() == dev || DeviceFileName(d.Path()) == dev) {
					ctx, cancel := t.C.ctx()
					defer cancel()
					if t.NBD != nil {
						if err := t.NBD.Detach(ctx, d); err != nil {
							return err
						}
					}
					err := d.Unmap(ctx)
					t.changed()
					return err
				}
			}
			return fmt.Errorf("%s is not mapped in %q: %w", dev, sess, syscall.ENOENT)
		}}},
	}
}

// devices lists the mapped devices, "<session>/<device file> <state> <access mode>" a line;
// state is open, disconnected (the session has no path: IO waits) or closed-by-server (the
// server's force_close: IO fails with EIO until it is unmapped).
func (t *DevTree) devices() string {
	var b strings.Builder
	for _, d := range t.C.C.Devices() {
		if st := d.State(); st != rnbd.StateUnmapped && d.Opened() {
			fmt.Fprintf(&b, "%s/%s %v %v\n", d.Session(), DeviceFileName(d.Path()), st, d.AccessMode())
		}
	}
	return b.String()
}

// nbdDevices lists the attached mappings, "<session>/<device file> /dev/nbdN" a line.
func (t *DevTree) nbdDevices() string {
	if t.NBD == nil {
		return ""
	}
	var b strings.Builder
	for _, d := range t.C.C.Devices() {
		if dev := t.NBD.Attached(d); dev != "" && d.State() != rnbd.StateUnmapped {
			fmt.Fprintf(&b, "%s/%s %s\n", d.Session(), DeviceFileName(d.Path()), dev)
		}
	}
	return b.String()
}

// ParseMapDevice reads map_device's tokens as RNBD does: sessname= and device_path= are
// required (≤ 255 bytes); path= up to 6 times (a 7th is ENOMEM); dest_port= applies to the
// path= tokens after it; access_mode= ro, rw (default) or migration; nr_poll_queues= is
// accepted and has no effect here. An unknown token or a missing one is EINVAL, and so is
// nbd= (ParseMapRequest takes it).
func ParseMapDevice(v string) (rnbd.MapOptions, error) {
	r, err := parseMap(v, false)
	return r.MapOptions, err
}

// ParseMapRequest reads map_device's tokens as ParseMapDevice does, and nbd=<auto|none|
// index> (at most once; without it NBD is NBDDefault).
func ParseMapRequest(v string) (MapRequest, error) { return parseMap(v, true) }

func parseMap(v string, withNBD bool) (MapRequest, error) {
	r := MapRequest{MapOptions: rnbd.MapOptions{AccessMode: rnbd.AccessRW}, NBD: NBDDefault}
	o := &r.MapOptions
	port, portSet := uint16(transport.DefaultPort), false
	for _, tok := range strings.Fields(v) {
		k, val, ok := strings.Cut(tok, "=")
		if !ok {
			return r, fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
		switch k {
		case "nbd":
			if !withNBD {
				return r, fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
			}
			if r.NBD != NBDDefault {
				return r, fmt.Errorf("nbd= twice: %w", syscall.EINVAL)
			}
			a, err := ParseNBDAttach(val)
			if err != nil {
				return r, err
			}
			r.NBD = a
		case "sessname":
			if len(val) > 255 {
				return r, fmt.Errorf("sessname too long: %w", syscall.EINVAL)
			}
			o.SessName = val
		case "device_path":
			if len(val) > 255 {
				return r, fmt.Errorf("device_path too long: %w", syscall.EINVAL)
			}
			o.DevicePath = val
		case "path":
			if len(o.Paths) >= rnbdMaxPaths {
				return r, fmt.Errorf("more than %d paths: %w", rnbdMaxPaths, syscall.ENOMEM)
			}
			pa, err := parsePathToken(val, port, o, &portSet)
			if err != nil {
				return r, err
			}
			o.Paths = append(o.Paths, pa)
		case "dest_port":
			n, err := strconv.ParseUint(val, 10, 16)
			if err != nil {
				return r, fmt.Errorf("dest_port %q: %w", val, syscall.EINVAL)
			}
			port = uint16(n)
		case "access_mode":
			m, err := rnbd.ParseAccessMode(val)
			if err != nil {
				return r, err
			}
			o.AccessMode = m
		case "nr_poll_queues":
			if _, err := strconv.Atoi(val); err != nil {
				return r, fmt.Errorf("nr_poll_queues %q: %w", val, syscall.EINVAL)
			}
		default:
			return r, fmt.Errorf("unknown token %q: %w", tok, syscall.EINVAL)
		}
	}
	if o.SessName == "" || o.DevicePath == "" || !ValidName(o.SessName) || strings.Contains(o.SessName, ".") || o.SessName == "ctl" {
		return r, fmt.Errorf("sessname= and device_path= are required: %w", syscall.EINVAL)
	}
	if err := transport.CheckText(o.DevicePath); err != nil {
		return r, fmt.Errorf("device_path: %w", err)
	}
	if !portSet {
		o.Port = port
	}
	return r, nil
}

func parseUnmap(v string) (sess, dev string, err error) {
	for _, tok := range strings.Fields(v) {
		k, val, ok := strings.Cut(tok, "=")
		switch {
		case ok && k == "sessname":
			sess = val
		case ok && k == "device_path":
			dev = val
		default:
			return "", "", fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
	}
	if sess == "" || dev == "" {
		return "", "", fmt.Errorf("sessname= and device_path= are required: %w", syscall.EINVAL)
	}
	if !ValidName(sess) || transport.CheckText(dev) != nil {
		return "", "", fmt.Errorf("sessname %q device_path %q: %w", sess, dev, syscall.EINVAL)
	}
	return sess, dev, nil
}
