package ublk

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Options describe a device to add.
type Options struct {
	// ID is the device number wanted (/dev/ublkb<ID>), or -1 for any free one.
	ID int
	// Queues and Depth: hardware queues, each with Depth requests in flight at most.
	Queues, Depth int
	// MaxIO is the largest request in bytes (a multiple of 4096).
	MaxIO int
	// Params are the device's limits and attributes; Basic.MaxSectors defaults to MaxIO.
	Params Params
	// SrvFlags are kept by the driver for the server (ublksrv_flags): a mark a later
	// process finds in DevInfo, to know the device for its own before it recovers it.
	SrvFlags uint64
}

// Device is a started ublk device this process serves.
type Device struct {
	ctrl   *Ctrl
	id     uint32
	info   DevInfo
	cdev   *os.File
	queues []*queue
	wg     sync.WaitGroup

	stopMu     sync.Mutex
	devStopped bool // STOP_DEV was answered
	stopped    bool // and the device deleted
	stopFailed bool // a Stop failed: the number may since be another device's

	queueFailed atomic.Bool // a queue loop ended on an error, with requests it had fetched

	// Between prepare and begin: the loops' reports, and what tells them to fetch.
	ready chan error
	fetch chan bool
}

// Create adds a device, sets its parameters, starts a queue loop per queue serving
// requests with h, and starts the device; /dev/ublkb<ID> then exists. The device has user
// recovery with reissue: if this process dies, the device and its waiting IO stay until
// Recover takes it over (or it is deleted).
func Create(ctrl *Ctrl, o Options, h Handler) (*Device, error) {
	if o.Queues < 1 || o.Queues > 64 || o.Depth < 1 || o.Depth > maxQueueDepth || o.MaxIO < 4096 || o.MaxIO%4096 != 0 || o.MaxIO > 1<<20 {
		return nil, fmt.Errorf("ublk: %d queues × %d, max IO %d: out of range: %w", o.Queues, o.Depth, o.MaxIO, syscall.EINVAL)
	}
	id := ^uint32(0)
	if o.ID >= 0 {
		id = uint32(o.ID)
	}
	info, err := ctrl.AddDev(DevInfo{NrHWQueues: uint16(o.Queues), QueueDepth: uint16(o.Depth), MaxIOBufBytes: uint32(o.MaxIO),
		DevID: id, SrvFlags: o.SrvFlags, Flags: FlagUserRecovery | FlagUserRecoveryReissue | FlagCmdIoctlEncode})
	if err != nil {
		if o.ID >= 0 && errors.Is(err, syscall.EEXIST) {
			return nil, fmt.Errorf("ublk device %d exists already: %w", o.ID, syscall.EEXIST)
		}
		return nil, fmt.Errorf("ublk ADD_DEV: %w", err)
	}
	d := &Device{ctrl: ctrl, id: info.DevID, info: info}
	p := o.Params
	p.Types |= ParamTypeBasic
	var ok bool
	if p.Basic.MaxSectors, ok = maxSectors(p.Basic.MaxSectors, o.MaxIO, info.MaxIOBufBytes); !ok {
		d.delete()
		return nil, fmt.Errorf("ublk device %d: max IO %d is below the driver's page (it granted %d bytes): %w", d.id, o.MaxIO, info.MaxIOBufBytes, syscall.EINVAL)
	}
	if err := ctrl.SetParams(d.id, p); err != nil {
		d.delete()
		return nil, fmt.Errorf("ublk SET_PARAMS on %d: %w", d.id, err)
	}
	if err := d.start(h, ctrl.StartDev, true); err != nil {
		d.delete()
		return nil, fmt.Errorf("ublk START_DEV on %d: %w", d.id, err)
	}
	return d, nil
}

