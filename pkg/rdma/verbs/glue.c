//go:build verbs

#include "glue.h"

static unsigned gflags(uint32_t f) {
	unsigned s = 0;
	if (f & 1) s |= IBV_SEND_SIGNALED;
	if (f & 2) s |= IBV_SEND_SOLICITED;
	return s;
}

// post_chain posts wrs[from:to) as one chain; on failure *bad is the index of the first not
// posted.
static int post_chain(struct ibv_qp *qp, struct ibv_send_wr *chain, struct gwr *w, int from, int to, int *bad) {
	struct ibv_send_wr *bw = NULL;
	if (from == to)
		return 0;
	chain[to - 1].next = NULL;
	int rc = ibv_post_send(qp, &chain[from], &bw);
	if (rc) {
		*bad = bw ? (int)(bw - chain) : from;
	}
	return rc;
}

// post_send posts n work requests in order, splitting the chain around type 1 binds, which
// have their own call. It returns an errno and sets *bad.
static int post_send(struct ibv_qp *qp, struct gwr *w, int n, struct ibv_send_wr *chain, int *bad) {
	int start = 0, rc;
	for (int i = 0; i < n; i++) {
		struct ibv_send_wr *s = &chain[i];
		memset(s, 0, sizeof(*s));
		s->wr_id = w[i].wr_id;
		s->sg_list = w[i].sge;
		s->num_sge = w[i].nsge;
		s->send_flags = gflags(w[i].flags);
		s->next = &chain[i + 1];
		int type1 = w[i].mw && w[i].mw->type == IBV_MW_TYPE_1;
		switch (w[i].op) {
		case G_WRITE:
			s->opcode = IBV_WR_RDMA_WRITE;
			break;
		case G_WRITE_IMM:
			s->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
			s->imm_data = htobe32(w[i].imm);
			break;
		case G_SEND:
			s->opcode = IBV_WR_SEND;
			break;
		case G_SEND_IMM:
			s->opcode = IBV_WR_SEND_WITH_IMM;
			s->imm_data = htobe32(w[i].imm);
			break;
		case G_READ:
			s->opcode = IBV_WR_RDMA_READ;
			break;
		case G_SEND_INV:
			s->opcode = IBV_WR_SEND_WITH_INV;
			s->invalidate_rkey = w[i].inv_rkey;
			break;
		case G_LOCAL_INV:
			s->opcode = IBV_WR_LOCAL_INV;
			s->invalidate_rkey = w[i].inv_rkey;
			break;
		case G_REG_MR:
			s->opcode = IBV_WR_BIND_MW;
			s->bind_mw.mw = w[i].mw;
			s->bind_mw.rkey = w[i].new_key;
			s->bind_mw.bind_info.mr = w[i].mr;
			s->bind_mw.bind_info.addr = w[i].addr;
			s->bind_mw.bind_info.length = w[i].length;
			s->bind_mw.bind_info.mw_access_flags = w[i].access;
			break;
		default:
			*bad = i;
			return EINVAL;
		}
		if (w[i].op == G_WRITE || w[i].op == G_WRITE_IMM || w[i].op == G_READ) {
			s->wr.rdma.remote_addr = w[i].remote_addr;
			s->wr.rdma.rkey = w[i].rkey;
		}
		if (!type1)
			continue;
		// A type 1 window: post what came before, then bind it on its own.
		if ((rc = post_chain(qp, chain, w, start, i, bad)))
			return rc;
		struct ibv_mw_bind b;
		memset(&b, 0, sizeof(b));
		b.wr_id = w[i].wr_id;
		b.send_flags = gflags(w[i].flags);
		// A LOCAL_INV is a bind of length 0 (over the window's region: rxe's library reads it).
		b.bind_info.mr = w[i].mr;
		if (w[i].op == G_REG_MR) {
			b.bind_info.addr = w[i].addr;
			b.bind_info.length = w[i].length;
			b.bind_info.mw_access_flags = w[i].access;
		}
		if ((rc = ibv_bind_mw(qp, w[i].mw, &b))) {
			*bad = i;
			return rc;
		}
		// The key the library chose, read now: a bind of the same window from another QP
		// may follow as soon as this chain reaches the peer.
		w[i].new_key = w[i].mw->rkey;
		start = i + 1;
	}
	return post_chain(qp, chain, w, start, n, bad);
}


