package rnbd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// DeviceState is a mapped device's state.
type DeviceState int

// Device states: mapped and usable; disconnected (its session has no path; IO waits up to
// the reconnect timeout); unmapped; closed by the server (its force_close: IO fails with
// EIO at once, the device stays until unmapped and is not remapped on a reconnect).
const (
	StateMapped DeviceState = iota
	StateDisconnected
	StateUnmapped
	StateClosedByServer
)

func (st DeviceState) String() string {
	return [...]string{"open", "disconnected", "closed", "closed-by-server"}[st]
}

// Device is a mapped remote device: an io.ReaderAt and io.WriterAt of its size, plus Flush,
// Discard and WriteZeroes.
type Device struct {
	sess *cltSess
	path string
	mode AccessMode

	mu        sync.Mutex
	state     DeviceState
	closedWhy string // why the device is StateClosedByServer
	// idClosed: the CLOSE of id was sent already (a remap that found the geometry changed):
	// an unmap must not send another, which could close a device given the id since.
	idClosed  bool
	id        uint32
	geo       MsgOpenRsp
	downSince time.Time
	changed   chan struct{} // closed and replaced on every state change
	// holders are the openers (a device-view file, an NBD client): the kernel's block
	// device refcount, which a normal unmap must find at zero.
	holders   map[*holder]struct{}
	unmapping bool // an unmap has begun: no new holder

	// resizeMu orders what the front ends are told of size changes (Resize, a remap's new
	// size); onResize tells them (nil: nothing shows the device but its own IO). shown
	// (under mu) is the size they were last told or attached with. A remap's OPEN is never
	// made under resizeMu: a resize telling /dev/nbdX its size waits for the IO in flight,
	// which may wait for that remap.
	resizeMu sync.Mutex
	onResize func(ctx context.Context, old, size int64) error
	shown    int64

	// noUnmapRefused: the server answered a WRITE_ZEROES with RNBD_F_NOUNMAP EOPNOTSUPP (ours
	// before protocol 2.2 announced WRITE_ZEROES but refused flags it did not know). Zeroes
	// that must stay allocated are then written as data, until the next open.
	noUnmapRefused atomic.Bool

	// bl holds the asynchronous requests waiting for a permit (backlog.go).
	bl backlog
	// gate orders sends against Unmap: a send holds it shared from its look at the state to
	// its post, and Unmap takes it once, after turning the device unmapped and before
	// CLOSE, so that no request goes out after CLOSE with the id CLOSE gave back.
	gate sync.RWMutex
}

