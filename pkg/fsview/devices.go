package fsview

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Usage texts of the device view's control files.
const (
	mapUsage   = "Usage: echo \"sessname=<name> device_path=<path> [path=<[src@]dst>...] [dest_port=<port>] [access_mode=<ro|rw|migration>] [nr_poll_queues=<n>]\" > map_device\n"
	unmapUsage = "Usage: echo \"sessname=<name> device_path=<path>\" > unmap_device\n"
	// rnbdMaxPaths is how many path= tokens map_device takes; the next is ENOMEM.
	rnbdMaxPaths = 6
)

// DevTree is the device view: ctl/map_device and ctl/unmap_device, and a file per mapped
// device under its session's directory, usable by dd, fio or losetup.
type DevTree struct {
	C        *ClientTree
	OnChange func()
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
			o, err := ParseMapDevice(v)
			if err != nil {
				return err
			}
			ctx, cancel := t.C.ctx()
			defer cancel()
			if _, err := t.C.C.Map(ctx, o); err != nil {
				return err
			}
			t.changed()
			return nil
		}}},
		{Name: "unmap_device", Attr: &Attr{Mode: 0o644, Show: usage(unmapUsage), Store: func(v string) error {
			sess, dev, err := parseUnmap(v)
			if err != nil {
				return err
			}
			for _, d := range t.C.C.Devices() {
				if d.Session() == sess && (d.Path() == dev || DeviceFileName(d.Path()) == dev) {
					ctx, cancel := t.C.ctx()
					defer cancel()
					err := d.Unmap(ctx)
					t.changed()
					return err
				}
			}
			return fmt.Errorf("%s is not mapped in %q: %w", dev, sess, syscall.ENOENT)
		}}},
	}
}

// ParseMapDevice reads map_device's tokens as RNBD does: sessname= and device_path= are
// required (≤ 255 bytes); path= up to 6 times (a 7th is ENOMEM); dest_port= applies to the
// path= tokens after it; access_mode= ro, rw (default) or migration; nr_poll_queues= is
// accepted and has no effect here. An unknown token or a missing one is EINVAL.
func ParseMapDevice(v string) (rnbd.MapOptions, error) {
	o := rnbd.MapOptions{AccessMode: rnbd.AccessRW}
	port, portSet := uint16(transport.DefaultPort), false
	for _, tok := range strings.Fields(v) {
		k, val, ok := strings.Cut(tok, "=")
		if !ok {
			return o, fmt.Errorf("token %q: %w", tok, syscall.EINVAL)
		}
		switch k {
		case "sessname":
			if len(val) > 255 {
				return o, fmt.Errorf("sessname too long: %w", syscall.EINVAL)
			}
			o.SessName = val
		case "device_path":
			if len(val) > 255 {
				return o, fmt.Errorf("device_path too long: %w", syscall.EINVAL)
			}
			o.DevicePath = val
		case "path":
			if len(o.Paths) >= rnbdMaxPaths {
				return o, fmt.Errorf("more than %d paths: %w", rnbdMaxPaths, syscall.ENOMEM)
			}
			pa, err := parsePathToken(val, port, &o, &portSet)
			if err != nil {
				return o, err
			}
			o.Paths = append(o.Paths, pa)
		case "dest_port":
			n, err := strconv.ParseUint(val, 10, 16)
			if err != nil {
				return o, fmt.Errorf("dest_port %q: %w", val, syscall.EINVAL)
			}
			port = uint16(n)
		case "access_mode":
			m, err := rnbd.ParseAccessMode(val)
			if err != nil {
				return o, err
			}
			o.AccessMode = m
		case "nr_poll_queues":
			if _, err := strconv.Atoi(val); err != nil {
				return o, fmt.Errorf("nr_poll_queues %q: %w", val, syscall.EINVAL)
			}
		default:
			return o, fmt.Errorf("unknown token %q: %w", tok, syscall.EINVAL)
		}
	}
	if o.SessName == "" || o.DevicePath == "" || !ValidName(o.SessName) || strings.Contains(o.SessName, ".") || o.SessName == "ctl" {
		return o, fmt.Errorf("sessname= and device_path= are required: %w", syscall.EINVAL)
	}
	if !portSet {
		o.Port = port
	}
	return o, nil
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
	return sess, dev, nil
}
