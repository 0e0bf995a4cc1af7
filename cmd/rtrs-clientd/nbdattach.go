package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/nbd"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
)

// nbdAttacher attaches mapped devices to the kernel's /dev/nbdX (map_device's nbd= token,
// -nbd-attach its default) through the NBD server's Attach: the control.Attacher of the
// daemon.
type nbdAttacher struct {
	srv     *nbd.Server
	def     control.Attach // AttachNone or AttachAuto
	conns   int
	timeout time.Duration
	export  func(*rnbd.Device) nbd.Export
	lg      *log.Entry

	mu     sync.Mutex
	closed bool
	devs   map[*rnbd.Device]*nbd.Attachment
	tokens map[*rnbd.Device]control.Attach // nbd= as written in map_device, for write-back
	seq    int
	wg     sync.WaitGroup // watchers
}

// backendPrefix starts the backend name of every attachment: "rtrs-clientd[<pid>] ".
const backendPrefix = "rtrs-clientd["

func parseNBDDefault(v string) (control.Attach, error) {
	switch v {
	case "none", "":
		return control.AttachNone, nil
	case "auto":
		return control.AttachAuto, nil
	}
	return control.AttachNone, fmt.Errorf("-nbd-attach %q: none or auto", v)
}

func (n *nbdAttacher) Attach(ctx context.Context, d *rnbd.Device, at control.Attach) error {
	tok := at
	if at == control.AttachDefault {
		at = n.def
	}
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return fmt.Errorf("rtrs-clientd is stopping: %w", syscall.ESHUTDOWN)
	}
	if tok != control.AttachDefault {
		n.tokens[d] = tok
	}
	n.seq++
	seq := n.seq
	n.mu.Unlock()
	if at == control.AttachNone {
		return nil
	}
	name := d.Session() + "/" + control.DeviceFileName(d.Path())
	idx := -1
	if at >= 0 {
		idx = int(at)
	}
	a, err := n.srv.Attach(ctx, n.export(d), nbd.AttachOptions{Index: idx, Conns: n.conns, Timeout: n.timeout,
		Backend: fmt.Sprintf("%s%d] %s #%d", backendPrefix, os.Getpid(), name, seq)})
	if err != nil {
		n.mu.Lock()
		delete(n.tokens, d)
		n.mu.Unlock()
		return err
	}
	// As for ublk: an unmap that began meanwhile found nothing to detach (under n.mu, which
	// its Detach takes after BeginUnmap).
	n.mu.Lock()
	if n.closed || d.Unmapping() {
		n.mu.Unlock()
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = a.Detach(dctx)
		return fmt.Errorf("%s was unmapped while it was attached: %w", name, syscall.ENODEV)
	}
	n.devs[d] = a
	n.wg.Add(1)
	n.mu.Unlock()
	go n.watch(d, a)
	n.lg.Infof("%s attached to %s (%d connections)", name, a.Device(), a.Conns())
	return nil
}

// watch cleans up after an attachment whose connections the kernel dropped without our
// Detach (requests timed out on every connection, or a disconnect from outside).
func (n *nbdAttacher) watch(d *rnbd.Device, a *nbd.Attachment) {
	defer n.wg.Done()
	<-a.Done()
	n.mu.Lock()
	lost := n.devs[d] == a
	if lost {
		delete(n.devs, d)
	}
	n.mu.Unlock()
	if !lost {
		return
	}
	n.lg.Warnf("%s/%s: the kernel dropped every connection of %s; detached", d.Session(), control.DeviceFileName(d.Path()), a.Device())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Detach(ctx); err != nil {
		n.lg.WithError(err).Warnf("detaching %s", a.Device())
	}
}

func (n *nbdAttacher) Busy(d *rnbd.Device) error {
	n.mu.Lock()
	a := n.devs[d]
	n.mu.Unlock()
	if a != nil && a.Busy() {
		return fmt.Errorf("%s is in use (mounted?): %w", a.Device(), syscall.EBUSY)
	}
	return nil
}

func (n *nbdAttacher) Detach(ctx context.Context, d *rnbd.Device, force bool) error {
	if err := n.Busy(d); err != nil && !force {
		return err
	}
	n.mu.Lock()
	a := n.devs[d]
	delete(n.devs, d)
	delete(n.tokens, d)
	n.mu.Unlock()
	if a == nil {
		return nil
	}
	if err := a.Detach(ctx); err != nil {
		// Its connections are closed all the same: the device is no longer served.
		n.lg.WithError(err).Warnf("detaching %s", a.Device())
	} else {
		n.lg.Infof("%s detached", a.Device())
	}
	return nil
}

func (n *nbdAttacher) Attached(d *rnbd.Device) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if a := n.devs[d]; a != nil {
		return a.Device()
	}
	return ""
}

// Resize tells d's /dev/nbdX, if it has one, its new size.
func (n *nbdAttacher) Resize(ctx context.Context, d *rnbd.Device, size int64) error {
	n.mu.Lock()
	a := n.devs[d]
	n.mu.Unlock()
	if a == nil {
		return nil
	}
	if err := a.Resize(ctx, size); err != nil {
		return err
	}
	n.lg.Infof("%s resized to %d bytes", a.Device(), size)
	return nil
}

// Token is nbd= as map_device gave it for d (AttachDefault when it gave none).
func (n *nbdAttacher) Token(d *rnbd.Device) control.Attach {
	n.mu.Lock()
	defer n.mu.Unlock()
	if t, ok := n.tokens[d]; ok {
		return t
	}
	return control.AttachDefault
}

// inUse lists the attached devices something holds (a mounted file system).
func (n *nbdAttacher) inUse() []string {
	n.mu.Lock()
	var all []*nbd.Attachment
	for _, a := range n.devs {
		all = append(all, a)
	}
	n.mu.Unlock()
	var out []string
	for _, a := range all {
		if a.Busy() {
			out = append(out, a.Device())
		}
	}
	return out
}

func (n *nbdAttacher) count() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.devs)
}

// detachAll detaches every device, in use or not (the daemon stops), and refuses further
// attaches.
func (n *nbdAttacher) detachAll() {
	n.mu.Lock()
	n.closed = true
	all := n.devs
	n.devs = map[*rnbd.Device]*nbd.Attachment{}
	n.mu.Unlock()
	var wg sync.WaitGroup
	for _, a := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := a.Detach(ctx); err != nil {
				n.lg.WithError(err).Warnf("detaching %s", a.Device())
			} else {
				n.lg.Infof("%s detached", a.Device())
			}
		}()
	}
	wg.Wait()
	n.wg.Wait()
}

// staleBackend says whether an NBD device's backend name is one of an rtrs-clientd whose
// process is gone (a process that took its pid since keeps the device: only gone is sure).
func staleBackend(b string) bool {
	rest, ok := strings.CutPrefix(b, backendPrefix)
	if !ok {
		return false
	}
	pid, _, ok := strings.Cut(rest, "]")
	p, err := strconv.Atoi(pid)
	if !ok || err != nil || p <= 0 || p == os.Getpid() {
		return false
	}
	_, err = os.Stat("/proc/" + strconv.Itoa(p))
	return errors.Is(err, fs.ErrNotExist)
}

// disconnectStale detaches the NBD devices a crashed rtrs-clientd left connected.
func disconnectStale(lg *log.Entry) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	idx, err := nbd.DisconnectStale(ctx, staleBackend)
	for _, i := range idx {
		lg.Infof("disconnected /dev/nbd%d, left attached by an rtrs-clientd that is gone", i)
	}
	if err != nil {
		lg.WithError(err).Warn("stale NBD devices")
	}
}
