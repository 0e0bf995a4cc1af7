package hostile

import (
	"context"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/rnbd"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// TestUnmapHangs: the server never answers CLOSE (heartbeats and reconnects go on). With
// two paths (ReconnectDelay below ConnectTimeout, as with three paths at the defaults) an
// unmap with a 1 s deadline (rnbd.Client.Close at SIGTERM gives 30 s) never returned: the
// CLOSE went back and forth between the paths. Now it ends once two paths have failed it.
func TestUnmapHangs(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	geo := rnbd.MsgOpenRsp{DeviceID: 7, NSectors: 2048, MaxHWSectors: 128, LogicalBlockSize: 512, PhysicalBlockSize: 4096}
	h := rnbdHandler(geo, nil)
	s.onReq = func(r *req) {
		if typ, _ := rnbd.PeekType(r.usr); typ == rnbd.MsgTypeClose {
			return // never answered
		}
		h(r)
	}
	c := rnbd.NewClient(rnbd.ClientOptions{Session: transport.ClientOptions{Provider: soft.New(soft.Options{}), ConPerPath: 2,
		MaxReconnectAttempts: -1, Timings: fast()}, ReconnectTimeout: 2 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dev, err := c.Map(ctx, rnbd.MapOptions{SessName: "victim", Paths: []transport.PathAddrs{{Dst: dstN(t, 1)}, {Dst: dstN(t, 2)}},
		Port: s.port(), DevicePath: "vol", AccessMode: rnbd.AccessRW})
	if err != nil {
		t.Fatal(err)
	}
	uctx, ucancel := context.WithTimeout(context.Background(), time.Second)
	defer ucancel()
	ret := make(chan error, 1)
	go func() { ret <- dev.Unmap(uctx) }()
	select {
	case err := <-ret:
		t.Logf("Unmap returned %v", err)
	case <-time.After(25 * time.Second):
		t.Fatal("Unmap (1 s deadline, ConnectTimeout 2 s) still waiting after 25 s")
	}
	if st := dev.State(); st != rnbd.StateUnmapped {
		t.Fatalf("device %v after the unmap", st)
	}
	c.Close(ctx)
}
