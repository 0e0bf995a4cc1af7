package transport

import (
	"testing"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// countingQP counts the receives posted to it and the posts.
type countingQP struct {
	rdma.QP
	posts, recvs int
}

func (q *countingQP) PostRecv(wrs []rdma.RecvWR) (int, error) {
	q.posts++
	q.recvs += len(wrs)
	for _, w := range wrs {
		if w.ID != wrRecv || len(w.SGList) != 0 {
			panic("a server IO receive with a buffer or another ID")
		}
	}
	return len(wrs), nil
}

// TestRepostEmptyKeepsQueueDepth: a server IO connection's receives, sized by ioRecvs and
// re-posted a batch at a time, never fall under the queue depth nor exceed the queue's
// capacity, and a batch is one post.
func TestRepostEmptyKeepsQueueDepth(t *testing.T) {
	for _, qd := range []int{1, 32, 512, 16380, 16384} {
		capacity, batch, initial := ioRecvs(qd)
		if qd < 16384 && batch < 2 {
			t.Errorf("qd %d: re-posted one at a time", qd)
		}
		q := &countingQP{}
		c := &con{qp: q, recvBatch: batch}
		for i := range c.emptyWRs {
			c.emptyWRs[i].ID = wrRecv
		}
		posted := initial
		uses := 10 * batch * 4
		for i := range uses {
			posted-- // a request's WRITE_WITH_IMM takes one
			before := q.recvs
			if err := c.repostEmpty(); err != nil {
				t.Fatal(err)
			}
			posted += q.recvs - before
			if posted < qd || posted > capacity {
				t.Fatalf("qd %d, request %d: %d receives posted, not within [%d, %d]", qd, i, posted, qd, capacity)
			}
		}
		if want := uses / batch; q.posts != want || q.recvs != uses {
			t.Fatalf("qd %d: %d posts of %d receives, want %d posts of %d", qd, q.posts, q.recvs, want, uses)
		}
	}
}
