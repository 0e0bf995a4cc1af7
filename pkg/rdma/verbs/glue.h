// C side of the verbs provider: work requests and completions laid out for Go, and the
// calls that are macros or inline functions in rdma-core's headers.
#ifndef RTRS_VERBS_GLUE_H
#define RTRS_VERBS_GLUE_H
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <endian.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

// Operation codes shared with Go (rdma.Opcode values, plus the provider's own).
enum {
	G_WRITE = 0, G_WRITE_IMM = 1, G_SEND = 2, G_SEND_IMM = 3, G_READ = 4,
	G_SEND_INV = 5, G_LOCAL_INV = 6, G_REG_MR = 7,
};

// gwr is one send work request as Go lays it out in C memory. For REG_MR and for a
// LOCAL_INV of a type 1 window, mw is set: a type 1 window is bound (or unbound, with length
// 0) by ibv_bind_mw, a type 2 window by an IBV_WR_BIND_MW in the chain.
struct gwr {
	uint64_t wr_id;
	uint32_t op;
	uint32_t flags;
	uint32_t nsge;
	uint32_t imm;
	uint64_t remote_addr;
	uint32_t rkey;
	uint32_t inv_rkey;
	struct ibv_mw *mw;
	struct ibv_mr *mr;
	uint64_t addr;
	uint64_t length;
	uint32_t access;
	uint32_t new_key; // type 2: the key to bind with; type 1: set to the key bound with
	struct ibv_sge *sge;
};

// gwc is one completion, with the immediate already in host order.
struct gwc {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t flags;
	uint32_t byte_len;
	uint32_t imm;
	uint32_t qp_num;
};

struct grecv {
	uint64_t wr_id;
	uint32_t nsge;
	struct ibv_sge *sge;
};

// The CM event as Go needs it, copied before the event is acknowledged.
struct gev {
	int type;
	int status;
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	uint8_t pdata[256];
	int pdata_len;
};


// The calls on every request's path take their objects (the QP or CQ and the buffers made
// for them, all C memory, never Go's) as integers: cgo checks every pointer argument of a
// call for Go pointers, and these checks cost as much as the call itself.
int rtrs_post_send(uintptr_t qp, uintptr_t w, int n, uintptr_t chain, int *bad);
int rtrs_post_recv(uintptr_t qp, uintptr_t w, int n, uintptr_t chain, int *bad);
int rtrs_poll(uintptr_t cq, uintptr_t wc, uintptr_t out, int n);
// rtrs_poll_busy polls until a completion comes or spins polls found none.
int rtrs_poll_busy(uintptr_t cq, uintptr_t wc, uintptr_t out, int n, int spins);
int rtrs_arm_poll(uintptr_t cq, uintptr_t wc, uintptr_t out, int n);
int rtrs_get_cq_event(struct ibv_comp_channel *ch);
int rtrs_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a);
int rtrs_set_nonblock(int fd);
int rtrs_qp_to_error(struct ibv_qp *qp);
int rtrs_qp_state(struct ibv_qp *qp);
int rtrs_get_cm_event(struct rdma_event_channel *ch, struct gev *out);
int rtrs_connect(struct rdma_cm_id *id, const void *pd, int len, int rnr, int retry, int rd_atom);
int rtrs_accept(struct rdma_cm_id *id, const void *pd, int len, int rnr, int rd_atom);
int rtrs_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
			  int swr, int rwr, int ssge, int rsge);
struct ibv_context *rtrs_id_verbs(struct rdma_cm_id *id);
int rtrs_id_port(struct rdma_cm_id *id);
struct ibv_qp *rtrs_id_qp(struct rdma_cm_id *id);
uint32_t rtrs_mw_rkey(struct ibv_mw *mw);
void rtrs_set_mw_rkey(struct ibv_mw *mw, uint32_t rkey);
int rtrs_ch_fd(struct rdma_event_channel *ch);
int rtrs_comp_fd(struct ibv_comp_channel *ch);

#endif
