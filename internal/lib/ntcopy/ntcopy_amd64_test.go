package ntcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkNonTemporal: copies of 4 KiB and 128 KiB from a hot buffer into a 256 MiB tmpfs
// file's mapping, at random places (cold, as the server writes into a memory-backed export) or
// into one place again and again (hot: a destination still in the cache), by the built-in copy
// and by the non-temporal stores (copyNT, whatever Min says).
func BenchmarkNonTemporal(b *testing.B) {
	const region = 256 << 20
	_, m := mapFile(b, "/dev/shm", region)
	if err := unix.Madvise(m, unix.MADV_POPULATE_WRITE); err != nil {
		b.Skipf("populating 256 MiB of /dev/shm: %v", err)
	}
	for _, size := range []int{4 << 10, 128 << 10} {
		src := bytes.Repeat([]byte{0xa5}, size)
		for _, v := range []struct {
			name string
			copy func(dst, src []byte)
		}{{"builtin", func(d, s []byte) { copy(d, s) }}, {"nontemporal", copyNT}} {
			for _, hot := range []bool{false, true} {
				b.Run(fmt.Sprintf("%dKiB/%s/hot=%v", size>>10, v.name, hot), func(b *testing.B) {
					rng := rand.New(rand.NewPCG(3, 4))
					b.SetBytes(int64(size))
					for b.Loop() {
						off := 0
						if !hot {
							off = rng.IntN(region/size) * size
						}
						v.copy(m[off:off+size], src)
					}
				})
			}
		}
	}
}