// open sends OPEN and takes the answer: id and geometry. A remapped device must keep its
// block size; a new size it takes, as the kernel's client does (the export was grown or
// shrunk on the server while the session was down), and tells its front ends.
func (d *Device) open(ctx context.Context) error {
	var usr [OpenSize]byte
	if err := (MsgOpen{AccessMode: d.mode, DevName: d.path}).Put(usr[:]); err != nil {
		return err
	}
	var buf [OpenRspSize]byte
	if err := d.sess.rtrs.DoAdmin(ctx, transport.Read, usr[:], buf[:]); err != nil {
		return fmt.Errorf("rnbd: open %q: %w", d.path, err)
	}
	var rsp MsgOpenRsp
	if err := rsp.Unmarshal(buf[:]); err != nil {
		if typ, _ := PeekType(buf[:]); typ == MsgTypeOpenRsp {
			d.sendClose(ctx, rsp.DeviceID) // the server opened it; we will not use it
		}
		return fmt.Errorf("rnbd: open %q: %w", d.path, err)
	}
	if m := d.sess.rtrs.MaxIOSize(); m < int(rsp.LogicalBlockSize) {
		// No IO of one block would fit in the session's chunks: the device could not be used.
		err := fmt.Errorf("rnbd: open %q: %d-byte blocks, the session's max IO is %d: %w", d.path, rsp.LogicalBlockSize, m, syscall.EBADMSG)
		d.sendClose(ctx, rsp.DeviceID)
		return err
	}
	d.mu.Lock()
	if d.state == StateUnmapped {
		// Unmapped while this OPEN (a remap's) was on the wire: the server holds the id it
		// has just given, and nobody else will close it.
		d.mu.Unlock()
		d.sendClose(ctx, rsp.DeviceID)
		return errUnmappedMeanwhile
	}
	if d.geo.LogicalBlockSize != 0 && rsp.LogicalBlockSize != d.geo.LogicalBlockSize {
		// The export is not the device that was mapped (replaced by one of another block
		// size, which a file system on it could not take). It is closed on the server,
		// which would otherwise hold it open for this session (rw: nobody else could open
		// it), and stays closed here, not retried at every remap: unmap_device and
		// map_device take it as it now is.
		why := fmt.Sprintf("its block size changed on the server (%d bytes, now %d)", d.geo.LogicalBlockSize, rsp.LogicalBlockSize)
		d.closedWhy = "closed: " + why
		d.id, d.idClosed = rsp.DeviceID, true
		d.setStateLocked(StateClosedByServer)
		d.mu.Unlock()
		d.sendClose(ctx, rsp.DeviceID)
		d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).
			Warnf("remap: %s: closed, its IO fails with EIO until it is unmapped and mapped again", why)
		return fmt.Errorf("rnbd: %q: %s: %w", d.path, why, errClosedAtRemap)
	}
	old := int64(d.geo.NSectors) * SectorSize
	remap := d.geo.LogicalBlockSize != 0
	d.id, d.geo, d.idClosed = rsp.DeviceID, rsp, false
	d.noUnmapRefused.Store(false) // the server may have been upgraded under a remap
	d.setStateLocked(StateMapped)
	if !remap {
		d.shown = int64(rsp.NSectors) * SectorSize
	}
	d.mu.Unlock()
	if size := int64(rsp.NSectors) * SectorSize; remap && size != old {
		d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).
			Infof("remap: the device's size changed from %d to %d sectors", old/SectorSize, rsp.NSectors)
		d.showSize(ctx)
	}
	return nil
}

// showSize tells the front ends the device's size if it is not the one they show (a remap
// took the server's). One that cannot follow keeps its size: IO past a smaller end fails
// here (EINVAL), a larger end is not seen; the log says so.
func (d *Device) showSize(ctx context.Context) {
	d.resizeMu.Lock()
	defer d.resizeMu.Unlock()
	d.mu.Lock()
	fe, shown, cur := d.onResize, d.shown, int64(d.geo.NSectors)*SectorSize
	d.mu.Unlock()
	if cur == shown {
		return
	}
	if fe != nil {
		if err := fe(ctx, shown, cur); err != nil {
			d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).WithError(err).
				Warnf("remap: the device's front ends keep %d sectors", shown/SectorSize)
			return
		}
	}
	d.mu.Lock()
	d.shown = cur
	d.mu.Unlock()
}

// OnResize sets what tells the device's front ends (its kernel block devices) of a new
// size, from Resize or from a remap that found the export resized: fn(ctx, old, size)
// returns an error when one of them cannot follow, having put back those that did.
func (d *Device) OnResize(fn func(ctx context.Context, old, size int64) error) {
	d.resizeMu.Lock()
	defer d.resizeMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.onResize = fn
}

