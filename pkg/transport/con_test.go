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

// TestRepostEmptyKeepsQueueDepth: a server IO connection's receives, re-posted a batch at a
// time, never fall under the queue depth, and a batch is one post.
func TestRepostEmptyKeepsQueueDepth(t *testing.T) {
	const qd = 32
	for _, batch := range []int{1, 2, serverRecvBatch} {
		q := &countingQP{}
		c := &con{qp: q, recvBatch: batch}
		c.recvWR[0].ID = wrRecv
		posted := qd + batch - 1 // what addCon posts
		for i := range 10 * qd {
			posted-- // a request's WRITE_WITH_IMM takes one
			before := q.recvs
			if err := c.repostEmpty(); err != nil {
				t.Fatal(err)
			}
			posted += q.recvs - before
			if posted < qd {
				t.Fatalf("batch %d, request %d: %d receives posted, under the queue depth %d", batch, i, posted, qd)
			}
		}
		if want := 10 * qd / batch; q.posts != want || q.recvs != 10*qd {
			t.Fatalf("batch %d: %d posts of %d receives, want %d posts of %d", batch, q.posts, q.recvs, want, 10*qd)
		}
	}
}
