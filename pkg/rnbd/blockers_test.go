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

// state reports how many requests run and wait in group, and how many run in all.
func (b *blockers) state(group any) (running, waiting, all int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if g := b.groups[group]; g != nil {
		running, waiting = g.running, g.waiting
	}
	return running, waiting, b.running
}

// TestBlockersTurns: at most a group's limit of its requests and total over all run at once;
// a group that had to wait gets the next free place before one that has run already, and
// within a group the members take turns, each one's requests in order.
func TestBlockersTurns(t *testing.T) {
	leakcheck.Check(t)
	b := &blockers{total: 3, groups: map[any]*blockGroup{}}
	release := map[string]chan struct{}{}
	order := make(chan string, 16)
	start := func(group, member, name string, limit int) {
		rel := make(chan struct{})
		release[name] = rel
		b.run(group, member, limit, true, func() { order <- name; <-rel })
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
		start("a", "x", n, 2)
	}
	start("a", "y", "ay1", 2)
	started("a1", "a2")
	idle() // a's two places are taken
	start("b", "x", "b1", 2)
	started("b1")
	start("c", "x", "c1", 2)
	idle() // the three places are taken
	if r, w, all := b.state("a"); r != 2 || w != 3 || all != 3 {
		t.Fatalf("a: %d running, %d waiting, %d in all; want 2, 3, 3", r, w, all)
	}
	close(release["a1"])
	started("c1") // c waited for a place before a's next one
	idle()
	close(release["b1"])
	started("a3") // x came first in a, its requests in order
	close(release["c1"])
	idle() // a has its two, and no other group waits
	close(release["a2"])
	started("ay1") // y's turn in a before x's next one
	close(release["a3"])
	started("a4")
	close(release["ay1"])
	close(release["a4"])
	testutil.WaitFor(t, 5*time.Second, "every group idle and forgotten", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.running == 0 && len(b.groups) == 0 && b.turns.len() == 0
	})
}

// TestFifo: in order, across the compactions.
func TestFifo(t *testing.T) {
	var f fifo[int]
	next, want := 0, 0
	for round := range 50 {
		for range round % 7 * 10 {
			f.push(next)
			next++
		}
		for range min(f.len(), round%5*9) {
			if v := f.pop(); v != want {
				t.Fatalf("popped %d, want %d", v, want)
			}
			want++
		}
		if f.len() != next-want || len(f.items) > 2*f.len()+64 {
			t.Fatalf("round %d: len %d with %d items held, want %d", round, f.len(), len(f.items), next-want)
		}
	}
}

// TestBlockingBoundedPerExport: reads the page cache cannot serve, to an export whose file
// has stopped answering, take at most maxBlockingPerKey threads at the file, the others
// wait their turn; another export's reads still run, and once the file answers again every
// read is answered with its data.
func TestBlockingBoundedPerExport(t *testing.T) {
	leakcheck.Check(t)
	oldExport, oldAll := maxBlockingPerExport, maxBlocking
	maxBlockingPerExport, maxBlocking = 2, 3
	t.Cleanup(func() { maxBlockingPerExport, maxBlocking = oldExport, oldAll })
	f, mnt := gatedMount(t)
	for i := range 5 {
		copy(f.Data[i<<20:], bytes.Repeat([]byte{byte(i + 1)}, 4096))
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(mnt, "disk"), &st); err != nil {
		t.Fatal(err)
	}
	key := devKey{dev: st.Dev, ino: st.Ino}
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
	testutil.WaitFor(t, 5*time.Second, "nothing running or waiting after the reads", func() bool {
		r, w, all := rs.blk.state(key)
		return r+w+all == 0
	})
}

// TestStuckOpenHoldsNoIOPlace: an OPEN held by a device that stopped answering (its probe
// read) takes a place of its session's control requests only, not one of the overall bound
// that other exports' IO needs: another session's FLUSH runs meanwhile with that bound at
// one.
func TestStuckOpenHoldsNoIOPlace(t *testing.T) {
	leakcheck.Check(t)
	oldExport, oldAll := maxBlockingPerExport, maxBlocking
	maxBlockingPerExport, maxBlocking = 1, 1
	t.Cleanup(func() { maxBlockingPerExport, maxBlocking = oldExport, oldAll })
	// The OPEN must stay held through the test's wait for the FLUSH.
	withProbeTimeout(t, time.Minute)
	f, name, e := gatedEnv(t, dioDrainTimeout)
	other, _, _ := loopExport(t)
	c := e.client(t, 5*time.Second)
	db := mustMap(t, e, c, "b", other, AccessRW)
	f.shut()
	defer f.open()
	opened := make(chan error, 1)
	go func() {
		_, err := e.mapDev(t, c, "a", name, AccessRO)
		opened <- err
	}()
	testutil.WaitFor(t, 5*time.Second, "the OPEN's probe held at the device", func() bool { return f.waiting.Load() > 0 })
	flushed := make(chan error, 1)
	go func() { flushed <- db.Flush(context.Background()) }()
	select {
	case err := <-flushed:
		if err != nil {
			t.Fatalf("another export's FLUSH while an OPEN is held: %v", err)
		}
	case <-time.After(10 * time.Second):
		f.open()
		<-flushed
		<-opened
		t.Fatal("another export's FLUSH waited for the held OPEN")
	}
	f.open()
	if err := <-opened; err != nil {
		t.Fatalf("the held OPEN, once the device answered: %v", err)
	}
}