// Resize gives the device a new size in sectors (the kernel's resize): the operator grew
// or shrank the export on the server, and IO up to the new end goes through. Only an open
// device is resized (ENOENT otherwise); the size must be whole blocks and more than none
// (EINVAL). When a front end cannot follow, nothing changes. A larger size is taken
// before the front ends show it, a smaller one after they do, so that no IO they pass
// falls outside it.
func (d *Device) Resize(ctx context.Context, sectors uint64) error {
	d.resizeMu.Lock()
	defer d.resizeMu.Unlock()
	d.mu.Lock()
	st, geo, fe := d.state, d.geo, d.onResize
	d.mu.Unlock()
	if st != StateMapped {
		return fmt.Errorf("rnbd: resize %q: the device is not open: %w", d.path, syscall.ENOENT)
	}
	size := int64(sectors) * SectorSize
	if sectors == 0 || sectors > maxSectors || size%int64(geo.LogicalBlockSize) != 0 {
		return fmt.Errorf("rnbd: resize %q to %d sectors: not whole %d-byte blocks of a device: %w", d.path, sectors, geo.LogicalBlockSize, syscall.EINVAL)
	}
	old := int64(geo.NSectors) * SectorSize
	if size == old {
		return nil
	}
	// set changes the size from one value to another, unless a remap has taken the
	// server's meanwhile.
	set := func(from, to uint64) {
		d.mu.Lock()
		if d.geo.NSectors == from {
			d.geo.NSectors = to
		}
		d.mu.Unlock()
	}
	if size > old {
		set(geo.NSectors, sectors)
	}
	if fe != nil {
		if err := fe(ctx, old, size); err != nil {
			if size > old {
				set(sectors, geo.NSectors)
			}
			return fmt.Errorf("rnbd: resize %q to %d sectors: %w", d.path, sectors, err)
		}
	}
	if size < old {
		set(geo.NSectors, sectors)
	}
	d.mu.Lock()
	d.shown = size
	d.mu.Unlock()
	d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).Infof("the device's size changed from %d to %d sectors", geo.NSectors, sectors)
	return nil
}

// Remap opens the device on the server again now (the kernel's remap_device): ENODEV once
// it is unmapped or being unmapped, EALREADY while it is open. A device waiting for its
// session's remap, or one the server closed (force_close), is opened at once; the answer
// must keep its size and block size, or the device stays closed (EIO).
func (d *Device) Remap(ctx context.Context) error {
	d.mu.Lock()
	st, unmapping, id, idClosed := d.state, d.unmapping, d.id, d.idClosed
	d.mu.Unlock()
	switch {
	case st == StateUnmapped || unmapping:
		return fmt.Errorf("rnbd: %q is not mapped: %w", d.path, syscall.ENODEV)
	case st == StateMapped:
		return fmt.Errorf("rnbd: %q is open: %w", d.path, syscall.EALREADY)
	case st == StateClosedByServer && !idClosed:
		// The server keeps a force-closed id until its CLOSE, as for an unmap. Marked first,
		// under the lock, so that an unmap or another remap meanwhile does not close it
		// again (by then the server may have given the id to another device).
		d.mu.Lock()
		mine := d.id == id && !d.idClosed
		if mine {
			d.idClosed = true
		}
		d.mu.Unlock()
		if mine {
			d.sendClose(ctx, id)
		}
	}
	if err := d.open(ctx); err != nil {
		if errors.Is(err, errUnmappedMeanwhile) {
			return fmt.Errorf("rnbd: %q was unmapped meanwhile: %w", d.path, syscall.ENODEV)
		}
		return err
	}
	d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).Info("device remapped (remap_device)")
	return nil
}

func (d *Device) setStateLocked(st DeviceState) {
	if st == StateDisconnected && d.state != StateDisconnected {
		d.downSince = time.Now()
	}
	d.state = st
	close(d.changed)
	d.changed = make(chan struct{})
}

func (d *Device) setDown() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state == StateMapped {
		d.setStateLocked(StateDisconnected)
	}
}

// Opened says whether the first OPEN has been answered (the device has its size); a
// device is listed from the start of Map, so that a second Map of it is EEXIST.
func (d *Device) Opened() bool { d.mu.Lock(); defer d.mu.Unlock(); return d.geo.LogicalBlockSize != 0 }

// Session is the device's session name; Path its path on the server.
func (d *Device) Session() string { return d.sess.name }

// Path is the device path the server opened.
func (d *Device) Path() string { return d.path }

// AccessMode is the mode the device was mapped with.
func (d *Device) AccessMode() AccessMode { return d.mode }

// State is the device's state.
func (d *Device) State() DeviceState { d.mu.Lock(); defer d.mu.Unlock(); return d.state }

// ID is the server's id for the device (it changes when the device is remapped).
func (d *Device) ID() uint32 { d.mu.Lock(); defer d.mu.Unlock(); return d.id }

