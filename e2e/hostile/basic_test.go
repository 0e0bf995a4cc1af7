package hostile

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

func fast() transport.Timings {
	return transport.Timings{HeartbeatInterval: 50 * time.Millisecond, HeartbeatMissed: 3, ConnectTimeout: 2 * time.Second,
		ReconnectDelay: 100 * time.Millisecond, ReconnectBackoff: 10 * time.Millisecond, ZombieTimeout: 5 * time.Second}
}

func open(t *testing.T, s *server, conPerPath int, mod func(*transport.ClientOptions)) *transport.Session {
	t.Helper()
	o := transport.ClientOptions{Provider: soft.New(soft.Options{}), SessName: "victim", Port: s.port(),
		Paths: []transport.PathAddrs{{Dst: dst(t)}}, ConPerPath: conPerPath, MaxReconnectAttempts: -1, Timings: fast()}
	if mod != nil {
		mod(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sess, err := transport.Open(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess
}

// The harness works: a honest answer from the raw server.
func TestBaseline(t *testing.T) {
	s := newServer(t, 8, 64<<10)
	s.onReq = func(r *req) { r.answer(bytes.Repeat([]byte{0x5a}, 4096), 0) }
	sess := open(t, s, 2, nil)
	buf := make([]byte, 4096)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := sess.Do(ctx, transport.Read, []byte("hdr"), buf); err != nil {
		t.Fatal(err)
	}
	if buf[0] != 0x5a || buf[4095] != 0x5a {
		t.Fatalf("read %x", buf[:4])
	}
	if err := sess.Do(ctx, transport.Write, []byte("hdr"), buf); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // heartbeats go on
	if st := sess.Paths()[0].State(); st != transport.StateConnected {
		t.Fatalf("path %v", st)
	}
}
