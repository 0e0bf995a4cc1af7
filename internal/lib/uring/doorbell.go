package uring

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Doorbell lets other goroutines wake a loop that waits in its ring: an eventfd whose read
// sits in the ring, so the one wait covers both the ring's completions and the bell. Ring
// writes the eventfd only when the loop said it would sleep, so a busy loop costs the
// ringers nothing but an atomic swap.
//
// The loop's side, not safe for concurrent use: Arm once, then in every round Sleep before
// the last look for work (Awake if it found some after all), wait, Awake, and Arm again
// when the read's completion (its user data) comes back.
type Doorbell struct {
	// mu keeps Close from closing the eventfd under a Wake: a write to a number closed and
	// taken again by another file would land in that file.
	mu       sync.RWMutex
	efd      int
	buf      [8]byte // the read's target: only the kernel writes it
	sleeping atomic.Bool
}

// NewDoorbell makes a doorbell; Close releases it once its loop has ended.
func NewDoorbell() (*Doorbell, error) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	return &Doorbell{efd: efd}, nil
}

// Close closes the eventfd; a Wake after it does nothing.
func (d *Doorbell) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.efd >= 0 {
		unix.Close(d.efd)
		d.efd = -1
	}
}

// Arm queues the eventfd's read on r, its completion carrying userData; r must have a free
// entry.
func (d *Doorbell) Arm(r *Ring, userData uint64) {
	s := r.GetSQE()
	s.Opcode, s.Fd, s.Addr, s.Len, s.UserData = OpRead, int32(d.efd), uint64(uintptr(unsafe.Pointer(&d.buf[0]))), 8, userData
}

// Sleep says the loop is about to wait. It must look for work once more after it: a
// ringer that queued work before this is seen by that look, one after it rings.
func (d *Doorbell) Sleep() { d.sleeping.Store(true) }

// Awake says the loop is not waiting (any more).
func (d *Doorbell) Awake() { d.sleeping.Store(false) }

// Ring wakes the loop if it sleeps or is about to; called after queueing its work, from
// any goroutine.
func (d *Doorbell) Ring() {
	if d.sleeping.Swap(false) {
		d.Wake()
	}
}

// Wake wakes the loop whether it sleeps or not: its next wait, at the latest, ends at once.
// For what the loop checks only at the top of a round, such as a quit flag.
func (d *Doorbell) Wake() {
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	d.mu.RLock()
	if d.efd >= 0 {
		_, _ = unix.Write(d.efd, one[:])
	}
	d.mu.RUnlock()
}
