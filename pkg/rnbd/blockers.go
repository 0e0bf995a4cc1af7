package rnbd

import "sync"

// blockers runs the requests that may block (IO the page cache cannot take at once, FLUSH,
// DISCARD, WRITE_ZEROES, OPEN, CLOSE), each on a goroutine of its own, which holds a thread
// while it blocks in a system call. Requests come in groups, each with a limit of requests
// running at once; the others wait. Within a group the members (sessions) take turns, a
// member's requests in order. IO is grouped by export, so that an export that stops
// answering holds its limit of threads and no more, and one session cannot keep another's
// FLUSH behind all its reads; these groups are counted against total, and take its free
// places in turn. A session's OPEN, CLOSE and SESS_INFO are a group of their own with a limit
// of one, run in order as the kernel's server runs them under the session's lock, and not
// counted: sessions are bounded (the transport's limits), so they add at most one thread
// each, and an OPEN held by a device that stopped answering never takes a place another
// export's IO needs. However many requests clients send, the daemon stays below Go's thread
// limit; what waits is bounded by the requests the transport admits (the sessions' chunks).
type blockers struct {
	total int

	mu      sync.Mutex
	running int // of the counted groups
	groups  map[any]*blockGroup
	turns   fifo[*blockGroup] // counted groups below their limit with requests waiting, in turn
}

// blockGroup is one group's requests.
type blockGroup struct {
	key            any
	limit, running int
	counted        bool
	waiting        int // over all members
	members        map[any]*blockMember
	turns          fifo[*blockMember] // members with requests waiting, in turn
	inTurns        bool
}

// blockMember is one member's waiting requests in a group.
type blockMember struct {
	key     any
	waiting fifo[func()]
}

// Per-export and overall bounds of IO that may block running at once; variables for the
// tests. 16 exports that all stop answering fill the overall bound.
var (
	maxBlockingPerExport = 128
	maxBlocking          = 2048
)

func newBlockers() *blockers {
	return &blockers{total: maxBlocking, groups: map[any]*blockGroup{}}
}

// run runs fn, for member of group, on a goroutine of its own once the group (at most limit
// at once) and, for a counted group, the whole have room.
func (b *blockers) run(group, member any, limit int, counted bool, fn func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := b.groups[group]
	if g == nil {
		g = &blockGroup{key: group, limit: limit, counted: counted, members: map[any]*blockMember{}}
		b.groups[group] = g
	}
	m := g.members[member]
	if m == nil {
		m = &blockMember{key: member}
		g.members[member] = m
		g.turns.push(m)
	}
	m.waiting.push(fn)
	g.waiting++
	b.turnLocked(g)
	b.dispatchLocked()
}

// turnLocked starts g's waiting requests while it has room, if it is not counted, or else
// queues it for a turn.
func (b *blockers) turnLocked(g *blockGroup) {
	if !g.counted {
		for g.waiting > 0 && g.running < g.limit {
			b.startLocked(g)
		}
		return
	}
	if !g.inTurns && g.waiting > 0 && g.running < g.limit {
		g.inTurns = true
		b.turns.push(g)
	}
}

// dispatchLocked starts requests of counted groups while there is room, a group at a time
// in turn.
func (b *blockers) dispatchLocked() {
	for b.running < b.total && b.turns.len() > 0 {
		g := b.turns.pop()
		g.inTurns = false
		b.startLocked(g)
		b.turnLocked(g) // the group's next request after the other groups' waiting ones
	}
}

// startLocked starts the request of g whose turn it is.
func (b *blockers) startLocked(g *blockGroup) {
	m := g.turns.pop()
	fn := m.waiting.pop()
	if m.waiting.len() > 0 {
		g.turns.push(m) // its next request after the other members' waiting ones
	} else {
		delete(g.members, m.key)
	}
	g.waiting--
	g.running++
	if g.counted {
		b.running++
	}
	go b.work(g, fn)
}

func (b *blockers) work(g *blockGroup, fn func()) {
	fn()
	b.mu.Lock()
	defer b.mu.Unlock()
	g.running--
	if g.counted {
		b.running--
	}
	if g.running == 0 && g.waiting == 0 {
		delete(b.groups, g.key)
	} else {
		b.turnLocked(g)
	}
	b.dispatchLocked()
}

// fifo is a queue whose pops cost O(1) amortized: a head index into a slice, which is
// compacted once the head has passed half of it.
type fifo[T any] struct {
	items []T
	head  int
}

func (f *fifo[T]) len() int { return len(f.items) - f.head }

func (f *fifo[T]) push(v T) { f.items = append(f.items, v) }

// pop takes the first item; the queue must not be empty.
func (f *fifo[T]) pop() T {
	var zero T
	v := f.items[f.head]
	f.items[f.head] = zero
	f.head++
	switch {
	case f.head == len(f.items):
		f.items, f.head = f.items[:0], 0
	case f.head > 32 && 2*f.head > len(f.items):
		n := copy(f.items, f.items[f.head:])
		clear(f.items[n:])
		f.items, f.head = f.items[:n], 0
	}
	return v
}
