package rnbd

import "sync"

// blockers runs the requests that may block (IO the page cache cannot take at once, FLUSH,
// DISCARD, WRITE_ZEROES, OPEN, CLOSE), each on a goroutine of its own, which holds a thread
// while it blocks: at most perKey at once for one key and total over all keys. The others
// wait, in order within a key, and the keys take the free places in turn. A key is the
// export a request is for, or its session for a request not tied to an open device: an
// export that stops answering holds at most perKey threads, the other exports keep theirs,
// and however many requests clients send, the daemon stays below Go's thread limit. What
// waits is bounded by the requests the transport admits (the sessions' chunks).
type blockers struct {
	perKey, total int

	mu      sync.Mutex
	running int
	keys    map[any]*blockQueue
	turns   []*blockQueue // keys below perKey with requests waiting, in the order they take turns
}

// blockQueue is one key's requests.
type blockQueue struct {
	key     any
	running int
	waiting []func()
	inTurns bool
}

// Per-key and overall bounds of requests that may block running at once; variables for the
// tests. 16 exports that all stop answering fill the overall bound.
var (
	maxBlockingPerKey = 128
	maxBlocking       = 2048
)

func newBlockers() *blockers {
	return &blockers{perKey: maxBlockingPerKey, total: maxBlocking, keys: map[any]*blockQueue{}}
}

// run runs fn once key and the whole have room, on a goroutine of its own.
func (b *blockers) run(key any, fn func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	q := b.keys[key]
	if q == nil {
		q = &blockQueue{key: key}
		b.keys[key] = q
	}
	q.waiting = append(q.waiting, fn)
	b.turnLocked(q)
	b.dispatchLocked()
}

// turnLocked queues q for a turn if it has requests waiting and room to run one.
func (b *blockers) turnLocked(q *blockQueue) {
	if !q.inTurns && len(q.waiting) > 0 && q.running < b.perKey {
		q.inTurns = true
		b.turns = append(b.turns, q)
	}
}

// dispatchLocked starts requests while there is room, a key at a time in turn.
func (b *blockers) dispatchLocked() {
	for b.running < b.total && len(b.turns) > 0 {
		q := b.turns[0]
		b.turns = b.turns[:copy(b.turns, b.turns[1:])]
		q.inTurns = false
		fn := q.waiting[0]
		q.waiting = q.waiting[:copy(q.waiting, q.waiting[1:])]
		q.running++
		b.running++
		b.turnLocked(q) // its next request comes after the other keys' waiting ones
		go b.work(q, fn)
	}
}

func (b *blockers) work(q *blockQueue, fn func()) {
	fn()
	b.mu.Lock()
	defer b.mu.Unlock()
	q.running--
	b.running--
	if q.running == 0 && len(q.waiting) == 0 {
		delete(b.keys, q.key)
	} else {
		b.turnLocked(q)
	}
	b.dispatchLocked()
}
