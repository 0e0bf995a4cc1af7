package rnbd

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rtrs-go/rtrs/internal/lib/leakcheck"
	"github.com/rtrs-go/rtrs/internal/lib/testutil"
	"github.com/rtrs-go/rtrs/pkg/rdma/soft"
)

// state reports how many requests run and wait under key, and how many run in all.
func (b *blockers) state(key any) (running, waiting, all int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if q := b.keys[key]; q != nil {
		running, waiting = q.running, len(q.waiting)
	}
	return running, waiting, b.running
}

// TestBlockersTurns: at most perKey requests of a key and total over all run at once, the
// rest in order within their key, and a key that had to wait gets the next free place
// before one that has run already.
func TestBlockersTurns(t *testing.T) {
	leakcheck.Check(t)
	b := &blockers{perKey: 2, total: 3, keys: map[any]*blockQueue{}}
	release := map[string]chan struct{}{}
	order := make(chan string, 16)
	start := func(key, name string) {
		rel := make(chan struct{})
		release[name] = rel
		b.run(key, func() { order <- name; <-rel })
	}
	// started waits for the requests named to start, in any order among them.
	started := func(want ...string) {
		t.Helper()
		left := map[string]bool{}
		for _, w := range want {
			left[w] = true
		}
		for range want {
			select {
			case got := <-order:
				if !left[got] {
					t.Fatalf("%s started, want %v", got, want)
				}
				delete(left, got)
			case <-time.After(5 * time.Second):
				t.Fatalf("%v did not start", want)
			}
		}
	}
	idle := func() {
		t.Helper()
		select {
		case got := <-order:
			t.Fatalf("%s started, with no room for it", got)
		case <-time.After(50 * time.Millisecond):
		}
	}
	for _, n := range []string{"a1", "a2", "a3", "a4"} {
		start("a", n)
	}
	started("a1", "a2")
	idle() // a's two places are taken
	start("b", "b1")
	started("b1")
	start("c", "c1")
	idle() // the three places are taken
	if r, w, all := b.state("a"); r != 2 || w != 2 || all != 3 {
		t.Fatalf("a: %d running, %d waiting, %d in all; want 2, 2, 3", r, w, all)
	}
	close(release["a1"])
	started("c1") // c waited for a place before a's next one
	idle()
	close(release["b1"])
	started("a3") // in order within a
	close(release["c1"])
	idle() // a has its two, and no other key waits
	close(release["a2"])
	started("a4")
	close(release["a3"])
	close(release["a4"])
	testutil.WaitFor(t, 5*time.Second, "every key idle and forgotten", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.running == 0 && len(b.keys) == 0 && len(b.turns) == 0
	})
}

// TestBlockingBoundedPerExport: reads the page cache cannot serve, to an export whose file
// has stopped answering, take at most maxBlockingPerKey threads at the file, the others
// wait their turn; another export's reads still run, and once the file answers again every
// read is answered with its data.
func TestBlockingBoundedPerExport(t *testing.T) {
	leakcheck.Check(t)
	oldKey, oldAll := maxBlockingPerKey, maxBlocking
	maxBlockingPerKey, maxBlocking = 2, 3
	t.Cleanup(func() { maxBlockingPerKey, maxBlocking = oldKey, oldAll })
	f, mnt := gatedMount(t)
	for i := range 5 {
		copy(f.Data[i<<20:], bytes.Repeat([]byte{byte(i + 1)}, 4096))
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(mnt, "disk"), &st); err != nil {
		t.Fatal(err)
	}
	key := devKey{st.Dev, st.Ino}
	e := &testEnv{prov: soft.New(soft.Options{}), dir: mnt}
	e.start(t, 0)
	t.Cleanup(e.stop)
	t.Cleanup(f.open)
	c := e.client(t, 5*time.Second)
	da := mustMap(t, e, c, "a", "disk", AccessRO)
	db := mustMap(t, e, c, "b", "plain", AccessRO)
	rs := e.server()

	f.shut()
	defer f.open()
	bufs := make([][]byte, 5)
	done := make(chan error, len(bufs))
	for i := range bufs {
		bufs[i] = make([]byte, 4096)
		da.ReadAsync(context.Background(), bufs[i], int64(i)<<20, func(err error) { done <- err })
	}
	testutil.WaitFor(t, 10*time.Second, "two reads at the file, three waiting", func() bool {
		r, w, _ := rs.blk.state(key)
		return r == 2 && w == 3
	})
	// Give the waiting ones time to reach the file if nothing held them back.
	time.Sleep(100 * time.Millisecond)
	if n := f.waiting.Load(); n > 2 {
		t.Fatalf("%d reads held at the file, want at most 2", n)
	}
	p := make([]byte, 4096)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := db.ReadAtContext(ctx, p, 4096); err != nil {
		t.Fatalf("a read of the other export while the first is stuck: %v", err)
	}
	f.open()
	for range bufs {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("read: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a read was not answered once the file answered")
		}
	}
	for i, b := range bufs {
		if !bytes.Equal(b, bytes.Repeat([]byte{byte(i + 1)}, 4096)) {
			t.Fatalf("read %d: wrong data", i)
		}
	}
	if r, w, all := rs.blk.state(key); r+w+all != 0 {
		t.Fatalf("after the reads: %d running, %d waiting, %d in all", r, w, all)
	}
}
