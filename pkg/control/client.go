// Package control is what the client daemon's control files and config declarations do,
// with no file system in sight: their grammar (parse and format, one place), the checks of
// what is written, and the orchestration of sessions, paths and devices (map, attach, roll
// back; detach, unmap), with a change event for the config write-back. pkg/fsview adapts
// it to files, as the kernel's sysfs store handlers parse and then call.
package control

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Client controls an RNBD client: its sessions, their paths, and its devices.
type Client struct {
	RNBD *rnbd.Client
	// Attacher gives mapped devices a kernel /dev/nbdX; nil refuses nbd= other than none.
	Attacher Attacher
	// Ublk gives them a /dev/ublkbX; nil refuses ublk= other than none.
	Ublk Attacher
	// OnChange, if set, is called after a change of the declared sessions or devices (the
	// daemon writes its config back).
	OnChange func()
}

func (c *Client) changed() {
	if c.OnChange != nil {
		c.OnChange()
	}
}

// OpenSession opens a session without a device (open_session).
func (c *Client) OpenSession(ctx context.Context, o OpenSession) error {
	if err := c.RNBD.OpenSession(ctx, o.MapOptions(), func(co *transport.ClientOptions) {
		if o.Policy != nil {
			co.Policy = *o.Policy
		}
		if o.MaxReconnectAttempts != nil {
			co.MaxReconnectAttempts = *o.MaxReconnectAttempts
		}
	}); err != nil {
		return err
	}
	c.changed()
	return nil
}

// CloseSession closes a session that has no device (close_session).
func (c *Client) CloseSession(name string) error {
	if err := c.RNBD.CloseSession(name); err != nil {
		return err
	}
	c.changed()
	return nil
}

// AddPath adds a path to s and connects it (add_path).
func (c *Client) AddPath(ctx context.Context, s *transport.Session, pa transport.PathAddrs) error {
	if _, err := s.AddPath(ctx, pa); err != nil {
		return err
	}
	c.changed()
	return nil
}

// RemovePath disconnects p and takes it out of its session (remove_path).
func (c *Client) RemovePath(p *transport.Path) {
	p.Remove()
	c.changed()
}

// SetPolicy sets s's multipath policy (mpath_policy).
func (c *Client) SetPolicy(s *transport.Session, p transport.Policy) error {
	if err := s.SetPolicy(p); err != nil {
		return err
	}
	c.changed()
	return nil
}

// SetMaxReconnectAttempts sets how often s reconnects a path (max_reconnect_attempts).
func (c *Client) SetMaxReconnectAttempts(s *transport.Session, n int) error {
	if err := s.SetMaxReconnectAttempts(n); err != nil {
		return err
	}
	c.changed()
	return nil
}

// Map maps r and attaches it as r.Attach and r.Ublk say (map_device). When an attach fails
// the device is detached and unmapped again (the session goes with it if the mapping opened
// it) and the attach's error returned: a failed map_device leaves nothing behind.
func (c *Client) Map(ctx context.Context, r MapRequest) (*rnbd.Device, error) {
	d, err := c.mapAttach(ctx, r)
	if err == nil {
		c.changed()
	}
	return d, err
}

// frontEnd is an attach front end with its token in a map_device line.
type frontEnd struct {
	name string
	a    Attacher
	at   Attach
}

func (c *Client) frontEnds(r MapRequest) []frontEnd {
	return []frontEnd{{"nbd", c.Attacher, r.Attach}, {"ublk", c.Ublk, r.Ublk}}
}

