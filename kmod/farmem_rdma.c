// SPDX-License-Identifier: GPL-2.0
/*
 * Connecting to one farmemd with the kernel rdma_cm API, as the userspace verbs transport does
 * (transport/src/verbs_setup.cc, docs/rdma.md "Admission"): resolve address and route, create
 * PD, CQ and an RC queue pair, connect with the 40-byte private data "FMRC", version, 3 zero bytes,
 * and the one-time token the control tool got from the daemon over its authenticated TCP
 * connection. The daemon creates its side of the QP in the protection domain of the lease owner
 * named by the token, so the leases' rkeys work on this QP and on no other client's.
 */
#include <linux/module.h>
#include <linux/slab.h>
#include <asm/unaligned.h>

#include "farmem.h"

#define FARMEM_RDMA_MAGIC 0x43524D46 /* 'F' 'M' 'R' 'C', little-endian on the wire */
#define FARMEM_WIRE_VERSION 1
#define FARMEM_CM_TIMEOUT_MS 2000
#define FARMEM_ACK_TIMEOUT 15 /* 4.096 us * 2^15: ~134 ms, as the userspace transport */

static int farmem_cm_handler(struct rdma_cm_id *id, struct rdma_cm_event *ev)
{
	struct farmem_peer *peer = id->context;

	switch (ev->event) {
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		rdma_set_ack_timeout(id, FARMEM_ACK_TIMEOUT);
		peer->cm_error = rdma_resolve_route(id, FARMEM_CM_TIMEOUT_MS);
		if (peer->cm_error)
			complete(&peer->cm_done);
		break;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		peer->cm_error = 0;
		complete(&peer->cm_done);
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		peer->cm_error = 0;
		WRITE_ONCE(peer->connected, true);
		complete(&peer->cm_done);
		break;
	case RDMA_CM_EVENT_REJECTED:
		/* The daemon's reason: magic u32, version u8, reserved u8, status u16 (wire.h). */
		if (ev->param.conn.private_data && ev->param.conn.private_data_len >= 8) {
			const u8 *p = ev->param.conn.private_data;

			if (get_unaligned_le32(p) == FARMEM_RDMA_MAGIC)
				peer->reject_status = get_unaligned_le16(p + 6);
		}
		peer->cm_error = -ECONNREFUSED;
		complete(&peer->cm_done);
		break;
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_CONNECT_ERROR:
		peer->cm_error = ev->status ? ev->status : -EHOSTUNREACH;
		if (peer->cm_error > 0)
			peer->cm_error = -peer->cm_error;
		complete(&peer->cm_done);
		break;
	case RDMA_CM_EVENT_DISCONNECTED:
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		/* Outstanding work requests are flushed with errors by the QP going to error. */
		if (READ_ONCE(peer->connected))
			pr_warn("farmem: daemon %pI4:%u disconnected (%s): its slabs fail I/O\n",
				&peer->addr.sin_addr, ntohs(peer->addr.sin_port),
				rdma_event_msg(ev->event));
		WRITE_ONCE(peer->connected, false);
		/* Moves the QP to error now (as iSER does from its handler): work requests still
		 * outstanding there are flushed with errors at once, and their requests go to another
		 * copy or fail, instead of waiting on a peer that is gone. */
		if (ev->event == RDMA_CM_EVENT_DISCONNECTED)
			rdma_disconnect(id);
		farmem_ctl_notify();
		break;
	default:
		break;
	}
	return 0; /* never non-zero: that would destroy the id under us */
}

static int farmem_cm_wait(struct farmem_peer *peer, const char *step)
{
	/* The handler answers every step within FARMEM_CM_TIMEOUT_MS or with an error; the margin
	 * covers a connect whose reply (accept or reject) is lost. */
	if (!wait_for_completion_timeout(&peer->cm_done, msecs_to_jiffies(3 * FARMEM_CM_TIMEOUT_MS))) {
		pr_err("farmem: %pI4:%u: no answer to %s\n", &peer->addr.sin_addr,
		       ntohs(peer->addr.sin_port), step);
		return -ETIMEDOUT;
	}
	if (peer->cm_error)
		pr_err("farmem: %pI4:%u: %s failed: %d%s\n", &peer->addr.sin_addr,
		       ntohs(peer->addr.sin_port), step, peer->cm_error,
		       peer->reject_status ? " (rejected by the daemon: see its log)" : "");
	return peer->cm_error;
}

