package fsview

import (
	"fmt"
	"strings"
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
	}
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
