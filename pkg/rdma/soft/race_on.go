//go:build race

package soft

import (
	"net"
	"runtime"
	"sync"
	"unsafe"
)

// Under the race detector, a frame's send is a release and its receipt an acquire on a sync
// object both ends of the connection share, so the detector sees the causality the network
// carries: memory a peer accessed before posting a request is ordered before what the
// responder does on receiving it. Without this, one-sided writes into the same memory over
// different connections, ordered only through the peer, would look concurrent. Both ends
// share the object only when they are in one process (tests); the cost stays out of normal
// builds.
var raceConns sync.Map // connection key -> *uint64

func raceAddrOf(c net.Conn) unsafe.Pointer {
	a, b := c.LocalAddr().String(), c.RemoteAddr().String()
	if a > b {
		a, b = b, a
	}
	v, _ := raceConns.LoadOrStore(a+"|"+b, new(uint64))
	return unsafe.Pointer(v.(*uint64))
}

func raceRelease(addr unsafe.Pointer) {
	if addr != nil {
		runtime.RaceReleaseMerge(addr)
	}
}

func raceAcquire(addr unsafe.Pointer) {
	if addr != nil {
		runtime.RaceAcquire(addr)
	}
}
