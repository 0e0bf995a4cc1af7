package rnbd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// Plug gathers the device's next requests and sends them together at Unplug
// (transport.Session.Plug); the caller must not wait for their completions in between.
func (d *Device) Plug() { d.sess.rtrs.Plug() }

// Unplug sends what Plug gathered.
func (d *Device) Unplug() { d.sess.rtrs.Unplug() }

// AllocIOBuffers is transport.Session.AllocIOBuffers of the device's session: memory for
// request data that goes out, and lands, without the staging copy where the session's paths
// stage data (verbs); nil where they do not. Data passed to ReadAsync or WriteAsync must
// begin one of its regions to skip the copy (an IO split at MaxIO begins none but its first).
// free's channel is closed once the memory is given back.
func (d *Device) AllocIOBuffers(n, stride int) (buf []byte, free func() <-chan struct{}, err error) {
	return d.sess.rtrs.AllocIOBuffers(n, stride)
}

// AfterCompletions registers fn with the device's client (see Client.AfterCompletions).
func (d *Device) AfterCompletions(fn func()) (remove func()) { return d.sess.c.AfterCompletions(fn) }

// usable waits until the device is mapped and returns its id, or fails: EIO once the
// session has been gone for longer than the reconnect timeout, ENODEV when unmapped.
func (d *Device) usable(ctx context.Context) (uint32, error) {
	for {
		d.mu.Lock()
		st, id, ch := d.state, d.id, d.changed
		deadline := d.downSince.Add(d.sess.c.opts.ReconnectTimeout)
		d.mu.Unlock()
		switch st {
		case StateMapped:
			return id, nil
		case StateUnmapped:
			return 0, fmt.Errorf("rnbd: %q is unmapped: %w", d.path, syscall.ENODEV)
		case StateClosedByServer:
			return 0, d.errClosedByServer()
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			return 0, fmt.Errorf("rnbd: session %q gone for longer than %v: %w", d.sess.name, d.sess.c.opts.ReconnectTimeout, syscall.EIO)
		}
		t := time.NewTimer(wait)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		}
		t.Stop()
	}
}

// retryable says whether an IO error means "the session or the device id went away":
// no path took the request, or the server does not know the id (it lost the session).
func retryable(err error) bool {
	return errors.Is(err, transport.ErrNoPath) || errors.Is(err, syscall.ENOTCONN) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.ENODEV)
}

// submit sends one IO of at most the max IO size, and waits and resends it while the
// session is away (within the reconnect timeout).
func (d *Device) submit(ctx context.Context, op Op, flags uint32, off int64, n int, data []byte) error {
	var usr [IOSize]byte
	dir := transport.Write
	if op == OpRead {
		dir = transport.Read
	}
	// Resent at most for the reconnect timeout from its first failure: a server that
	// answers every IO with ENODEV, or with ENOTCONN after every remap, would otherwise have
	// it sent again, a remap at a time, for ever (each remap makes the device usable anew).
	var failing time.Time
	backoff := time.Duration(0)
	for {
		id, err := d.usable(ctx)
		if err != nil {
			return err
		}
		MsgIO{DeviceID: id, Sector: uint64(off / SectorSize), RW: uint32(op) | flags, BiSize: uint32(n)}.Put(usr[:])
		err = d.sess.rtrs.Do(ctx, dir, usr[:], data)
		if serverClosed(err) && d.closedByServer(id) {
			return d.errClosedByServer()
		}
		if err == nil || !serverClosed(err) && !retryable(err) || ctx.Err() != nil {
			return err
		}
		if failing.IsZero() {
			failing = time.Now()
		} else if time.Since(failing) > d.sess.c.opts.ReconnectTimeout {
			return fmt.Errorf("rnbd: %q: IO failing for longer than %v (the last time: %v): %w", d.path, d.sess.c.opts.ReconnectTimeout, err, syscall.EIO)
		} else {
			// Failing again: resent after a pause that grows, not in a tight loop of
			// resends and remaps (the first resend, after a failover or remap, goes at once).
			backoff = min(max(2*backoff, 10*time.Millisecond), 500*time.Millisecond)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			}
		}
		if serverClosed(err) {
			continue // the device was remapped under the request: resend with the new id
		}
		// The link event may not have come yet; mark the device down so that we wait for
		// the remap, and ask for one in case the session is up and only the id is stale.
		d.markStale(id)
	}
}

