package transport

import (
	"sync/atomic"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// Work request ids: kind in the top byte, an index below.
const (
	wrRecv     = 1 << 56
	wrInfo     = 2 << 56
	wrLocalInv = 3 << 56
	wrResp     = 4 << 56
	wrHB       = 5 << 56
	wrReq      = 6 << 56
	wrKindMask = 0xff << 56
)

// con is one RDMA connection of a path.
type con struct {
	cid int
	id  rdma.ConnID
	cq  rdma.CQ
	qp  rdma.QP

	// Signal one send in sigInterval so that the send queue drains on hardware, where
	// unsignaled requests free their slots only through a later signaled one.
	sigInterval int
	sends       atomic.Uint32

	// Scratch for the connection's completion handler (calls never overlap).
	recvWR [1]rdma.RecvWR
	sendWR [1]rdma.SendWR

	// A server IO connection re-posts its empty receives recvBatch at a time (repostEmpty):
	// recvOwed are used and not yet replaced, and recvBatch-1 more than the queue depth were
	// posted at first, so that the queue depth is always there.
	recvBatch int
	recvOwed  int
	emptyWRs  [serverRecvBatch]rdma.RecvWR

	atEnd []func() // SrvRequest.AtBurstEnd's, run by the completion handler at its end
}

// endBurst runs what the burst's requests asked for at its end.
func (c *con) endBurst() {
	for i, fn := range c.atEnd {
		c.atEnd[i] = nil
		fn()
	}
	c.atEnd = c.atEnd[:0]
}

// serverRecvBatch is how many empty receives a server IO connection re-posts at once: one
// post, a call into C on verbs, for that many requests.
const serverRecvBatch = 8

// repostEmpty accounts for one used empty receive and re-posts the owed ones when a batch is
// due (the completion handler's).
func (c *con) repostEmpty() error {
	if c.recvOwed++; c.recvOwed < c.recvBatch {
		return nil
	}
	n := c.recvOwed
	c.recvOwed = 0
	_, err := c.qp.PostRecv(c.emptyWRs[:n])
	return err
}

// ioRecvs sizes a server IO connection's receive queue for queue depth qd: its capacity, the
// re-post batch (repostEmpty) and how many receives are posted at first, the depth and a
// batch less one: as receives are used and re-posted a batch at a time, the depth is always
// posted.
func ioRecvs(qd int) (capacity, batch, initial int) {
	capacity = min(qd+serverRecvBatch, 16384)
	batch = max(1, min(serverRecvBatch, capacity-qd))
	return capacity, batch, qd + batch - 1
}

// signal returns the flags for the next send on c.
func (c *con) signal() rdma.SendFlags {
	if int(c.sends.Add(1))%c.sigInterval == 0 {
		return rdma.SendSignaled
	}
	return 0
}

// drain polls c's queue empty, passing each completion to handle, and returns how many there
// were (for wc_completion). A burst (SrvRequest.AtBurstEnd) ends with each poll's batch, so
// that under steady load its first request does not wait for the queue to run dry.
func (c *con) drain(wc []rdma.WC, handle func(rdma.WC)) int {
	total := 0
	for n := c.cq.Poll(wc); n > 0; n = c.cq.Poll(wc) {
		total += n
		for _, w := range wc[:n] {
			handle(w)
		}
		c.endBurst()
	}
	return total
}

func (c *con) destroy() {
	if c.id != nil {
		_ = c.id.Destroy()
	}
	if c.cq != nil {
		c.cq.SetHandler(nil)
		_ = c.cq.Destroy()
	}
}
