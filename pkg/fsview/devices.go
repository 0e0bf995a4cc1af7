package fsview

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

// A mapped device zeroes ranges without data: fallocate on its file is write-zeroes.
var _ Zeroer = (*rnbd.Device)(nil)

// Usage texts of the device view's control files.
const (
	mapUsage   = "Usage: echo \"sessname=<name> device_path=<path> [path=<[src@]dst>...] [dest_port=<port>] [access_mode=<ro|rw|migration>] [nr_poll_queues=<n>] [nbd=<auto|none|index>] [ublk=<auto|none|index>]\" > map_device\n"
	unmapUsage = "Usage: echo \"sessname=<name> device_path=<path> [normal|force]\" > unmap_device\n"
)

// DevTree is the device view: ctl/map_device and ctl/unmap_device, ctl/nbd_devices and
// ctl/ublk_devices, and a file per mapped device under its session's directory, usable by
// dd, fio or losetup.
type DevTree struct {
	Ctl *control.Client
	// Timeout bounds map_device and unmap_device.
	Timeout time.Duration
}

// Entries lists ctl/ and the sessions that have devices.
func (t *DevTree) Entries() []Entry {
	out := []Entry{{Name: "ctl", Dir: DirFunc(t.ctl)}}
	seen := map[string]bool{}
	for _, d := range t.Ctl.Mapped() {
		s := d.Session()
		if seen[s] || !validEntry(control.DeviceFileName(d.Path())) {
			continue
		}
		seen[s] = true
		out = append(out, Entry{Name: s, Dir: DirFunc(func() []Entry { return t.session(s) })})
	}
	return out
}

// session lists a session's devices as they are now: a shell sitting in the directory sees
// a device mapped or unmapped after it came in, and nothing once the last one is gone.
func (t *DevTree) session(name string) []Entry {
	var out []Entry
	for _, d := range t.Ctl.Mapped() {
		if f := control.DeviceFileName(d.Path()); d.Session() == name && validEntry(f) {
			out = append(out, Entry{Name: f, Block: d})
		}
	}
	return out
}

func (t *DevTree) ctl() []Entry {
	return []Entry{
		{Name: "map_device", Attr: &Attr{Mode: 0o644, Show: usage(mapUsage), Store: func(v string) error {
			r, err := control.ParseMapRequest(v)
			if err != nil {
				return err
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			_, err = t.Ctl.Map(ctx, r)
			return err
		}}},
		{Name: "devices", Attr: &Attr{Mode: 0o444, Show: t.devices}},
		{Name: "nbd_devices", Attr: &Attr{Mode: 0o444, Show: func() string { return t.attached(t.Ctl.Attacher) }}},
		{Name: "ublk_devices", Attr: &Attr{Mode: 0o444, Show: func() string { return t.attached(t.Ctl.Ublk) }}},
		{Name: "unmap_device", Attr: &Attr{Mode: 0o644, Show: usage(unmapUsage), Store: func(v string) error {
			u, err := control.ParseUnmapRequest(v)
			if err != nil {
				return err
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return t.Ctl.Unmap(ctx, u)
		}}},
		{Name: "mapped", Dir: DirFunc(t.mapped)},
	}
}

// mapped lists a directory per mapped device, named as the kernel names its links in
// /sys/class/rnbd-client/ctl/devices/ (the device path as mapped, every '/' a '!', then
// "@<session>"), holding what the kernel's /sys/block/rnbdX/rnbd/ holds.
func (t *DevTree) mapped() []Entry {
	var out []Entry
	for _, d := range t.Ctl.Mapped() {
		name := strings.ReplaceAll(d.Path(), "/", "!") + "@" + d.Session()
		if !validEntry(name) {
			continue
		}
		out = append(out, Entry{Name: name, Obj: d, Dir: guarded("the device", func() bool { return d.State() != rnbd.StateUnmapped }, DirFunc(func() []Entry { return t.device(d) }))})
	}
	return out
}

// device is a mapped device's directory: the kernel's rnbd-client files, in its formats.
func (t *DevTree) device(d *rnbd.Device) []Entry {
	line := func(f func() string) func() string { return func() string { return f() + "\n" } }
	return []Entry{
		{Name: "state", Attr: &Attr{Mode: 0o444, Show: line(func() string { return kernelState(d.State()) })}},
		{Name: "session", Attr: &Attr{Mode: 0o444, Show: line(d.Session)}},
		{Name: "mapping_path", Attr: &Attr{Mode: 0o444, Show: line(d.Path)}},
		{Name: "access_mode", Attr: &Attr{Mode: 0o444, Show: line(func() string { return d.AccessMode().String() })}},
		// No poll queues: the transport's connections are served by completions.
		{Name: "nr_poll_queues", Attr: &Attr{Mode: 0o444, Show: usage("0\n")}},
		{Name: "unmap_device", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo <normal|force> > unmap_device\n"), Store: func(v string) error {
			var force bool
			switch strings.TrimSpace(v) {
			case "normal":
			case "force":
				force = true
			default:
				return fmt.Errorf("unmap_device %q: normal or force: %w", v, syscall.EINVAL)
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return t.Ctl.Unmap(ctx, control.UnmapRequest{SessName: d.Session(), DevicePath: d.Path(), Force: force})
		}}},
		{Name: "remap_device", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo <1> > remap_device\n"), Store: func(v string) error {
			if strings.TrimSpace(v) != "1" {
				return fmt.Errorf("remap_device %q: 1: %w", v, syscall.EINVAL)
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return d.Remap(ctx)
		}}},
		{Name: "resize", Attr: &Attr{Mode: 0o644, Show: usage("Usage: echo <new size in sectors> > resize\n"), Store: func(v string) error {
			v = strings.TrimSpace(v)
			n, err := strconv.ParseUint(v, 0, 64)
			if err != nil || strings.Contains(v, "_") {
				return fmt.Errorf("resize %q: a number of sectors: %w", v, syscall.EINVAL)
			}
			ctx, cancel := writeCtx(t.Timeout)
			defer cancel()
			return d.Resize(ctx, n)
		}}},
	}
}

// kernelState is a device's state in the kernel's words: open, closed (no path, or closed by
// the server), unmapped.
func kernelState(st rnbd.DeviceState) string {
	switch st {
	case rnbd.StateMapped:
		return "open"
	case rnbd.StateUnmapped:
		return "unmapped"
	}
	return "closed"
}

// devices lists the mapped devices, "<session>/<device file> <state> <access mode>" a line;
// state is open, disconnected (the session has no path: IO waits) or closed-by-server (the
// server's force_close: IO fails with EIO until it is unmapped).
func (t *DevTree) devices() string {
	var b strings.Builder
	for _, d := range t.Ctl.Mapped() {
		fmt.Fprintf(&b, "%s/%s %v %v\n", d.Session(), control.DeviceFileName(d.Path()), d.State(), d.AccessMode())
	}
	return b.String()
}

// attached lists the mappings a front end attached, "<session>/<device file> /dev/nbdN"
// (ctl/nbd_devices) or "… /dev/ublkbN" (ctl/ublk_devices) a line.
func (t *DevTree) attached(a control.Attacher) string {
	if a == nil {
		return ""
	}
	var b strings.Builder
	for _, d := range t.Ctl.RNBD.Devices() {
		if dev := a.Attached(d); dev != "" && d.State() != rnbd.StateUnmapped {
			fmt.Fprintf(&b, "%s/%s %s\n", d.Session(), control.DeviceFileName(d.Path()), dev)
		}
	}
	return b.String()
}