int rtrs_post_send(uintptr_t qp, uintptr_t w, int n, uintptr_t chain, int *bad) {
	return post_send((struct ibv_qp *)qp, (struct gwr *)w, n, (struct ibv_send_wr *)chain, bad);
}

static int post_recv(struct ibv_qp *qp, struct grecv *w, int n, struct ibv_recv_wr *chain, int *bad) {
	for (int i = 0; i < n; i++) {
		chain[i].wr_id = w[i].wr_id;
		chain[i].sg_list = w[i].sge;
		chain[i].num_sge = w[i].nsge;
		chain[i].next = i + 1 < n ? &chain[i + 1] : NULL;
	}
	struct ibv_recv_wr *bw = NULL;
	int rc = ibv_post_recv(qp, chain, &bw);
	if (rc)
		*bad = bw ? (int)(bw - chain) : 0;
	return rc;
}

int rtrs_post_recv(uintptr_t qp, uintptr_t w, int n, uintptr_t chain, int *bad) {
	return post_recv((struct ibv_qp *)qp, (struct grecv *)w, n, (struct ibv_recv_wr *)chain, bad);
}

static int poll_cq(struct ibv_cq *cq, struct ibv_wc *wc, struct gwc *out, int n) {
	int got = ibv_poll_cq(cq, n, wc);
	for (int i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].flags = wc[i].wc_flags;
		// rxe hands the kernel's flags through, where an invalidation is bit 2
		// (IB_WC_WITH_INVALIDATE), userspace's IBV_WC_IP_CSUM_OK; a checksum flag never
		// comes on an RC receive, so there it is the invalidation.
		if (wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV &&
		    (wc[i].wc_flags & (IBV_WC_WITH_INV | IBV_WC_IP_CSUM_OK | IBV_WC_WITH_IMM)) == IBV_WC_IP_CSUM_OK)
			out[i].flags = (wc[i].wc_flags & ~IBV_WC_IP_CSUM_OK) | IBV_WC_WITH_INV;
		out[i].byte_len = wc[i].byte_len;
		out[i].qp_num = wc[i].qp_num;
		out[i].imm = 0;
		if (wc[i].status == IBV_WC_SUCCESS && (wc[i].wc_flags & IBV_WC_WITH_IMM))
			out[i].imm = be32toh(wc[i].imm_data);
		else if (wc[i].status == IBV_WC_SUCCESS && (out[i].flags & IBV_WC_WITH_INV))
			out[i].imm = wc[i].invalidated_rkey;
	}
	return got;
}

int rtrs_poll(uintptr_t cq, uintptr_t wc, uintptr_t out, int n) {
	return poll_cq((struct ibv_cq *)cq, (struct ibv_wc *)wc, (struct gwc *)out, n);
}

int rtrs_poll_busy(uintptr_t cq, uintptr_t wc, uintptr_t out, int n, int spins) {
	int got;
	do
		got = poll_cq((struct ibv_cq *)cq, (struct ibv_wc *)wc, (struct gwc *)out, n);
	while (got == 0 && --spins > 0);
	return got;
}

// rtrs_arm_poll requests an event for the next completion, then polls: what came before the
// request is found now, what comes after it raises the event. One call for the two.
int rtrs_arm_poll(uintptr_t cq, uintptr_t wc, uintptr_t out, int n) {
	int rc = ibv_req_notify_cq((struct ibv_cq *)cq, 0);
	if (rc)
		return rc > 0 ? -rc : rc;
	return poll_cq((struct ibv_cq *)cq, (struct ibv_wc *)wc, (struct gwc *)out, n);
}

