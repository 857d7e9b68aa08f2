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

#define FARMEM_IFACE_VERSION 4
#define FARMEM_MAX_PEERS 64
#define FARMEM_TOKEN_BYTES 32
#define FARMEM_MAX_SEGS 16 /* scatter entries per work request (one request, one WR) */
#define FARMEM_QUEUE_DEPTH 64 /* per hardware queue */
#define FARMEM_READ_DEPTH 16 /* RDMA READs we ask to have in flight per QP */
#define FARMEM_MAX_REPLICAS 3
#define FARMEM_NAME_BYTES 80 /* a peer's control endpoint, the owner's identity: opaque text */
#define FARMEM_SYNC_SHIFT 16 /* a rebuild copies and tracks writes in chunks of 64 KiB */
#define FARMEM_SYNC_CHUNK (1u << FARMEM_SYNC_SHIFT)
#define FARMEM_NO_SYNC U32_MAX /* farmem_sync.slab when no copy is being rebuilt */
/* The work request slot (farmem_cmd.w[]) of the old copy of a copy being moved (farmem_sync.old). */
#define FARMEM_OLD_COPY FARMEM_MAX_REPLICAS

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
 * (or a read) is stale from then on: it never serves a read again until the control tool gives
 * it a new lease with the `rebuild` command (farmem_rebuild.c), which copies the slab there.
 */
struct farmem_slab {
	struct farmem_replica r[FARMEM_MAX_REPLICAS];
	unsigned long stale; /* bit per replica; set_bit/test_bit */
};

/*
 * The copy being rebuilt (`rebuild` command, farmem_rebuild.c): at most one at a time, set up and
 * ended under farmem_ctl_lock. While `slab` names a slab, every write to it also goes to copy
 * `replica` (stale until the copy is done: it serves no read), and counts itself per 64 KiB chunk:
 * `inflight` while its work requests are out, then `dirty`. The copier copies a chunk only when no
 * write to it is in flight, and again if one started meanwhile (docs/kmod.md "Rebuilding a copy").
 */
struct farmem_sync {
	u32 slab; /* FARMEM_NO_SYNC when none; READ_ONCE on the I/O path */
	int replica;
	bool failed; /* a write to the new copy failed: the rebuild (or move) fails */
	/*
	 * `move` (the copy's lease is noticed: its daemon wants the memory back): copy `replica`'s
	 * old lease, the source of the copy. Every write to the slab also goes to it, and a read
	 * that has no other live copy reads it (work request slot FARMEM_OLD_COPY). Set and
	 * cleared with the queue frozen: a request that saw `moving` ends before it changes.
	 */
	bool moving;
	bool old_failed; /* an I/O to the old copy failed: it may have missed a write */
	struct farmem_replica old;
	spinlock_t lock; /* inflight and dirty; taken from queue_rq and the completion (softirq) */
	u32 nchunks; /* chunks per slab */
	u32 *inflight; /* per chunk of the slab, allocated at the first rebuild */
	unsigned long *dirty;
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
	struct farmem_sync sync;
	u64 rebuilt; /* copies rebuilt (status) */
	atomic64_t rebuild_writes; /* writes that also went to a copy being rebuilt (status) */
	u64 recopied; /* chunks the copier copied again because a write overtook it (status) */
	u64 moved; /* copies moved off a noticed lease (status) */
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
	atomic_t ok; /* work requests that succeeded (writes; the copy being rebuilt does not count) */
	int sync_r; /* the replica being rebuilt this write also went to, or -1 */
	bool use_old; /* the slab's copy is being moved: the old copy takes writes, serves reads */
	bool sync_counted; /* counted in farmem_sync.inflight [sync_c0, sync_c1] */
	u32 sync_c0, sync_c1;
	struct scatterlist sg[FARMEM_MAX_SEGS];
	struct farmem_wr w[FARMEM_MAX_REPLICAS + 1]; /* [FARMEM_OLD_COPY]: a moved copy's old lease */
};

/* Copy r of a slab, or (FARMEM_OLD_COPY) the old lease of the copy being moved. */
static inline struct farmem_replica *farmem_copy_of(struct farmem_dev *dev,
						    struct farmem_slab *slab, int r)
{
	return r == FARMEM_OLD_COPY ? &dev->sync.old : &slab->r[r];
}

/* The old copy of a copy being moved still serves: its daemon is there and it missed nothing. */
static inline bool farmem_old_usable(struct farmem_dev *dev)
{
	return !READ_ONCE(dev->sync.old_failed) && READ_ONCE(dev->sync.old.peer->connected);
}

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

/* farmem_rebuild.c: a lost copy of a slab onto a new lease, while the device serves. */
/* move: copy `replica` itself is the source (it stays readable until its lease ends). */
int farmem_dev_rebuild(u32 slab, u32 replica, u32 peer, u64 lease_id, u64 raddr, u32 rkey,
		       bool move);
void farmem_sync_free(struct farmem_sync *sync);

/* farmem_ctl.c: the sysfs interface. */
int farmem_ctl_init(void);
void farmem_ctl_exit(void);
void farmem_ctl_notify(void);

#endif
