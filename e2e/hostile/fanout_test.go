package hostile

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestDiscardFanOut: an OPEN_RSP with max_discard_sectors 1 (and 512-byte blocks), which
// Unmarshal keeps, and max_hw_sectors 1. A discard is split into 512-byte pieces, and a
// 16 MiB one is 32768 of them; they went out all at once, a goroutine each (an NBD TRIM of
// 4 GiB, as mkfs sends through /dev/nbdX, was 8 M goroutines), and so did an asynchronous
// read's 2048 pieces (a goroutine each while the device waits for a remap). Now a window of
// them at a time.
func TestDiscardFanOut(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	geo := rnbd.MsgOpenRsp{DeviceID: 7, NSectors: 1 << 33, MaxHWSectors: 1, MaxDiscardSectors: 1, MaxWriteZeroesSectors: 1,
		DiscardGranularity: 512, LogicalBlockSize: 512, PhysicalBlockSize: 512}
	release := make(chan struct{})
	s.onReq = rnbdHandler(geo, func(r *req, m rnbd.MsgIO) {
		go func() { <-release; r.answer(nil, 0) }() // answered later
	})
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: soft.New(soft.Options{}), ConPerPath: 2,
		MaxReconnectAttempts: -1, Timings: fast()}, ReconnectTimeout: 20 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	defer c.Close(ctx)
	dev, err := c.Map(ctx, rnbd.MapOptions{SessName: "victim", Paths: []transport.PathAddrs{{Dst: dst(t)}}, Port: s.port(), DevicePath: "vol", AccessMode: rnbd.AccessRW})
	if err != nil {
		t.Fatal(err)
	}
	g0 := runtime.NumGoroutine()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	go dev.Discard(ctx, 0, 16<<20)
	// And an asynchronous read of 2048 pieces (max_hw_sectors 1 below), as NBD and ublk send.
	read := make(chan error, 1)
	dev.ReadAsync(ctx, make([]byte, 1<<20), 0, func(err error) { read <- err })
	time.Sleep(2 * time.Second)
	g1 := runtime.NumGoroutine()
	runtime.ReadMemStats(&m1)
	close(release)
	select {
	case err := <-read:
		if err != nil {
			t.Errorf("the split asynchronous read: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Error("the split asynchronous read never completed")
	}
	t.Logf("goroutines %d -> %d, stacks %d -> %d MiB, Sys %d -> %d MiB for one 16 MiB discard",
		g0, g1, m0.StackInuse>>20, m1.StackInuse>>20, m0.Sys>>20, m1.Sys>>20)
	if g1-g0 > 1000 {
		t.Errorf("%d goroutines for one discard", g1-g0)
	}
}
