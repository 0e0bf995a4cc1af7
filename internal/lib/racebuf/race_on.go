//go:build race

package racebuf

import (
	"runtime"
	"unsafe"
)

// Written tells the race detector that p was written, as by the goroutine that made the
// raw system call that filled it.
func Written(p []byte) {
	if len(p) > 0 {
		runtime.RaceWriteRange(unsafe.Pointer(&p[0]), len(p))
	}
}

// Read tells the race detector that p was read by the calling goroutine.
func Read(p []byte) {
	if len(p) > 0 {
		runtime.RaceReadRange(unsafe.Pointer(&p[0]), len(p))
	}
}