// Size is the device's size in bytes.
func (d *Device) Size() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int64(d.geo.NSectors) * SectorSize
}

// Geometry is the server's OPEN_RSP for the device.
func (d *Device) Geometry() MsgOpenRsp { d.mu.Lock(); defer d.mu.Unlock(); return d.geo }

// BlockSize is the logical block size: offsets and lengths of IO must be multiples of it.
func (d *Device) BlockSize() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int(d.geo.LogicalBlockSize)
}

// errClosedAtRemap is a remap's OPEN of a device that is no longer the one mapped (its
// geometry changed): closed, not tried again.
var errClosedAtRemap = fmt.Errorf("closed at the remap: %w", syscall.EIO)

// errUnmappedMeanwhile is a remap's OPEN answered after the device was unmapped.
var errUnmappedMeanwhile = errors.New("rnbd: unmapped while being opened")

// holder is one opener: who it is, and how to make it let go when the device is unmapped
// under it (nil: its IO fails, which is all).
type holder struct {
	who    string
	revoke func()
}

// Hold records an opener of the device, named by who ("device view file", "NBD client
// pid 4711"), until release is called: a normal unmap is refused while the device has
// one, as the kernel refuses to unmap an open rnbd device. An unmap that goes through all
// the same (force, or the client closing) calls revoke, if not nil, once the device is
// unmapped: an NBD client's connection is closed then. A device being unmapped takes no
// new opener (ENODEV).
func (d *Device) Hold(who string, revoke func()) (release func(), err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.state == StateUnmapped || d.unmapping {
		return nil, fmt.Errorf("rnbd: %q is being unmapped: %w", d.path, syscall.ENODEV)
	}
	if d.holders == nil {
		d.holders = map[*holder]struct{}{}
	}
	h := &holder{who: who, revoke: revoke}
	d.holders[h] = struct{}{}
	return func() {
		d.mu.Lock()
		delete(d.holders, h)
		d.mu.Unlock()
	}, nil
}

// Holders lists the device's openers, "who ×n" each, sorted.
func (d *Device) Holders() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.holdersLocked()
}

func (d *Device) holdersLocked() []string {
	n := map[string]int{}
	for h := range d.holders {
		n[h.who]++
	}
	out := make([]string, 0, len(n))
	for who, k := range n {
		out = append(out, fmt.Sprintf("%s ×%d", who, k))
	}
	slices.Sort(out)
	return out
}

// BeginUnmap marks the device as being unmapped, so that it takes no new opener, before
// its front ends are detached and Unmap runs. Without force it is refused (EBUSY) while the
// device has openers (Hold), naming them; with force the openers' IO fails from the unmap
// on, as the kernel's "force" unmap does. abort undoes the mark when the unmap does not go
// through. A second unmap of the same device while one is under way is EBUSY.
func (d *Device) BeginUnmap(force bool) (abort func(), err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.state == StateUnmapped:
		return nil, fmt.Errorf("rnbd: %q is not mapped: %w", d.path, syscall.ENOENT)
	case d.unmapping:
		return nil, fmt.Errorf("rnbd: %q is already being unmapped: %w", d.path, syscall.EBUSY)
	case !force && len(d.holders) > 0:
		return nil, fmt.Errorf("rnbd: %q is open (%s; unmap with force to unmap it all the same): %w",
			d.path, strings.Join(d.holdersLocked(), ", "), syscall.EBUSY)
	}
	d.unmapping = true
	return func() {
		d.mu.Lock()
		if d.state != StateUnmapped {
			d.unmapping = false
		}
		d.mu.Unlock()
	}, nil
}

// Unmapping says whether the device is unmapped or an unmap has begun (BeginUnmap): a front
// end that finishes attaching to it then lets go instead, since the unmap has already
// detached the front ends it found.
func (d *Device) Unmapping() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.state == StateUnmapped || d.unmapping
}

