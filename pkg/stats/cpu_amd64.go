package stats

import "runtime"

func rdpid() uint32
func cpuid(leaf, sub uint32) (eax, ecx uint32)

// fastCPU reads the CPU number with RDPID (a few cycles, where getcpu is a system call) when
// the processor has it and the kernel keeps the CPU number where RDPID reads it, which is
// checked once against getcpu.
var fastCPU = func() bool {
	if max, _ := cpuid(0, 0); max < 7 {
		return false
	}
	if _, ecx := cpuid(7, 0); ecx&(1<<22) == 0 {
		return false
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for range 3 {
		if int(rdpid()&0xfff) != getcpu() {
			return false
		}
	}
	return true
}()

// CPU returns the CPU the calling thread runs on.
func CPU() int {
	if fastCPU {
		return int(rdpid() & 0xfff)
	}
	return getcpu()
}

// cheapCPU returns the CPU number if reading it costs no system call.
func cheapCPU() (int, bool) {
	if fastCPU {
		return int(rdpid() & 0xfff), true
	}
	return 0, false
}