func (c *Client) mapAttach(ctx context.Context, r MapRequest) (*rnbd.Device, error) {
	fes := c.frontEnds(r)
	for _, fe := range fes {
		if fe.a == nil && fe.at != AttachDefault && fe.at != AttachNone {
			return nil, fmt.Errorf("%s=%v: no such front end here: %w", fe.name, fe.at, syscall.EINVAL)
		}
	}
	if err := c.fileNameFree(r.SessName, r.DevicePath, nil); err != nil {
		return nil, err
	}
	d, err := c.RNBD.Map(ctx, r.MapOptions)
	if err != nil {
		return d, err
	}
	// A map of the other name that ran beside this one: one that looks after both mapped
	// gives way (both may, and are tried again; neither is ever shown under the other).
	if err := c.fileNameFree(r.SessName, r.DevicePath, d); err != nil {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if uerr := d.Unmap(uctx); uerr != nil {
			err = fmt.Errorf("%w (unmapping %s again: %v)", err, r.DevicePath, uerr)
		}
		return nil, err
	}
	// Before the attaches: a resize that comes while one attaches reaches those attached
	// already (a front end not attached yet takes the size of the moment it attaches).
	d.OnResize(func(ctx context.Context, old, size int64) error { return resizeFrontEnds(ctx, d, fes, old, size) })
	for i, fe := range fes {
		if fe.a == nil {
			continue
		}
		if err := fe.a.Attach(ctx, d, fe.at); err != nil {
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			for _, prev := range fes[:i] {
				if prev.a != nil {
					_ = prev.a.Detach(uctx, d, true)
				}
			}
			if uerr := d.Unmap(uctx); uerr != nil {
				err = fmt.Errorf("%w (unmapping %s again: %v)", err, r.DevicePath, uerr)
			}
			return nil, err
		}
	}
	return d, nil
}

// resizeFrontEnds tells d's front ends its new size; when one cannot follow, those told
// before it are given the old size back.
func resizeFrontEnds(ctx context.Context, d *rnbd.Device, fes []frontEnd, old, size int64) error {
	for i, fe := range fes {
		if fe.a == nil {
			continue
		}
		if err := fe.a.Resize(ctx, d, size); err != nil {
			// Put back with a context of its own: the resize's may be what ran out.
			bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			for _, prev := range fes[:i] {
				if prev.a == nil {
					continue
				}
				if berr := prev.a.Resize(bctx, d, old); berr != nil {
					err = fmt.Errorf("%w (and %s kept %d bytes, not put back to %d: %v)", err, prev.name, size, old, berr)
				}
			}
			return err
		}
	}
	return nil
}

// fileNameFree refuses (EEXIST) a mapping of path in session sess whose name in the device
// view another device of the session (not self) has under another path: sub/x and sub!x
// are both shown as sub!x, and one of them could not be reached, as the kernel's client
// refuses the second device whose sysfs link would take the same name.
func (c *Client) fileNameFree(sess, path string, self *rnbd.Device) error {
	name := DeviceFileName(path)
	for _, d := range c.RNBD.Devices() {
		if d != self && d.Session() == sess && d.Path() != path && d.State() != rnbd.StateUnmapped && DeviceFileName(d.Path()) == name {
			return fmt.Errorf("%q would be shown as %s/%s, the name of mapped %q: %w", path, sess, name, d.Path(), syscall.EEXIST)
		}
	}
	return nil
}

// Unmap detaches and unmaps the device u names (unmap_device): by its path or by its file
// name in the device view. While the device is open (a device-view file, an NBD client,
// one of its kernel devices) the unmap fails (EBUSY) and nothing changes, unless u.Force.
func (c *Client) Unmap(ctx context.Context, u UnmapRequest) error {
	for _, d := range c.RNBD.Devices() {
		if d.Session() != u.SessName || (d.Path() != u.DevicePath && DeviceFileName(d.Path()) != u.DevicePath) {
			continue
		}
		// The kernel devices first: an unmap they refuse must not have turned openers away.
		fes := c.frontEnds(MapRequest{})
		for _, fe := range fes {
			if fe.a != nil && !u.Force {
				if err := fe.a.Busy(d); err != nil {
					return err
				}
			}
		}
		abort, err := beginUnmap(ctx, d, u.Force)
		if err != nil {
			return err
		}
		for _, fe := range fes {
			if fe.a != nil {
				if err := fe.a.Detach(ctx, d, u.Force); err != nil {
					abort()
					return err
				}
			}
		}
		err = d.Unmap(ctx)
		if err != nil {
			abort()
		}
		c.changed()
		return err
	}
	return fmt.Errorf("%s is not mapped in %q: %w", u.DevicePath, u.SessName, syscall.ENOENT)
}

