package transport

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// heartbeat is the per-path heartbeat state shared by client and server (spec 1.13).
type heartbeat struct {
	missed   atomic.Int32
	lastSent atomic.Int64 // unix nanos of the last HB_MSG
	latency  atomic.Int64 // last round trip, ns

	mu   sync.Mutex
	stop chan struct{}
	done chan struct{}
}

// run ticks every interval: after more than max unanswered ticks it calls onDead; otherwise
// it sends a heartbeat when the previous one was answered.
func (h *heartbeat) run(interval time.Duration, maxMissed int, send func() error, onDead func()) {
	stop, done := make(chan struct{}), make(chan struct{})
	h.mu.Lock()
	h.stop, h.done = stop, done
	h.mu.Unlock()
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			if int(h.missed.Load()) > maxMissed {
				onDead()
				return
			}
			if h.missed.Add(1) > 1 {
				continue // the previous heartbeat is not answered yet
			}
			h.lastSent.Store(time.Now().UnixNano())
			if send() != nil {
				onDead()
				return
			}
		}
	}()
}

// halt stops the heartbeat; safe to call more than once and from onDead.
func (h *heartbeat) halt() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stop == nil {
		return
	}
	select {
	case <-h.stop:
	default:
		close(h.stop)
	}
}

// wait waits for the heartbeat goroutine to end (not from onDead).
func (h *heartbeat) wait() {
	h.mu.Lock()
	d := h.done
	h.mu.Unlock()
	if d != nil {
		<-d
	}
}

// acked records an HB_ACK: the round trip becomes the path's latency.
func (h *heartbeat) acked() {
	if sent := h.lastSent.Load(); sent != 0 {
		h.latency.Store(time.Now().UnixNano() - sent)
	}
}

// onImm handles a heartbeat immediate of type typ received on c: an HB_MSG is answered, an
// HB_ACK recorded. It says whether typ was one of them.
func (h *heartbeat) onImm(c *con, typ uint32) bool {
	switch typ {
	case ImmHBMsg:
		_ = c.hbAck()
	case ImmHBAck:
		h.acked()
	default:
		return false
	}
	return true
}

// postHB posts a heartbeat on c: a zero-length RDMA_WRITE_WITH_IMM, signaled in its turn
// like every send of c. Left unsignaled, an idle connection's heartbeats and acks would hold
// their send queue slots on hardware until it filled (after hours) and the path dropped.
func (c *con) postHB() error {
	_, err := c.qp.PostSend([]rdma.SendWR{{ID: wrHB, Opcode: rdma.OpRDMAWriteWithImm, Imm: ImmHBMsgValue, Flags: c.signal()}})
	return err
}

// hbAck answers a heartbeat from the connection's handler without allocating.
func (c *con) hbAck() error {
	c.sendWR[0] = rdma.SendWR{ID: wrHB, Opcode: rdma.OpRDMAWriteWithImm, Imm: ImmHBAckValue, Flags: c.signal()}
	_, err := c.qp.PostSend(c.sendWR[:])
	return err
}