int farmem_peer_connect(struct farmem_peer *peer, const u8 token[FARMEM_TOKEN_BYTES])
{
	struct ib_qp_init_attr init = {};
	struct rdma_conn_param param = {};
	struct ib_device *dev;
	u8 pdata[8 + FARMEM_TOKEN_BYTES];
	int depth, ret;

	init_completion(&peer->cm_done);
	atomic64_set(&peer->errors, 0);
	peer->cm_id = rdma_create_id(&init_net, farmem_cm_handler, peer, RDMA_PS_TCP, IB_QPT_RC);
	if (IS_ERR(peer->cm_id)) {
		ret = PTR_ERR(peer->cm_id);
		peer->cm_id = NULL;
		return ret;
	}
	ret = rdma_resolve_addr(peer->cm_id, NULL, (struct sockaddr *)&peer->addr,
				FARMEM_CM_TIMEOUT_MS);
	if (ret)
		return ret;
	ret = farmem_cm_wait(peer, "address and route resolution");
	if (ret)
		return ret;
	dev = peer->cm_id->device;
	if (dev->attrs.max_send_sge < FARMEM_MAX_SEGS) {
		pr_err("farmem: device %s has %d send SGEs, farmem needs %d\n", dev_name(&dev->dev),
		       dev->attrs.max_send_sge, FARMEM_MAX_SEGS);
		return -EOPNOTSUPP;
	}
	peer->pd = ib_alloc_pd(dev, 0);
	if (IS_ERR(peer->pd)) {
		ret = PTR_ERR(peer->pd);
		peer->pd = NULL;
		return ret;
	}
	/* Every request of every hardware queue may be outstanding, on every copy. */
	depth = num_possible_cpus() * FARMEM_QUEUE_DEPTH + 1;
	peer->cq = ib_alloc_cq(dev, peer, depth + 1, 0, IB_POLL_SOFTIRQ);
	if (IS_ERR(peer->cq)) {
		ret = PTR_ERR(peer->cq);
		peer->cq = NULL;
		return ret;
	}
	init.send_cq = peer->cq;
	init.recv_cq = peer->cq;
	init.qp_type = IB_QPT_RC;
	init.sq_sig_type = IB_SIGNAL_REQ_WR;
	init.cap.max_send_wr = depth;
	init.cap.max_recv_wr = 1;
	init.cap.max_send_sge = FARMEM_MAX_SEGS;
	init.cap.max_recv_sge = 1;
	ret = rdma_create_qp(peer->cm_id, peer->pd, &init);
	if (ret)
		return ret;
	peer->qp = peer->cm_id->qp;

	put_unaligned_le32(FARMEM_RDMA_MAGIC, pdata);
	pdata[4] = FARMEM_WIRE_VERSION;
	pdata[5] = pdata[6] = pdata[7] = 0;
	memcpy(pdata + 8, token, FARMEM_TOKEN_BYTES);
	param.private_data = pdata;
	param.private_data_len = sizeof(pdata);
	param.initiator_depth = min_t(int, FARMEM_READ_DEPTH, dev->attrs.max_qp_init_rd_atom);
	param.responder_resources = 0; /* the daemon never reads from us */
	param.retry_count = 7;
	param.rnr_retry_count = 7;
	param.flow_control = 1;
	reinit_completion(&peer->cm_done);
	ret = rdma_connect(peer->cm_id, &param);
	if (ret)
		return ret;
	ret = farmem_cm_wait(peer, "connect");
	if (ret)
		return ret;
	pr_info("farmem: connected to daemon %pI4:%u on %s\n", &peer->addr.sin_addr,
		ntohs(peer->addr.sin_port), dev_name(&dev->dev));
	return 0;
}

/* Also for a peer whose connect failed half-way. Not on the I/O path; the disk is gone. */
void farmem_peer_destroy(struct farmem_peer *peer)
{
	WRITE_ONCE(peer->connected, false); /* our own disconnect is not news */
	if (peer->qp) {
		/* No ib_drain_qp: every work request belongs to a request, and the disk (deleted
		 * first) waited for all of them; a drain also hung on a dead daemon's QP under 6.1's
		 * rxe (docs/kmod.md). */
		rdma_disconnect(peer->cm_id);
		rdma_destroy_qp(peer->cm_id);
		peer->qp = NULL;
	}
	if (peer->cq)
		ib_free_cq(peer->cq);
	if (peer->pd)
		ib_dealloc_pd(peer->pd);
	if (peer->cm_id)
		rdma_destroy_id(peer->cm_id); /* waits for a running handler */
	kfree(peer);
}
