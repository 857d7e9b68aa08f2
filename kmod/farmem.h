/* SPDX-License-Identifier: GPL-2.0 */
/*
 * farmem.ko: a blk-mq block device (/dev/farmem0) whose blocks live in slabs that farmemd daemons
 * lend. Every request becomes one RDMA READ or RDMA WRITE posted with the kernel verbs API against
 * the lease's memory region on the daemon; it completes from the CQ handler (softirq). The module
 * does not talk farmem's TCP control protocol: a userspace tool (farmemctl kmod attach)
 * authenticates, leases the slabs, keeps them alive, and hands the module, through
 * /sys/kernel/farmem/control, each daemon's rdma_cm address with a one-time admission token and
 * each slab's (lease id, remote address, rkey). docs/kmod.md specifies the interface.
 *
 * Ownership and threads: everything below is owned by the module and changed only under
 * farmem_ctl_lock (the control file's writers). The I/O path reads the slab table and the peers
 * without a lock: they are set up before the disk is added and torn down after it is deleted.
 */
#ifndef FARMEM_KMOD_H
#define FARMEM_KMOD_H

#include <linux/blk-mq.h>
#include <linux/completion.h>
#include <linux/in.h>
#include <rdma/ib_verbs.h>
#include <rdma/rdma_cm.h>

#define FARMEM_IFACE_VERSION 2
#define FARMEM_MAX_PEERS 64
#define FARMEM_TOKEN_BYTES 32
#define FARMEM_MAX_SEGS 16 /* scatter entries per work request (one request, one WR) */
#define FARMEM_QUEUE_DEPTH 64 /* per hardware queue */
#define FARMEM_READ_DEPTH 16 /* RDMA READs we ask to have in flight per QP */
#define FARMEM_MAX_REPLICAS 3
#define FARMEM_NAME_BYTES 80 /* a peer's control endpoint, the owner's identity: opaque text */

/* One daemon: one rdma_cm id, one RC queue pair in its own PD, one CQ polled in softirq. */
struct farmem_peer {
	int index;
	struct sockaddr_in addr;
	/* The daemon's control (TCP) endpoint as the tool named it: read back from `slabs`. */
	char endpoint[FARMEM_NAME_BYTES];
	struct rdma_cm_id *cm_id;
	struct ib_pd *pd;
	struct ib_cq *cq;
	struct ib_qp *qp;
	struct completion cm_done; /* the handler finished a connection step */
	int cm_error; /* 0, or why the step failed (negative errno) */
	int reject_status; /* farmem status code from a reject's private data, 0 if none */
	bool connected; /* ESTABLISHED and not yet disconnected; READ_ONCE on the I/O path */
	atomic64_t errors; /* completions with an error status */
};

/* One copy of a slab: a lease on one daemon. */
struct farmem_replica {
	struct farmem_peer *peer; /* NULL until given with the slab command */
	u64 lease_id;
	u64 remote_addr;
	u32 rkey;
};

/*
 * Where device bytes [index * slab_bytes, (index + 1) * slab_bytes) live: `replicas` copies on
 * distinct daemons. A write goes to every copy that is not stale; a read to the first one that is
 * not stale and whose daemon is connected, and on an error to the next. A copy that failed a write
 * (or a read) is stale from then on: it never serves a read again (rebuilding it is left to the
 * control tool, not done yet).
 */
struct farmem_slab {
	struct farmem_replica r[FARMEM_MAX_REPLICAS];
	unsigned long stale; /* bit per replica; set_bit/test_bit */
};

struct farmem_dev {
	u64 size_bytes;
	u64 slab_bytes;
	u32 nslabs;
	u32 replicas; /* copies per slab, 1..FARMEM_MAX_REPLICAS */
	struct farmem_slab *slabs;
	struct ib_device *ibdev; /* every peer's device: requests are DMA-mapped once, for it */
	struct farmem_peer *peers[FARMEM_MAX_PEERS];
	struct blk_mq_tag_set tag_set;
	struct gendisk *disk; /* non-NULL while started */
	/*
	 * Who holds the leases (`owner` command): the tool's client id (32 hex digits) and identity.
	 * The module does nothing with them; a restarted tool reads them back from `slabs` to renew
	 * the same leases (docs/kmod.md "Who keeps the leases"). Empty until given.
	 */
	char owner_id[FARMEM_NAME_BYTES];
	char owner_identity[FARMEM_NAME_BYTES];
	bool tag_set_ready;
};

/* One work request of a request: to one replica. */
struct farmem_wr {
	struct ib_cqe cqe;
	int replica;
	struct ib_sge sge[FARMEM_MAX_SEGS];
	struct ib_rdma_wr wr;
};

/* Per-request state, preallocated by blk-mq (tag_set.cmd_size): nothing is allocated per I/O. */
struct farmem_cmd {
	struct farmem_dev *dev;
	struct farmem_slab *slab;
	u64 off; /* within the slab */
	int nents; /* scatter entries (mapped: mapped_nents) */
	int mapped_nents;
	enum dma_data_direction dir;
	atomic_t pending; /* work requests not yet completed (writes) */
	atomic_t ok; /* work requests that succeeded (writes) */
	struct scatterlist sg[FARMEM_MAX_SEGS];
	struct farmem_wr w[FARMEM_MAX_REPLICAS];
};

extern struct mutex farmem_ctl_lock;
extern struct farmem_dev *farmem_dev0;
extern int farmem_major;

/* farmem_rdma.c: connection set-up and tear-down. */
int farmem_peer_connect(struct farmem_peer *peer, const u8 token[FARMEM_TOKEN_BYTES]);
void farmem_peer_destroy(struct farmem_peer *peer);

/* farmem_main.c: the block device. */
int farmem_dev_create(u64 size_bytes, u64 slab_bytes, u32 replicas);
int farmem_dev_start(void);
void farmem_dev_destroy(void);

/* farmem_ctl.c: the sysfs interface. */
int farmem_ctl_init(void);
void farmem_ctl_exit(void);
void farmem_ctl_notify(void);

#endif
