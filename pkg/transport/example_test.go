package transport_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
	"github.com/rtrs-go/rtrs/pkg/transport"
)

// kvStore is a server handler that keeps values under the user header as key.
type kvStore struct {
	mu sync.Mutex
	m  map[string][]byte
}

func (s *kvStore) Request(r *transport.SrvRequest) {
	// Requests come on the receiving goroutine: answer later, from anywhere.
	go func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if r.Dir == transport.Write {
			s.m[string(r.Usr)] = append([]byte(nil), r.Data...)
		} else {
			copy(r.Data, s.m[string(r.Usr)])
		}
		r.Respond(0)
	}()
}

func (s *kvStore) LinkEvent(sess *transport.SrvSess, ev transport.LinkEvent) {}

// A server and a client session with one path over loopback: a WRITE, then a READ of what
// it wrote.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	prov := soft.New(soft.Options{})

	so := transport.DefaultServerOptions()
	so.Provider, so.Handler = prov, &kvStore{m: map[string][]byte{}}
	so.Addr = netip.MustParseAddrPort("127.0.0.1:0")
	so.QueueDepth = 16
	srv, err := transport.NewServer(so)
	if err != nil {
		panic(err)
	}
	defer srv.Close()

	src, dst, err := transport.ParsePathAddrs("ip:127.0.0.1@ip:127.0.0.1")
	if err != nil {
		panic(err)
	}
	sess, err := transport.Open(ctx, transport.ClientOptions{
		Provider: prov, SessName: "example", Port: srv.Addr().Port(),
		Paths: []transport.PathAddrs{{Src: src, Dst: dst}}, MaxReconnectAttempts: -1,
	})
	if err != nil {
		panic(err)
	}
	defer sess.Close()

	if err := sess.Do(ctx, transport.Write, []byte("greeting"), []byte("hello, rtrs")); err != nil {
		panic(err)
	}
	buf := make([]byte, len("hello, rtrs"))
	if err := sess.Do(ctx, transport.Read, []byte("greeting"), buf); err != nil {
		panic(err)
	}
	fmt.Println(string(buf), sess.QueueDepth(), sess.Paths()[0].Name())
	// Output: hello, rtrs 16 ip:127.0.0.1@ip:127.0.0.1
}
