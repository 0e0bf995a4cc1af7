package transport

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/rtrs-go/rtrs/pkg/rdma"
)

// rawCon is one connection of a raw session: its id, PD, CQ and QP.
type rawCon struct {
	id rdma.ConnID
	pd rdma.PD
	cq rdma.CQ
	qp rdma.QP
}

// rawSession opens a raw session of cidNum connections from src, sends INFO_REQ and returns
// the connections and the chunk descriptor.
func rawSession(t *testing.T, e *env, src netip.Addr, cidNum int, name string) ([]*rawCon, SgDesc, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sessU, pathsU := uuid.New(), uuid.New()
	var cons []*rawCon
	for cid := 0; cid < cidNum; cid++ {
		id, err := e.prov.ResolveAddr(ctx, src, e.srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		c := &rawCon{id: id}
		c.pd, _ = id.Device().AllocPD()
		c.cq, _ = id.Device().CreateCQ(4096)
		if c.qp, err = id.CreateQP(c.pd, rdma.QPInitAttr{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: 1024, MaxRecvWR: 1024, MaxSendSGE: 1, MaxRecvSGE: 1}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = id.Destroy(); _ = c.cq.Destroy() })
		m := MsgConnReq{Cid: uint16(cid), CidNum: uint16(cidNum), SessUUID: sessU, PathsUUID: pathsU, FirstConn: cid == 0}
		if _, err := id.Connect(ctx, rdma.ConnParam{PrivateData: m.Marshal(), RNRRetryCount: 7}); err != nil {
			return nil, SgDesc{}, false
		}
		cons = append(cons, c)
	}
	c0 := cons[0]
	buf, _ := c0.pd.AllocMR(8192, rdma.AccessLocalWrite)
	if _, err := c0.qp.PostRecv([]rdma.RecvWR{{ID: 1, SGList: []rdma.SGE{rdma.SGEOf(buf, 4096, 4096)}}}); err != nil {
		t.Fatal(err)
	}
	ir := MsgInfoReq{PathName: name}
	b, _ := ir.Marshal()
	copy(buf.Bytes(), b)
	if _, err := c0.qp.PostSend([]rdma.SendWR{{ID: 2, Opcode: rdma.OpSend, SGList: []rdma.SGE{rdma.SGEOf(buf, 0, len(b))}}}); err != nil {
		t.Fatal(err)
	}
	var wc [8]rdma.WC
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		n := c0.cq.Poll(wc[:])
		for _, w := range wc[:n] {
			if w.ID == 1 {
				if w.Status != rdma.WCSuccess {
					return nil, SgDesc{}, false
				}
				var rsp MsgInfoRsp
				if err := rsp.Unmarshal(buf.Bytes()[4096:4096+w.ByteLen], 1024); err != nil {
					t.Fatal(err)
				}
				return cons, rsp.Desc[0], true
			}
		}
		if n == 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	return nil, SgDesc{}, false
}

// TestChunkReuseWhilePosting: a hostile client sends requests into chunk 0 on two
// connections without waiting for the answers. None may be dispatched while the chunk's
// response chain is being posted (it would rewrite srvReq.wrs under the post: the race
// detector saw it, and a torn SendWR.MR could crash the provider); run with -race.
func TestChunkReuseWhilePosting(t *testing.T) {
	e := newEnv(t, false, 8)
	src := netip.MustParseAddr(testAddr(1))
	mb := MemBits(8)
	served := 0
	// The sessions' link events, which nobody else reads here.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-e.disk.events:
			case <-stop:
				return
			}
		}
	}()
	for iter := 0; iter < 60; iter++ {
		cons, d, ok := rawSession(t, e, src, 3, "race")
		if !ok {
			continue
		}
		c1, c2 := cons[1], cons[2]
		for _, c := range cons[1:] {
			_ = postEmptyRecvs(c.qp, 1000)
		}
		// Header in chunk 0: 8 bytes of user header (offset 0), then rtrs_msg_rdma_write.
		hb, _ := c1.pd.AllocMR(64, rdma.AccessLocalWrite)
		PutMsgRdmaWrite(hb.Bytes()[8:], 8)
		_, _ = c1.qp.PostSend([]rdma.SendWR{{Opcode: rdma.OpRDMAWrite, SGList: []rdma.SGE{rdma.SGEOf(hb, 0, 12)}, RemoteAddr: d.Addr, RKey: d.Key}})
		req := rdma.SendWR{Opcode: rdma.OpRDMAWriteWithImm, Imm: IOReqImm(0, 8, mb)}
		for k := 0; k < 200; k++ {
			c := c1
			if k%2 == 1 {
				c = c2
			}
			if _, err := c.qp.PostSend([]rdma.SendWR{req}); err != nil {
				break
			}
			// Spin a varying moment: the next request should land right after the
			// response's busy flag cleared.
			for s, n := 0, (iter*7+k)%200; s < n; s++ {
				_ = s
			}
		}
		time.Sleep(5 * time.Millisecond)
		e.disk.mu.Lock()
		for _, v := range e.disk.reqs {
			served += v
		}
		e.disk.reqs = map[string]int{}
		e.disk.mu.Unlock()
		for _, c := range cons {
			_ = c.id.Destroy()
		}
	}
	t.Logf("requests served: %d, refusals %v", served, e.srv.Refused())
}