// releaseGrace is how long a normal unmap waits for a device's openers to go: FUSE sends
// the release of a closed device file after close(2) has returned, and an NBD client's
// connection ends after its disconnect has, so a script that closes and then unmaps would
// race them.
const releaseGrace = time.Second

func beginUnmap(ctx context.Context, d *rnbd.Device, force bool) (abort func(), err error) {
	deadline := time.Now().Add(releaseGrace)
	for {
		abort, err := d.BeginUnmap(force)
		if err == nil || len(d.Holders()) == 0 || time.Now().After(deadline) {
			return abort, err
		}
		t := time.NewTimer(20 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
}

// Mapped lists the devices that are mapped and open.
func (c *Client) Mapped() []*rnbd.Device {
	var out []*rnbd.Device
	for _, d := range c.RNBD.Devices() {
		if d.State() != rnbd.StateUnmapped && d.Opened() {
			out = append(out, d)
		}
	}
	return out
}

// DeviceFileName is the file name of a mapped device in the device view and its NBD export
// name: its path without leading slashes, with '/' shown as '!' (as the kernel names block
// devices like cciss!c0d0).
func DeviceFileName(devicePath string) string {
	return strings.ReplaceAll(strings.TrimLeft(devicePath, "/"), "/", "!")
}

// Verbs of the config file's declarations.
const (
	VerbOpenSession = "open_session"
	VerbMapDevice   = "map_device"
)

// CheckDeclaration parses a declaration line (open_session or map_device) as Apply would,
// and changes nothing: a config file is checked whole before any of it is carried out.
func CheckDeclaration(line string) error {
	verb, rest, _ := strings.Cut(line, " ")
	var err error
	switch verb {
	case VerbOpenSession:
		_, err = ParseOpenSession(rest)
	case VerbMapDevice:
		_, err = ParseMapRequest(rest)
	default:
		err = fmt.Errorf("unknown declaration %q: %w", verb, syscall.EINVAL)
	}
	return err
}

// Apply carries out one declaration of the config file: "open_session <tokens>" or
// "map_device <tokens>", as written to those control files. What exists already is left as
// it is, but for an open_session's paths the session lacks, which are added. done says the
// declaration needs no retry: it succeeded (an open_session once the session has all its
// paths), or it can never succeed (bad syntax).
func (c *Client) Apply(ctx context.Context, line string) (done bool, err error) {
	verb, rest, _ := strings.Cut(line, " ")
	switch verb {
	case VerbOpenSession:
		o, err := ParseOpenSession(rest)
		if err != nil {
			return true, err
		}
		if s := c.RNBD.Session(o.SessName); s != nil {
			return c.addMissing(ctx, s, o.Paths)
		}
		err = c.OpenSession(ctx, o)
		if errors.Is(err, syscall.EEXIST) {
			return true, nil // opened meanwhile through the tree, which OpenSession waited for
		}
		if err == nil || len(o.Paths) < 2 || ctx.Err() != nil {
			return err == nil, err
		}
		// An open needs every path. Failing that, the session is opened with the first path
		// that connects and the others added to it (as add_path); those that do not connect
		// are added when the declaration is tried again. A restart with a rail down then
		// brings the session and its devices up on the other rails instead of waiting for it.
		errs := []error{err}
		for _, pa := range o.Paths {
			one := o
			one.Paths = []transport.PathAddrs{pa}
			err := c.OpenSession(ctx, one)
			if err == nil || errors.Is(err, syscall.EEXIST) {
				if s := c.RNBD.Session(o.SessName); s != nil {
					return c.addMissing(ctx, s, o.Paths)
				}
				return false, fmt.Errorf("session %q closed as it was opened: %w", o.SessName, syscall.ENOENT)
			}
			errs = append(errs, fmt.Errorf("path %s: %w", transport.PathName(pa.Src, pa.Dst), err))
			if ctx.Err() != nil {
				break
			}
		}
		return false, errors.Join(errs...)
	case VerbMapDevice:
		r, err := ParseMapRequest(rest)
		if err != nil {
			return true, err
		}
		for _, d := range c.RNBD.Devices() {
			if d.Session() == r.SessName && d.Path() == r.DevicePath {
				return true, nil
			}
		}
		_, err = c.Map(ctx, r)
		return err == nil, err
	}
	return true, fmt.Errorf("unknown declaration %q", verb)
}

// declaredPaths are the paths and port of session name's open_session among decls.
func declaredPaths(decls []string, name string) ([]transport.PathAddrs, uint16) {
	for _, l := range decls {
		verb, rest, _ := strings.Cut(strings.TrimSpace(l), " ")
		if verb != VerbOpenSession {
			continue
		}
		if o, err := ParseOpenSession(rest); err == nil && o.SessName == name {
			return o.Paths, o.Port
		}
	}
	return nil, 0
}

// addMissing adds to s the paths of want it does not have; done when it has them all.
func (c *Client) addMissing(ctx context.Context, s *transport.Session, want []transport.PathAddrs) (bool, error) {
	var errs []error
	for _, pa := range want {
		if slices.ContainsFunc(s.Paths(), func(p *transport.Path) bool {
			return p.State() != transport.StateDead && p.DstAddr() == pa.Dst && (!pa.Src.IP.IsValid() || p.SrcAddr() == pa.Src)
		}) {
			continue
		}
		if err := c.AddPath(ctx, s, pa); err != nil && !errors.Is(err, syscall.EEXIST) {
			errs = append(errs, fmt.Errorf("path %s: %w", transport.PathName(pa.Src, pa.Dst), err))
		}
	}
	return len(errs) == 0, errors.Join(errs...)
}

// Declarations renders the sessions and devices of now as config declarations, which Apply
// takes back: a session with its live paths, port, policy and reconnect attempts, then each
// mapped device with its access mode, nbd= and ublk= (see Attacher.Token). A session left
// with no path (its last one removed, which the kernel allows too) keeps the paths of its
// declaration in prev, the declarations written before: a line without path= could not be
// applied, and its devices would not come back at a restart.
func (c *Client) Declarations(prev []string) []string {
	var out []string
	for _, name := range c.RNBD.SessionNames() {
		s := c.RNBD.Session(name)
		if s == nil {
			continue
		}
		o := OpenSession{SessName: name, Port: s.Port()}
		for _, p := range s.Paths() {
			if p.State() != transport.StateDead {
				o.Paths = append(o.Paths, transport.PathAddrs{Src: p.SrcAddr(), Dst: p.DstAddr()})
			}
		}
		if len(o.Paths) == 0 {
			o.Paths, o.Port = declaredPaths(prev, name)
			if len(o.Paths) == 0 {
				continue // nothing to bring it back with
			}
		}
		pol, mra := s.Policy(), s.MaxReconnectAttempts()
		o.Policy, o.MaxReconnectAttempts = &pol, &mra
		out = append(out, VerbOpenSession+" "+o.String())
	}
	for _, d := range c.Mapped() {
		r := MapRequest{MapOptions: rnbd.MapOptions{SessName: d.Session(), DevicePath: d.Path(),
			AccessMode: d.AccessMode(), Port: transport.DefaultPort}, Attach: AttachDefault, Ublk: AttachDefault}
		if c.Attacher != nil {
			r.Attach = c.Attacher.Token(d)
		}
		if c.Ublk != nil {
			r.Ublk = c.Ublk.Token(d)
		}
		out = append(out, VerbMapDevice+" "+r.String())
	}
	return out
}
