//go:build race

package soft

import (
	"net"
	"runtime"
	"unsafe"
)

// Under the race detector, a frame's send is a release and its receipt an acquire, so the
// detector sees the causality the network carries: memory a peer accessed before posting a
// request is ordered before what the responder does on receiving it. The order can run
// through another process and another connection (a response on one path, the next request
// on another, both into the same chunk), which no per-connection object would show, so there
// is one object for the whole process: every send is ordered before every later receipt.
// The cost stays out of normal builds.
var raceSync uint64

func raceAddrOf(net.Conn) unsafe.Pointer { return unsafe.Pointer(&raceSync) }

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