// Recover takes over device id, whose server died: it waits up to wait for the driver to
// have quiesced it, then starts queue loops serving h and ends the recovery; the requests
// that waited go to h (those the dead server had taken are issued again).
func Recover(ctrl *Ctrl, id int, h Handler, wait time.Duration) (*Device, error) {
	deadline := time.Now().Add(wait)
	var d *Device
	for {
		info, err := ctrl.DevInfo(uint32(id))
		if err != nil {
			d.unprepare()
			return nil, fmt.Errorf("ublk device %d: %w", id, err)
		}
		if info.State == stateLive && info.SrvPID > 0 && servedBy(int(info.SrvPID), id) {
			d.unprepare()
			return nil, fmt.Errorf("ublk device %d is served by live process %d: %w", id, info.SrvPID, syscall.EBUSY)
		}
		if info.State == stateQuiesced {
			if d == nil {
				// What needs no driver is set up before START_USER_RECOVERY: on 6.12 a
				// recovery that fails after it leaves the device unrecoverable (the
				// driver then refuses the next START_USER_RECOVERY, or resets queues
				// that never fetched).
				d = &Device{ctrl: ctrl, id: uint32(id), info: info}
				if err := d.prepare(h); err != nil {
					return nil, fmt.Errorf("ublk device %d: setting up its queues: %w", id, err)
				}
			}
			// EBUSY while the dead server's char device is not yet released.
			err = ctrl.StartUserRecovery(uint32(id))
			if err == nil {
				break
			}
			if !errors.Is(err, syscall.EBUSY) {
				d.unprepare()
				return nil, fmt.Errorf("ublk START_USER_RECOVERY on %d: %w", id, err)
			}
		}
		if time.Now().After(deadline) {
			d.unprepare()
			return nil, fmt.Errorf("ublk device %d is %v and cannot be recovered after %v (%v): %w", id, info.State, wait, err, syscall.EBUSY)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := d.begin(ctrl.EndUserRecovery, false); err != nil {
		return nil, fmt.Errorf("ublk END_USER_RECOVERY on %d: %w", id, err)
	}
	return d, nil
}

// maxSectors is the device's max_sectors: want (0: all of maxIO), within the buffer the driver
// granted, which ADD_DEV rounds down to its page size (64 KiB on some arm64 and ppc64
// kernels) and SET_PARAMS refuses max_sectors beyond; false if it granted none.
func maxSectors(want uint32, maxIO int, granted uint32) (uint32, bool) {
	if want == 0 {
		want = uint32(maxIO >> 9)
	}
	return min(want, granted>>9), granted >= 4096
}

func processGone(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return errors.Is(err, os.ErrNotExist)
}

// servedBy says whether process pid serves device id: it lives and holds /dev/ublkc<id>
// open. The pid the driver recorded is the dead server's number (6.12 records it as given,
// in that server's pid namespace): a new process may have it since (a daemon restarted in a
// new container is pid 1 again, as its predecessor was), and this one never serves a
// device it is recovering. Its descriptors unreadable, a live process is taken to serve it.
func servedBy(pid, id int) bool {
	if pid == os.Getpid() || processGone(pid) {
		return false
	}
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	char := "/dev/ublkc" + strconv.Itoa(id)
	for _, e := range ents {
		if l, err := os.Readlink(dir + "/" + e.Name()); err == nil && l == char {
			return true
		}
	}
	return false
}

// start sets the queues up and begins them (see prepare and begin).
func (d *Device) start(h Handler, final func(uint32) error, scans bool) error {
	if err := d.prepare(h); err != nil {
		return err
	}
	return d.begin(final, scans)
}

// prepare sets up every queue as far as it can without the driver (buffers, eventfd, and
// the ring, on the loop's own thread); the loops then wait for begin. On failure nothing
// is left.
func (d *Device) prepare(h Handler) error {
	n := int(d.info.NrHWQueues)
	d.ready, d.fetch = make(chan error, n), make(chan bool, n)
	var err error
	for i := 0; i < n; i++ {
		var q *queue
		if q, err = newQueue(d, i, h); err != nil {
			break
		}
		d.queues = append(d.queues, q)
		d.wg.Add(1)
		go q.run(d.ready, d.fetch)
	}
	for range d.queues {
		if rerr := <-d.ready; rerr != nil && err == nil {
			err = rerr
		}
	}
	if err != nil {
		d.unprepare()
	}
	return err
}

// unprepare ends loops that prepare started and begin has not (on a nil Device, nothing).
func (d *Device) unprepare() {
	if d == nil {
		return
	}
	for range d.queues {
		d.fetch <- false
	}
	d.abort()
}

// begin opens the char device, maps each queue's descriptors, lets the loops fetch, and
// once each has fetched its requests runs final (START_DEV or END_USER_RECOVERY), which
// waits for exactly that; scans says final also waits for the new disk's partition scan
// (START_DEV). No queue fetches unless every one can: a device whose queues fetched in
// part can neither start nor, on 6.12, be recovered again.
func (d *Device) begin(final func(uint32) error, scans bool) error {
	path := "/dev/ublkc" + strconv.Itoa(int(d.id))
	var err error
	// devtmpfs makes the node as the driver registers it; udev may be slower.
	for t0 := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		d.cdev, err = os.OpenFile(path, os.O_RDWR, 0)
		if err == nil || !errors.Is(err, os.ErrNotExist) || time.Since(t0) > 5*time.Second {
			break
		}
	}
	if err == nil {
		for _, q := range d.queues {
			if err = q.mapDescs(); err != nil {
				break
			}
		}
	}
	if err != nil {
		d.unprepare()
		return err
	}
	for range d.queues {
		d.fetch <- true
	}
	for range d.queues {
		if err := <-d.ready; err != nil {
			d.abort()
			return err
		}
	}
	if err := final(d.id); err != nil {
		// 7.2 scans after START_DEV: a start that timed out there waits for something
		// else, and the device counts as started only once the driver says it is live.
		if scans && errors.Is(err, syscall.ETIMEDOUT) && d.live() {
			// Every queue has fetched, so what the command still waits for is the new
			// disk's partition scan, whose reads the queues serve (each bounded by the
			// mapping's IO timeout): the device is served and finishes starting when they
			// are answered. Aborting instead would leave the scan's reads waiting for a
			// server (user recovery) and the command holding the device's lock, which the
			// delete would then wait for.
			return nil
		}
		d.abort()
		return err
	}
	return nil
}

// live says whether the driver has the device live (it sets that before adding the disk).
func (d *Device) live() bool {
	info, err := d.ctrl.DevInfo(d.id)
	return err == nil && info.State == stateLive
}

// abort ends the queue loops without the driver's help (closing a ring cancels its
// fetches) and closes the char device.
func (d *Device) abort() {
	for _, q := range d.queues {
		q.quit.Store(true)
		q.bell.Wake()
	}
	d.wg.Wait()
	for _, q := range d.queues {
		q.release()
	}
	d.queues = nil
	if d.cdev != nil {
		d.cdev.Close()
		d.cdev = nil
	}
}

// waitNoServer waits up to timeout for the driver to have dealt with the release of the
// char device: it does so in a work item of its own, which fails or requeues the requests
// the server had taken and then takes the device's lock, so a STOP_DEV sent before it
// would hold that lock waiting for those requests, and neither would go on.
func (d *Device) waitNoServer(timeout time.Duration) {
	for t0 := time.Now(); time.Since(t0) < timeout; time.Sleep(10 * time.Millisecond) {
		info, err := d.ctrl.DevInfo(d.id)
		if errors.Is(err, syscall.ENODEV) || err == nil && info.State != stateLive {
			return
		}
	}
}

// stopTimeout bounds how long Stop waits for the driver to abort every fetch.
const stopTimeout = 30 * time.Second

// loopsEnd waits up to timeout for the queue loops to end by themselves.
func (d *Device) loopsEnd(timeout time.Duration) bool {
	ended := make(chan struct{})
	go func() {
		d.wg.Wait()
		close(ended)
	}()
	select {
	case <-ended:
		return true
	case <-time.After(timeout):
		return false
	}
}

// delete deletes the device from the driver, logging nothing: for failed setups.
func (d *Device) delete() { _ = d.ctrl.DelDev(d.id) }

// ID is the device number.
func (d *Device) ID() int { return int(d.id) }

// Resize gives the started device sectors sectors (Ctrl.UpdateSize).
func (d *Device) Resize(sectors uint64) error {
	if err := d.ctrl.UpdateSize(d.id, sectors); err != nil {
		return fmt.Errorf("ublk: resize %s to %d sectors: %w", d.BlockPath(), sectors, err)
	}
	return nil
}

// BlockPath is the block device, /dev/ublkb<ID>.
func (d *Device) BlockPath() string { return "/dev/ublkb" + strconv.Itoa(int(d.id)) }

// Info is the device's info as the driver gave it at start.
func (d *Device) Info() DevInfo { return d.info }

// Busy says whether the block device is held exclusively (mounted, or a holder such as
// device-mapper) or open in some process.
func (d *Device) Busy() bool { return BlockBusy(d.BlockPath()) }

// Stop stops and deletes the device: the disk goes, requests still queued fail, the queue
// loops end. A Stop that failed (a control command that did not complete, say) may be
// called again: it deletes what is left; once one has succeeded, Stop returns nil.
func (d *Device) Stop() error { return d.stop(false) }

// StopIfUnused is Stop for a device nothing has open. Where the driver has FlagSafeStopDev
// (7.x), the check and the stop are one command, which also turns away opens from then on,
// so a mount that lands after the caller's own check (Busy) is not cut off: it fails with
// EBUSY, and the device goes on as it was. Elsewhere it is Stop, and the caller's check
// is all there is.
func (d *Device) StopIfUnused() error { return d.stop(true) }

func (d *Device) stop(ifUnused bool) error {
	d.stopMu.Lock()
	defer d.stopMu.Unlock()
	if d.stopped {
		return nil
	}
	if d.stopFailed {
		// A delete of the last attempt may have completed since, and the number gone to a
		// new device: only one that still carries this one's mark is this one.
		info, err := d.ctrl.DevInfo(d.id)
		if errors.Is(err, syscall.ENODEV) || err == nil && info.SrvFlags != d.info.SrvFlags {
			d.abort()
			d.stopped = true
			return nil
		}
	}
	var err error
	if !d.devStopped && d.queueFailed.Load() {
		// Requests the failed queue had fetched stay started until the char device is
		// released (7.2), and STOP_DEV would wait for them, holding the device's lock, up
		// to the control timeout: release it first, and let the driver finish with the
		// release. (Not served any more, the device gains nothing from TRY_STOP_DEV.)
		if ifUnused && d.Busy() {
			return fmt.Errorf("ublk: device %d is open: %w", d.id, syscall.EBUSY)
		}
		d.abort()
		d.waitNoServer(stopTimeout)
		ifUnused = false
	}
	if !d.devStopped {
		err = syscall.EOPNOTSUPP
		if ifUnused {
			err = d.ctrl.TryStopDev(d.id)
			if errors.Is(err, syscall.EBUSY) {
				return fmt.Errorf("ublk: device %d is open: %w", d.id, err)
			}
			// Another failure before the driver could check (the command not sent, a
			// refusal): nothing changed, and going on would stop the device unchecked. A
			// timeout goes on: the driver may have checked and be stopping.
			if err != nil && !errors.Is(err, syscall.EOPNOTSUPP) && !errors.Is(err, syscall.ENODEV) && !errors.Is(err, syscall.ETIMEDOUT) {
				return fmt.Errorf("ublk: stopping device %d if unused: %w", d.id, err)
			}
		}
		// ENODEV: no disk (never started, or stopped by an earlier try), so nothing open.
		if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENODEV) {
			err = d.ctrl.StopDev(d.id)
		}
		if err == nil {
			d.devStopped = true
			if !d.loopsEnd(stopTimeout) {
				err = fmt.Errorf("queues still running %v after STOP_DEV: %w", stopTimeout, syscall.ETIMEDOUT)
			}
		}
	}
	// On error the loops would wait for aborts that may never come. (DEL_DEV stops a device
	// not stopped yet.)
	d.abort()
	if derr := d.ctrl.DelDev(d.id); derr != nil && !errors.Is(derr, syscall.ENODEV) && err == nil {
		err = derr
	} else if derr == nil || errors.Is(derr, syscall.ENODEV) {
		d.stopped, err = true, nil
	}
	if err != nil {
		d.stopFailed = true
		return fmt.Errorf("ublk: stopping device %d: %w", d.id, err)
	}
	return nil
}
