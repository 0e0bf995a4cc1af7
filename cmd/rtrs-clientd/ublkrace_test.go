package main

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/membudget"
	"github.com/rtrs-go/rtrs/pkg/control"
	"github.com/rtrs-go/rtrs/pkg/log"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
	"github.com/rtrs-go/rtrs/pkg/ublk"
)

// mappedDevice maps a 16 MiB file over one loopback path of the soft provider, server and
// client in this process.
func mappedDevice(t *testing.T) *rnbd.Device {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "disk"), make([]byte, 16<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	prov := soft.New(soft.Options{})
	rs, err := rnbd.NewServer(rnbd.ServerOptions{SearchPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	so := transport.DefaultServerOptions()
	so.Provider, so.Handler = prov, rs
	so.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	srv, err := transport.NewServer(so)
	if err != nil {
		rs.Close()
		t.Fatal(err)
	}
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: prov, MaxReconnectAttempts: -1}})
	t.Cleanup(func() {
		c.Close(context.Background())
		_ = srv.Close()
		rs.Close()
	})
	src, dst, err := transport.ParsePathAddrs("ip:127.0.0.1@ip:127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := c.Map(ctx, rnbd.MapOptions{SessName: "race", Paths: []transport.PathAddrs{{Src: src, Dst: dst}},
		Port: srv.Addr().Port(), DevicePath: "disk", AccessMode: rnbd.AccessRW})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestUblkUnmapDuringAttach: an unmap that begins while ublk=auto is starting the device
// finds no ublk device to detach; the attach, once its device has started, sees the unmap,
// stops the device and fails with ENODEV, leaving no /dev/ublkbN behind and none listed.
// (Without ublk_drv, on the host, it skips; the VM suite runs it on 6.12 and 7.2 and fails
// on a skip.)
func TestUblkUnmapDuringAttach(t *testing.T) {
	leakcheck.Check(t)
	ctl, err := ublk.OpenCtrl()
	if errors.Is(err, ublk.ErrNoDriver) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	d := mappedDevice(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	u := &ublkAttacher{def: control.AttachNone, queues: "1", depth: 16, ctx: ctx, lg: log.L,
		paths: func(*rnbd.Device) int { return 1 }, regMem: membudget.New(0),
		devs: map[*rnbd.Device]*ublk.Device{}, failIO: map[*rnbd.Device]context.CancelFunc{},
		tokens: map[*rnbd.Device]control.Attach{}, pending: map[int]bool{}, stopping: map[*ublk.Device]bool{}}
	defer u.detachAll()
	atStart, goOn := make(chan *ublk.Device, 1), make(chan struct{})
	u.started = func(dev *ublk.Device) {
		atStart <- dev
		<-goOn
	}
	attached := make(chan error, 1)
	go func() { attached <- u.Attach(ctx, d, control.AttachAuto) }()
	var dev *ublk.Device
	select {
	case dev = <-atStart:
	case err := <-attached:
		t.Fatalf("the attach ended (%v) before its device started", err)
	case <-time.After(60 * time.Second):
		close(goOn)
		t.Fatalf("no ublk device started in 60 s")
	}
	// The unmap's first steps, as control.Client.Unmap takes them: begun, then the ublk
	// front end's detach, which finds no device yet.
	abort, err := d.BeginUnmap(false)
	if err != nil {
		close(goOn)
		t.Fatal(err)
	}
	detached := u.Detach(ctx, d, false)
	close(goOn)
	err = <-attached
	if detached != nil {
		t.Errorf("the unmap's detach during the attach: %v", detached)
	}
	if !errors.Is(err, syscall.ENODEV) {
		t.Errorf("the attach after an unmap began: %v, want ENODEV", err)
	}
	if got := u.Attached(d); got != "" || u.count() != 0 {
		t.Errorf("after the attach: %q attached, %d listed; want none", got, u.count())
	}
	for t0 := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		_, err := ctl.DevInfo(uint32(dev.ID()))
		if errors.Is(err, syscall.ENODEV) {
			break
		}
		if time.Since(t0) > 10*time.Second {
			t.Fatalf("%s still there 10 s after the attach failed: %v", dev.BlockPath(), err)
		}
	}
	uctx, ucancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ucancel()
	if err := d.Unmap(uctx); err != nil {
		abort()
		t.Errorf("unmapping: %v", err)
	}
}