// rtrs_get_cq_event takes one event from a non-blocking channel: 1 if there was one, 0 if
// none, -errno on error.
int rtrs_get_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *ctx;
	if (ibv_get_cq_event(ch, &cq, &ctx)) {
		if (errno == EAGAIN)
			return 0;
		return -errno;
	}
	ibv_ack_cq_events(cq, 1);
	return 1;
}

int rtrs_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {
	return ibv_query_port(c, port, a);
}

int rtrs_set_nonblock(int fd) {
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0)
		return -errno;
	if (fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
		return -errno;
	return 0;
}

int rtrs_qp_to_error(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

int rtrs_qp_state(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia))
		return -errno;
	return a.qp_state;
}


// rtrs_get_cm_event takes one event from a non-blocking channel: 1 if there was one, 0 if
// none, -errno on error.
int rtrs_get_cm_event(struct rdma_event_channel *ch, struct gev *out) {
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(ch, &ev)) {
		if (errno == EAGAIN)
			return 0;
		return -errno;
	}
	out->type = ev->event;
	out->status = ev->status;
	out->id = ev->id;
	out->listen_id = ev->listen_id;
	out->pdata_len = 0;
	if ((ev->event == RDMA_CM_EVENT_CONNECT_REQUEST || ev->event == RDMA_CM_EVENT_ESTABLISHED ||
	     ev->event == RDMA_CM_EVENT_REJECTED || ev->event == RDMA_CM_EVENT_CONNECT_RESPONSE) &&
	    ev->param.conn.private_data && ev->param.conn.private_data_len) {
		int n = ev->param.conn.private_data_len;
		if (n > (int)sizeof(out->pdata))
			n = sizeof(out->pdata);
		memcpy(out->pdata, ev->param.conn.private_data, n);
		out->pdata_len = n;
	}
	rdma_ack_cm_event(ev);
	return 1;
}

int rtrs_connect(struct rdma_cm_id *id, const void *pd, int len, int rnr, int retry, int rd_atom) {
	struct rdma_conn_param p;
	memset(&p, 0, sizeof(p));
	p.private_data = pd;
	p.private_data_len = len;
	p.rnr_retry_count = rnr;
	p.retry_count = retry;
	p.responder_resources = rd_atom;
	p.initiator_depth = rd_atom;
	return rdma_connect(id, &p) ? errno : 0;
}

int rtrs_accept(struct rdma_cm_id *id, const void *pd, int len, int rnr, int rd_atom) {
	struct rdma_conn_param p;
	memset(&p, 0, sizeof(p));
	p.private_data = pd;
	p.private_data_len = len;
	p.rnr_retry_count = rnr;
	p.responder_resources = rd_atom;
	p.initiator_depth = rd_atom;
	return rdma_accept(id, &p) ? errno : 0;
}

int rtrs_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
			  int swr, int rwr, int ssge, int rsge) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = scq;
	a.recv_cq = rcq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 0;
	a.cap.max_send_wr = swr;
	a.cap.max_recv_wr = rwr;
	a.cap.max_send_sge = ssge;
	a.cap.max_recv_sge = rsge;
	return rdma_create_qp(id, pd, &a) ? errno : 0;
}

struct ibv_context *rtrs_id_verbs(struct rdma_cm_id *id) { return id->verbs; }
int rtrs_id_port(struct rdma_cm_id *id) { return id->port_num; }
struct ibv_qp *rtrs_id_qp(struct rdma_cm_id *id) { return id->qp; }
uint32_t rtrs_mw_rkey(struct ibv_mw *mw) { return mw->rkey; }
int rtrs_ch_fd(struct rdma_event_channel *ch) { return ch->fd; }
int rtrs_comp_fd(struct ibv_comp_channel *ch) { return ch->fd; }
void rtrs_set_mw_rkey(struct ibv_mw *mw, uint32_t rkey) { mw->rkey = rkey; }