// MaxIO is the largest IO one request carries: the session's and the device's limit, in
// whole blocks.
func (d *Device) MaxIO() int {
	d.mu.Lock()
	lbs, hw := int(d.geo.LogicalBlockSize), int(d.geo.MaxHWSectors)*SectorSize
	d.mu.Unlock()
	m := d.sess.rtrs.MaxIOSize()
	if hw > 0 {
		m = min(m, hw)
	}
	return m - m%lbs
}

// check validates a range against the device: whole blocks, inside the device.
func (d *Device) check(off int64, n int64) error {
	d.mu.Lock()
	lbs, size := int64(d.geo.LogicalBlockSize), int64(d.geo.NSectors)*SectorSize
	d.mu.Unlock()
	if off < 0 || n < 0 || off%lbs != 0 || n%lbs != 0 || off+n > size {
		return fmt.Errorf("rnbd: %d bytes at %d on a %d-byte device with %d-byte blocks: %w", n, off, size, lbs, syscall.EINVAL)
	}
	return nil
}

// split runs fn on consecutive pieces of [off, off+n) of at most max bytes, at most
// splitWindow at once, and returns the first error (no piece starts after it). The window
// bounds what one IO can make the client hold: a server may announce limits of one block,
// which made a 4 GiB discard eight million goroutines at once.
func split(off, n int64, max int, fn func(off int64, n int) error) error {
	if max <= 0 {
		return fmt.Errorf("rnbd: pieces of %d bytes: %w", max, syscall.EINVAL)
	}
	if n <= int64(max) {
		return fn(off, int(n))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	window := make(chan struct{}, splitWindow)
	for n > 0 {
		window <- struct{}{}
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if failed {
			break
		}
		k := int(min(n, int64(max)))
		wg.Add(1)
		go func(off int64, k int) {
			defer func() {
				<-window
				wg.Done()
			}()
			if err := fn(off, k); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}(off, k)
		off, n = off+int64(k), n-int64(k)
	}
	wg.Wait()
	return first
}

// splitWindow is how many pieces of one split IO are in flight at once: more than a
// session's paths take at a time for the large IOs that are split (4 GiB discards, 32 MiB
// NBD reads in 124 KiB pieces).
const splitWindow = 64

// ReadAtContext reads len(p) bytes at off (whole blocks).
func (d *Device) ReadAtContext(ctx context.Context, p []byte, off int64) error {
	if err := d.check(off, int64(len(p))); err != nil {
		return err
	}
	return split(off, int64(len(p)), d.MaxIO(), func(o int64, n int) error {
		b := p[o-off : o-off+int64(n)]
		return d.submit(ctx, OpRead, 0, o, n, b)
	})
}

// WriteAtContext writes p at off (whole blocks); fua makes it durable before it completes.
func (d *Device) WriteAtContext(ctx context.Context, p []byte, off int64, fua bool) error {
	if err := d.check(off, int64(len(p))); err != nil {
		return err
	}
	if d.mode == AccessRO {
		return fmt.Errorf("rnbd: %q is mapped ro: %w", d.path, syscall.EPERM)
	}
	flags := uint32(0)
	if fua {
		flags = FlagFUA | FlagSync
	}
	return split(off, int64(len(p)), d.MaxIO(), func(o int64, n int) error {
		return d.submit(ctx, OpWrite, flags, o, n, p[o-off:o-off+int64(n)])
	})
}

// Flush makes every completed write durable (fdatasync on the server).
func (d *Device) Flush(ctx context.Context) error {
	return d.submit(ctx, OpFlush, FlagSync, 0, 0, nil)
}

// Discard deallocates whole blocks; they read back as zeroes from a file export.
func (d *Device) Discard(ctx context.Context, off, n int64) error {
	return d.rangeOp(ctx, OpDiscard, 0, off, n, d.Geometry().MaxDiscardSectors)
}

// WriteZeroes makes whole blocks read back as zeroes without sending them; noUnmap asks the
// server to keep them allocated (RNBD_F_NOUNMAP: a 2.2 server does, a kernel one of 2.0 ignores
// it and may deallocate them). A server that announces no write-zeroes limit (Linux 6.1's) gets
// none: EOPNOTSUPP, as its op 5 was WRITE_SAME, which it cannot serve. A server that refuses
// NOUNMAP, or cannot zero the range at all, gets the zeroes as data: allocated either way.
func (d *Device) WriteZeroes(ctx context.Context, off, n int64, noUnmap bool) error {
	max := d.Geometry().MaxWriteZeroesSectors
	if !noUnmap || max == 0 {
		return d.rangeOp(ctx, OpWriteZeroes, 0, off, n, max)
	}
	if !d.noUnmapRefused.Load() {
		err := d.rangeOp(ctx, OpWriteZeroes, FlagNoUnmap, off, n, max)
		if !errors.Is(err, syscall.EOPNOTSUPP) {
			return err
		}
		if !d.noUnmapRefused.Swap(true) {
			d.sess.c.log.WithFields(log.Fields{"session": d.sess.name, "device": d.path}).
				Warn("server refused WRITE_ZEROES with NOUNMAP; zeroes that must stay allocated are written as data")
		}
	}
	// Idempotent: a range partly zeroed before the refusal is written whole.
	if err := d.check(off, n); err != nil {
		return err
	}
	// The server's fallback buffer serves here too: one, only ever read (a buffer each was up
	// to a megabyte of heap per request in flight).
	zero := zeroes[:min(n, int64(d.MaxIO()), int64(len(zeroes)))]
	// At most zeroWindow requests at once, however long the range (NBD's may be 4 GiB).
	for n > 0 {
		w := min(n, int64(len(zero))*zeroWindow)
		if err := split(off, w, len(zero), func(o int64, k int) error {
			return d.submit(ctx, OpWrite, 0, o, k, zero[:k])
		}); err != nil {
			return err
		}
		off, n = off+w, n-w
	}
	return nil
}

// zeroWindow is how many writes of zeroes WriteZeroes's fallback has in flight at most.
const zeroWindow = 32

// CanDiscard says whether the server takes DISCARD on this device (its open response
// announced a discard limit of a block or more; not on an ro mapping).
func (d *Device) CanDiscard() bool { return d.rangeMax(d.Geometry().MaxDiscardSectors) > 0 }

// CanWriteZeroes says whether the server takes WRITE_ZEROES on this device: a server of
// Linux 6.12 or later, or ours, on a writable mapping.
func (d *Device) CanWriteZeroes() bool { return d.rangeMax(d.Geometry().MaxWriteZeroesSectors) > 0 }

// rangeMax is the most one DISCARD or WRITE_ZEROES of a server's limit of maxSect sectors
// carries, in whole blocks (at most 1 GiB); 0 when the limit is less than one block, which
// no request can keep to (a broken or hostile server's one sector with 4 KiB blocks: split
// would make pieces of nothing, for ever).
func (d *Device) rangeMax(maxSect uint32) int {
	lbs := d.BlockSize()
	if lbs <= 0 {
		return 0
	}
	max := int(min(int64(maxSect)*SectorSize, 1<<30))
	return max - max%lbs
}

func (d *Device) rangeOp(ctx context.Context, op Op, flags uint32, off, n int64, maxSect uint32) error {
	max := d.rangeMax(maxSect)
	if max == 0 {
		return fmt.Errorf("rnbd: %v not supported on %q (the server's limit is %d sectors, less than a block): %w", op, d.path, maxSect, syscall.EOPNOTSUPP)
	}
	if err := d.check(off, n); err != nil {
		return err
	}
	return split(off, n, max, func(o int64, k int) error {
		return d.submit(ctx, op, flags, o, k, nil)
	})
}

// ReadAt implements io.ReaderAt: whole blocks, no deadline beyond the reconnect timeout.
func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	if err := d.ReadAtContext(context.Background(), p, off); err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteAt implements io.WriterAt (whole blocks).
func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := d.WriteAtContext(context.Background(), p, off, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// asyncReq is one request of the asynchronous path with its RNBD header, pooled with its
// completion callback bound once, so that the path allocates nothing per IO.
type asyncReq struct {
	hdr   [IOSize]byte
	d     *Device
	ctx   context.Context
	op    Op
	flags uint32
	off   int64
	p     []byte
	id    uint32
	done  func(error)
	cb    func(error)
	// unwatch stops the watch on ctx of a request in the backlog.
	unwatch func() bool
}

var asyncPool sync.Pool

func init() {
	// Set here: the callback puts the request back into the pool it comes from.
	asyncPool.New = func() any {
		r := new(asyncReq)
		r.cb = r.complete
		return r
	}
}

// complete is the transport's callback: the request goes back to the pool before done runs.
func (r *asyncReq) complete(err error) {
	if err != nil {
		r.end(err)
		return
	}
	done := r.done
	r.d, r.ctx, r.p, r.done, r.unwatch = nil, nil, nil, nil, nil
	asyncPool.Put(r)
	done(nil)
}

// end returns the request to the pool and ends it with err: failed, or sent again.
func (r *asyncReq) end(err error) {
	d, ctx, op, flags, off, p, id, done := r.d, r.ctx, r.op, r.flags, r.off, r.p, r.id, r.done
	r.d, r.ctx, r.p, r.done, r.unwatch = nil, nil, nil, nil, nil
	asyncPool.Put(r)
	d.asyncFailed(ctx, op, flags, off, p, id, done, err)
}

// ReadAsync reads len(p) bytes at off and calls done once, from a transport goroutine or
// its own, followed by the AfterCompletions hooks; done must not block. An IO that fits one
// request and finds the device mapped and a permit free goes out from the caller's goroutine
// with no hand-off; one that finds no permit joins the device's backlog (backlog.go), and
// anything else (splitting, waiting for a reconnect, resending) runs on a goroutine of its
// own. It never waits; the caller bounds what it keeps in flight.
func (d *Device) ReadAsync(ctx context.Context, p []byte, off int64, done func(error)) {
	d.async(ctx, OpRead, 0, off, p, done)
}

// WriteAsync is ReadAsync for writes; fua makes the write durable before done.
func (d *Device) WriteAsync(ctx context.Context, p []byte, off int64, fua bool, done func(error)) {
	if d.mode == AccessRO {
		done(fmt.Errorf("rnbd: %q is mapped ro: %w", d.path, syscall.EPERM))
		d.sess.c.runHooks()
		return
	}
	flags := uint32(0)
	if fua {
		flags = FlagFUA | FlagSync
	}
	d.async(ctx, OpWrite, flags, off, p, done)
}

func (d *Device) async(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	if err := d.check(off, int64(len(p))); err != nil {
		done(err)
		d.sess.c.runHooks()
		return
	}
	max := d.MaxIO()
	if len(p) <= max {
		d.asyncOne(ctx, op, flags, off, p, done)
		return
	}
	if (len(p)+max-1)/max > splitWindow {
		// A server's limit of a block or two makes a large IO thousands of pieces: they go
		// through the window of the synchronous path, from a goroutine of their own, not
		// all at once.
		go func() {
			done(split(off, int64(len(p)), max, func(o int64, n int) error {
				return d.submit(ctx, op, flags, o, n, p[o-off:o-off+int64(n)])
			}))
			d.sess.c.runHooks()
		}()
		return
	}
	// Split at the max IO size; the last piece to complete reports the first error.
	var left atomic.Int32
	var first atomic.Pointer[error]
	left.Store(int32((len(p) + max - 1) / max))
	piece := func(err error) {
		if err != nil {
			first.CompareAndSwap(nil, &err)
		}
		if left.Add(-1) == 0 {
			if e := first.Load(); e != nil {
				done(*e)
			} else {
				done(nil)
			}
		}
	}
	for o := 0; o < len(p); o += max {
		d.asyncOne(ctx, op, flags, off+int64(o), p[o:min(o+max, len(p))], piece)
	}
}

// asyncOne sends one request; when the device is not mapped, or the session or the id went
// away under the request, it continues on a goroutine with the waiting, resending submit.
// It never waits for a permit: with none free, or with earlier requests of the device
// waiting for one, the request joins the device's backlog (backlog.go).
func (d *Device) asyncOne(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	d.gate.RLock()
	d.mu.Lock()
	st, id := d.state, d.id
	d.mu.Unlock()
	if st != StateMapped {
		d.gate.RUnlock()
		if st == StateClosedByServer {
			done(d.errClosedByServer())
			d.sess.c.runHooks()
			return
		}
		d.asyncSlow(ctx, op, flags, off, p, done)
		return
	}
	r := asyncPool.Get().(*asyncReq)
	r.d, r.ctx, r.op, r.flags, r.off, r.p, r.done = d, ctx, op, flags, off, p, done
	r.setID(id)
	if d.bl.behind(r) {
		d.gate.RUnlock()
		return
	}
	t, err := d.sess.rtrs.TryRequestOrJoin(r.dir(), r.hdr[:], p, r.cb)
	d.gate.RUnlock()
	if t != nil {
		d.queue(r, t)
		return
	}
	if err != nil {
		r.fail(err)
	}
}

// setID writes the request's header for device id.
func (r *asyncReq) setID(id uint32) {
	r.id = id
	MsgIO{DeviceID: id, Sector: uint64(r.off / SectorSize), RW: uint32(r.op) | r.flags, BiSize: uint32(len(r.p))}.Put(r.hdr[:])
}

// resubmit hands a request of the backlog, whose device is no longer mapped, to the
// waiting submit.
func (r *asyncReq) resubmit() {
	d, ctx, op, flags, off, p, done := r.d, r.ctx, r.op, r.flags, r.off, r.p, r.done
	r.d, r.ctx, r.p, r.done, r.unwatch = nil, nil, nil, nil, nil
	asyncPool.Put(r)
	d.asyncSlow(ctx, op, flags, off, p, done)
}

// dir is the transport direction of the request.
func (r *asyncReq) dir() transport.Dir {
	if r.op == OpRead {
		return transport.Read
	}
	return transport.Write
}

// fail ends a request the transport did not take (its callback will not run), off the
// transport's completion goroutine: the hooks run after it.
func (r *asyncReq) fail(err error) {
	c := r.d.sess.c
	r.end(err)
	c.runHooks()
}

// asyncFailed ends a request that failed: one the device can get back from (a session or
// id gone: a remap follows) goes on waiting and resending, the others fail.
func (d *Device) asyncFailed(ctx context.Context, op Op, flags uint32, off int64, p []byte, id uint32, done func(error), err error) {
	if serverClosed(err) {
		if d.closedByServer(id) {
			done(d.errClosedByServer())
			return
		}
		d.asyncSlow(ctx, op, flags, off, p, done) // remapped meanwhile: resend
		return
	}
	if retryable(err) && ctx.Err() == nil {
		d.markStale(id)
		d.asyncSlow(ctx, op, flags, off, p, done)
		return
	}
	done(err)
}

// asyncSlow finishes a request with submit on a goroutine of its own; outside the transport's
// completion goroutine, the hooks run after done there.
func (d *Device) asyncSlow(ctx context.Context, op Op, flags uint32, off int64, p []byte, done func(error)) {
	go func() {
		done(d.submit(ctx, op, flags, off, len(p), p))
		d.sess.c.runHooks()
	}()
}
