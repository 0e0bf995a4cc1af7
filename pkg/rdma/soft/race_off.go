//go:build !race

package soft

import (
	"net"
	"unsafe"
)

func raceAddrOf(net.Conn) unsafe.Pointer { return nil }
func raceRelease(unsafe.Pointer)         {}
func raceAcquire(unsafe.Pointer)         {}