// Unmap sends CLOSE and forgets the device; the session goes with its last device. IO still
// waiting fails, and openers that said how are made to let go (Hold). A device whose first OPEN is still on the wire is refused (EBUSY): its id
// is not known yet. A CLOSE that fails is logged, not returned, as the kernel's client does:
// the device is unmapped here all the same, and the server lets the id go with the session.
func (d *Device) Unmap(ctx context.Context) error {
	d.mu.Lock()
	if d.state == StateUnmapped {
		d.mu.Unlock()
		return fmt.Errorf("rnbd: %q is not mapped: %w", d.path, syscall.ENOENT)
	}
	if d.geo.LogicalBlockSize == 0 {
		d.mu.Unlock()
		return fmt.Errorf("rnbd: %q is still being mapped: %w", d.path, syscall.EBUSY)
	}
	// A device the server closed is closed too: the server still holds its id for us
	// (force_close), unless the client closed it already (a changed geometry).
	wasMapped, id := d.state == StateMapped || d.state == StateClosedByServer && !d.idClosed, d.id
	d.setStateLocked(StateUnmapped)
	var revoke []func()
	for h := range d.holders {
		if h.revoke != nil {
			revoke = append(revoke, h.revoke)
		}
	}
	d.mu.Unlock()
	for _, f := range revoke {
		f()
	}
	// A send that saw the device mapped has posted by the time the gate is ours; the
	// backlog's permit wait is cut short, and what it holds fails (ENODEV).
	d.bl.kick()
	d.gate.Lock()
	//lint:ignore SA2001 taking the lock is the point: it waits for the sends under way
	d.gate.Unlock()
	if wasMapped {
		d.sendClose(ctx, id)
	}
	d.bl.wait(ctx)
	d.sess.remove(d)
	d.sess.c.putSessIfIdle(d.sess)
	return nil
}

// sendClose sends CLOSE for id, logging a failure, within the caller's ctx; or, when that has
// run out already (an OPEN answered late), within a deadline of its own, since the id would
// stay open.
func (d *Device) sendClose(ctx context.Context, id uint32) {
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), d.sess.c.opts.ReconnectTimeout)
		defer cancel()
	}
	var usr [CloseSize]byte
	MsgClose{DeviceID: id}.Put(usr[:])
	if err := d.sess.rtrs.DoAdmin(ctx, transport.Write, usr[:], nil); err != nil {
		d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path, "device_id": id}).
			Warnf("close: %v (the server keeps the device open until the session ends)", err)
	}
}

// markStale records that IO with id found no session or an unknown id: the device waits
// for a remap, which is asked for if the session has a path.
func (d *Device) markStale(id uint32) {
	d.mu.Lock()
	if d.state == StateMapped && d.id == id {
		d.setStateLocked(StateDisconnected)
	}
	d.mu.Unlock()
	if d.sess.anyConnected() {
		d.sess.kickRemap()
	}
}

// serverClosed says whether an IO error is the server's answer that it does not serve the
// device id any more although the session is up: ENOTCONN from the wire, as the kernel's
// server (and ours after force_close) answers IO to a device it closed. The transport's own
// ENOTCONN (a path not connected, ErrNotConn) is not that.
func serverClosed(err error) bool {
	var en syscall.Errno
	return errors.As(err, &en) && en == syscall.ENOTCONN && !errors.Is(err, transport.ErrNotConn)
}

// closedByServer turns the device closed-by-server if id is still its id (says false when a
// remap gave it another id meanwhile) and logs it once.
func (d *Device) closedByServer(id uint32) bool {
	d.mu.Lock()
	switch {
	case d.state == StateClosedByServer:
		d.mu.Unlock()
		return true
	case d.id != id || d.state == StateUnmapped:
		d.mu.Unlock()
		return false
	}
	d.closedWhy = "closed by the server (force_close)"
	d.setStateLocked(StateClosedByServer)
	d.mu.Unlock()
	d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path, "device_id": id}).
		Warn("the server closed the device (force_close on the server): its IO fails with EIO until it is unmapped and mapped again")
	return true
}

func (d *Device) errClosedByServer() error {
	d.mu.Lock()
	why := d.closedWhy
	d.mu.Unlock()
	return fmt.Errorf("rnbd: %q of session %q was %s: %w", d.path, d.sess.name, why, syscall.EIO)
}
