// SPDX-License-Identifier: GPL-2.0
/*
 * The block device: /dev/farmem0, 4 KiB logical blocks, one hardware queue per CPU. A request
 * never crosses a slab (chunk_sectors = slab size), so it is one RDMA READ or WRITE work request
 * with up to FARMEM_MAX_SEGS scatter entries, posted on the slab's daemon's queue pair. It
 * completes from the CQ handler (softirq). Per-request state is the blk-mq PDU, allocated with the
 * tag set: the I/O path allocates nothing, so it cannot recurse into reclaim (swap-safe).
 */
#include <linux/blkdev.h>
#include <linux/module.h>
#include <linux/slab.h>

#include "farmem.h"

static void farmem_rdma_done(struct ib_cq *cq, struct ib_wc *wc);

static inline bool farmem_replica_usable(struct farmem_cmd *cmd, int r)
{
	struct farmem_peer *peer = cmd->slab->r[r].peer;

	return peer && READ_ONCE(peer->connected) && !test_bit(r, &cmd->slab->stale);
}

/* Fills and posts the work request of replica r. */
static int farmem_post(struct farmem_cmd *cmd, int r)
{
	struct farmem_replica *rep = farmem_copy_of(cmd->dev, cmd->slab, r);
	struct farmem_wr *w = &cmd->w[r];
	const struct ib_send_wr *bad;
	struct scatterlist *sg;
	int i;

	for_each_sg(cmd->sg, sg, cmd->mapped_nents, i) {
		w->sge[i].addr = sg_dma_address(sg);
		w->sge[i].length = sg_dma_len(sg);
		w->sge[i].lkey = rep->peer->pd->local_dma_lkey;
	}
	w->replica = r;
	w->cqe.done = farmem_rdma_done;
	memset(&w->wr, 0, sizeof(w->wr));
	w->wr.wr.wr_cqe = &w->cqe;
	w->wr.wr.sg_list = w->sge;
	w->wr.wr.num_sge = cmd->mapped_nents;
	w->wr.wr.opcode = cmd->dir == DMA_FROM_DEVICE ? IB_WR_RDMA_READ : IB_WR_RDMA_WRITE;
	w->wr.wr.send_flags = IB_SEND_SIGNALED;
	w->wr.remote_addr = rep->remote_addr + cmd->off;
	w->wr.rkey = rep->rkey;
	return ib_post_send(rep->peer->qp, &w->wr.wr, &bad);
}

static void farmem_end(struct farmem_cmd *cmd, blk_status_t status)
{
	ib_dma_unmap_sg(cmd->dev->ibdev, cmd->sg, cmd->nents, cmd->dir);
	blk_mq_end_request(blk_mq_rq_from_pdu(cmd), status);
}

/*
 * A read goes to the first usable replica after `after`, then (a copy being moved) to the old
 * copy; false if there is none left.
 */
static bool farmem_read_next(struct farmem_cmd *cmd, int after)
{
	int r;

	for (r = after + 1; r < cmd->dev->replicas; r++) {
		if (!farmem_replica_usable(cmd, r))
			continue;
		if (farmem_post(cmd, r) == 0)
			return true;
		set_bit(r, &cmd->slab->stale);
	}
	if (cmd->use_old && after < FARMEM_OLD_COPY && farmem_old_usable(cmd->dev)) {
		if (farmem_post(cmd, FARMEM_OLD_COPY) == 0)
			return true;
		WRITE_ONCE(cmd->dev->sync.old_failed, true);
	}
	return false;
}

/* A write to the slab being rebuilt: its chunks count as written-to until it ends. */
static void farmem_sync_begin(struct farmem_cmd *cmd, u64 len)
{
	struct farmem_sync *sync = &cmd->dev->sync;
	unsigned long flags;
	u32 c;

	cmd->sync_c0 = cmd->off >> FARMEM_SYNC_SHIFT;
	cmd->sync_c1 = (cmd->off + len - 1) >> FARMEM_SYNC_SHIFT;
	spin_lock_irqsave(&sync->lock, flags);
	for (c = cmd->sync_c0; c <= cmd->sync_c1; c++)
		sync->inflight[c]++;
	spin_unlock_irqrestore(&sync->lock, flags);
	cmd->sync_counted = true;
}

/* Every work request of the write ended: its chunks are no longer in flight, but dirty. */
static void farmem_sync_end(struct farmem_cmd *cmd)
{
	struct farmem_sync *sync = &cmd->dev->sync;
	unsigned long flags;
	u32 c;

	spin_lock_irqsave(&sync->lock, flags);
	for (c = cmd->sync_c0; c <= cmd->sync_c1; c++) {
		sync->inflight[c]--;
		__set_bit(c, sync->dirty);
	}
	spin_unlock_irqrestore(&sync->lock, flags);
}

/*
 * A write's work request to replica r ended (ok or not); the last one ends the request. The
 * request succeeds if a copy that serves reads took it: the copy being rebuilt does not count,
 * the old copy of one being moved does (it serves reads until the move is done).
 */
static void farmem_write_one_done(struct farmem_cmd *cmd, int r, bool ok)
{
	if (ok && r != cmd->sync_r)
		atomic_inc(&cmd->ok);
	if (!ok && r == FARMEM_OLD_COPY)
		WRITE_ONCE(cmd->dev->sync.old_failed, true);
	if (!ok && r == cmd->sync_r)
		WRITE_ONCE(cmd->dev->sync.failed, true);
	if (atomic_dec_and_test(&cmd->pending)) {
		if (cmd->sync_counted)
			farmem_sync_end(cmd);
		farmem_end(cmd, atomic_read(&cmd->ok) > 0 ? BLK_STS_OK : BLK_STS_IOERR);
	}
}

static void farmem_rdma_done(struct ib_cq *cq, struct ib_wc *wc)
{
	struct farmem_wr *w = container_of(wc->wr_cqe, struct farmem_wr, cqe);
	struct farmem_cmd *cmd = container_of(w - w->replica, struct farmem_cmd, w[0]);
	struct farmem_replica *rep = farmem_copy_of(cmd->dev, cmd->slab, w->replica);
	struct request *rq = blk_mq_rq_from_pdu(cmd);
	bool ok = wc->status == IB_WC_SUCCESS;

	if (unlikely(!ok)) {
		atomic64_inc(&rep->peer->errors);
		/* This copy may now be older than the others: it serves no read until the tool
		 * rebuilt it (the status change wakes the tool). The old copy of a copy being moved
		 * has no stale bit: the move fails and marks it stale (farmem_rebuild.c). */
		if (w->replica == FARMEM_OLD_COPY)
			WRITE_ONCE(cmd->dev->sync.old_failed, true);
		else if (!test_and_set_bit(w->replica, &cmd->slab->stale))
			farmem_ctl_notify();
		pr_err_ratelimited("farmem: %s of %u bytes at sector %llu on daemon %pI4:%u (replica %d) failed: %s\n",
				   cmd->dir == DMA_FROM_DEVICE ? "RDMA READ" : "RDMA WRITE",
				   blk_rq_bytes(rq), (unsigned long long)blk_rq_pos(rq),
				   &rep->peer->addr.sin_addr, ntohs(rep->peer->addr.sin_port),
				   w->replica, ib_wc_status_msg(wc->status));
	}
	if (cmd->dir == DMA_TO_DEVICE) {
		farmem_write_one_done(cmd, w->replica, ok);
		return;
	}
	if (ok || !farmem_read_next(cmd, w->replica))
		farmem_end(cmd, ok ? BLK_STS_OK : BLK_STS_IOERR);
}

static blk_status_t farmem_queue_rq(struct blk_mq_hw_ctx *hctx, const struct blk_mq_queue_data *bd)
{
	struct request *rq = bd->rq;
	struct farmem_dev *dev = hctx->queue->queuedata;
	struct farmem_cmd *cmd = blk_mq_rq_to_pdu(rq);
	int r, n, targets[FARMEM_MAX_REPLICAS + 1], ntargets = 0;
	bool syncing = false;
	u64 pos, len;

	switch (req_op(rq)) {
	case REQ_OP_FLUSH:
		/* A WRITE completes once the daemon's NIC acknowledged it (RC): nothing to flush. */
		blk_mq_start_request(rq);
		blk_mq_end_request(rq, BLK_STS_OK);
		return BLK_STS_OK;
	case REQ_OP_DISCARD:
		/*
		 * The daemon lends whole slabs for the device's lifetime: there is nothing to give
		 * back for part of one, and the bytes simply stay (docs/kmod.md "DISCARD"). A range
		 * past the end is still refused.
		 */
		blk_mq_start_request(rq);
		pos = (u64)blk_rq_pos(rq) << SECTOR_SHIFT;
		blk_mq_end_request(rq, pos + blk_rq_bytes(rq) > dev->size_bytes ? BLK_STS_IOERR
										: BLK_STS_OK);
		return BLK_STS_OK;
	case REQ_OP_READ:
		cmd->dir = DMA_FROM_DEVICE;
		break;
	case REQ_OP_WRITE:
		cmd->dir = DMA_TO_DEVICE;
		break;
	default:
		return BLK_STS_NOTSUPP;
	}
	pos = (u64)blk_rq_pos(rq) << SECTOR_SHIFT;
	len = blk_rq_bytes(rq);
	if (unlikely(pos + len > dev->size_bytes))
		return BLK_STS_IOERR;
	cmd->dev = dev;
	cmd->slab = &dev->slabs[div64_u64_rem(pos, dev->slab_bytes, &cmd->off)];
	if (unlikely(cmd->off + len > dev->slab_bytes))
		return BLK_STS_IOERR;
	for (r = 0; r < dev->replicas; r++) {
		if (farmem_replica_usable(cmd, r))
			targets[ntargets++] = r;
	}
	cmd->sync_r = -1;
	cmd->sync_counted = false;
	cmd->use_old = false;
	if (unlikely(READ_ONCE(dev->sync.slab) == (u32)(cmd->slab - dev->slabs)) &&
	    READ_ONCE(dev->sync.moving) && farmem_old_usable(dev)) {
		/* The copy is being moved: its old lease serves until the move is done. */
		cmd->use_old = true;
		if (cmd->dir == DMA_TO_DEVICE)
			targets[ntargets++] = FARMEM_OLD_COPY;
	}
	if (unlikely(ntargets == 0 && !cmd->use_old))
		return BLK_STS_IOERR; /* every copy lost: a clean error for exactly this range */
	if (cmd->dir == DMA_TO_DEVICE &&
	    unlikely(READ_ONCE(dev->sync.slab) == (u32)(cmd->slab - dev->slabs))) {
		/* A copy is being rebuilt here: it takes every write from now on (farmem_rebuild.c). */
		syncing = true;
		r = dev->sync.replica;
		if (test_bit(r, &cmd->slab->stale) && !READ_ONCE(dev->sync.failed) &&
		    READ_ONCE(cmd->slab->r[r].peer->connected)) {
			targets[ntargets++] = r;
			cmd->sync_r = r;
			atomic64_inc(&dev->rebuild_writes);
		}
	}

	blk_mq_start_request(rq);
	sg_init_table(cmd->sg, FARMEM_MAX_SEGS);
	cmd->nents = blk_rq_map_sg(hctx->queue, rq, cmd->sg);
	n = ib_dma_map_sg(dev->ibdev, cmd->sg, cmd->nents, cmd->dir);
	if (unlikely(n == 0))
		return BLK_STS_RESOURCE;
	cmd->mapped_nents = n;
	if (cmd->dir == DMA_FROM_DEVICE) {
		if (farmem_read_next(cmd, -1))
			return BLK_STS_OK;
		ib_dma_unmap_sg(dev->ibdev, cmd->sg, cmd->nents, cmd->dir);
		return BLK_STS_IOERR;
	}
	/* A write: every usable replica; the request ends when the last one answered. */
	if (unlikely(syncing))
		farmem_sync_begin(cmd, len);
	atomic_set(&cmd->pending, ntargets);
	atomic_set(&cmd->ok, 0);
	for (n = 0; n < ntargets; n++) {
		if (unlikely(farmem_post(cmd, targets[n]))) {
			set_bit(targets[n], &cmd->slab->stale);
			farmem_write_one_done(cmd, targets[n], false);
		}
	}
	return BLK_STS_OK;
}

static const struct blk_mq_ops farmem_mq_ops = {
	.queue_rq = farmem_queue_rq,
};

static const struct block_device_operations farmem_fops = {
	.owner = THIS_MODULE,
};

int farmem_dev_create(u64 size_bytes, u64 slab_bytes, u32 replicas)
{
	struct farmem_dev *dev;

	if (farmem_dev0)
		return -EEXIST;
	if (!size_bytes || !slab_bytes || replicas < 1 || replicas > FARMEM_MAX_REPLICAS || size_bytes % 4096 || slab_bytes % 4096 ||
	    slab_bytes > (u64)UINT_MAX * SECTOR_SIZE || div64_u64(size_bytes, slab_bytes) >= (1u << 24))
		return -EINVAL;
	dev = kzalloc(sizeof(*dev), GFP_KERNEL);
	if (!dev)
		return -ENOMEM;
	dev->size_bytes = size_bytes;
	dev->slab_bytes = slab_bytes;
	dev->replicas = replicas;
	dev->nslabs = div64_u64(size_bytes + slab_bytes - 1, slab_bytes);
	dev->sync.slab = FARMEM_NO_SYNC;
	spin_lock_init(&dev->sync.lock);
	dev->slabs = kvcalloc(dev->nslabs, sizeof(*dev->slabs), GFP_KERNEL);
	if (!dev->slabs) {
		kfree(dev);
		return -ENOMEM;
	}
	farmem_dev0 = dev;
	return 0;
}

int farmem_dev_start(void)
{
	struct farmem_dev *dev = farmem_dev0;
	struct gendisk *disk;
	u32 i, r;
	int ret;

	if (!dev)
		return -ENODEV;
	if (dev->disk)
		return -EBUSY;
	for (i = 0; i < dev->nslabs; i++) {
		for (r = 0; r < dev->replicas; r++) {
			if (!dev->slabs[i].r[r].peer) {
				pr_err("farmem: slab %u replica %u has no lease: give it before start\n",
				       i, r);
				return -EINVAL;
			}
		}
	}
	dev->tag_set.ops = &farmem_mq_ops;
	dev->tag_set.nr_hw_queues = num_possible_cpus();
	dev->tag_set.queue_depth = FARMEM_QUEUE_DEPTH;
	dev->tag_set.numa_node = NUMA_NO_NODE;
	dev->tag_set.cmd_size = sizeof(struct farmem_cmd);
	dev->tag_set.flags = BLK_MQ_F_SHOULD_MERGE;
	dev->tag_set.driver_data = dev;
	ret = blk_mq_alloc_tag_set(&dev->tag_set);
	if (ret)
		return ret;
	dev->tag_set_ready = true;
	disk = blk_mq_alloc_disk(&dev->tag_set, dev);
	if (IS_ERR(disk))
		return PTR_ERR(disk);
	disk->major = farmem_major;
	disk->first_minor = 0;
	disk->minors = 1;
	disk->fops = &farmem_fops;
	disk->private_data = dev;
	snprintf(disk->disk_name, DISK_NAME_LEN, "farmem0");
	blk_queue_logical_block_size(disk->queue, 4096);
	blk_queue_physical_block_size(disk->queue, 4096);
	blk_queue_io_min(disk->queue, 4096);
	blk_queue_max_segments(disk->queue, FARMEM_MAX_SEGS);
	blk_queue_max_hw_sectors(disk->queue, FARMEM_MAX_SEGS * (PAGE_SIZE >> SECTOR_SHIFT));
	blk_queue_chunk_sectors(disk->queue, dev->slab_bytes >> SECTOR_SHIFT);
	blk_queue_write_cache(disk->queue, false, false);
	disk->queue->limits.discard_granularity = 4096;
	blk_queue_max_discard_sectors(disk->queue, (UINT_MAX >> SECTOR_SHIFT) & ~7u);
	blk_queue_flag_set(QUEUE_FLAG_NONROT, disk->queue);
	set_capacity(disk, dev->size_bytes >> SECTOR_SHIFT);
	ret = add_disk(disk);
	if (ret) {
		put_disk(disk);
		return ret;
	}
	dev->disk = disk;
	pr_info("farmem: farmem0: %llu bytes in %u slabs of %llu bytes, %u cop%s each\n",
		dev->size_bytes, dev->nslabs, dev->slab_bytes, dev->replicas,
		dev->replicas == 1 ? "y" : "ies");
	return 0;
}

/* Deletes the disk (waiting for its I/O), then disconnects the daemons. */
void farmem_dev_destroy(void)
{
	struct farmem_dev *dev = farmem_dev0;
	int i;

	if (!dev)
		return;
	if (dev->disk) {
		del_gendisk(dev->disk);
		put_disk(dev->disk);
		dev->disk = NULL;
	}
	if (dev->tag_set_ready)
		blk_mq_free_tag_set(&dev->tag_set);
	for (i = 0; i < FARMEM_MAX_PEERS; i++) {
		if (dev->peers[i])
			farmem_peer_destroy(dev->peers[i]);
	}
	farmem_sync_free(&dev->sync);
	kvfree(dev->slabs);
	kfree(dev);
	farmem_dev0 = NULL;
}

static int __init farmem_init(void)
{
	int ret;

	farmem_major = register_blkdev(0, "farmem");
	if (farmem_major < 0)
		return farmem_major;
	ret = farmem_ctl_init();
	if (ret)
		unregister_blkdev(farmem_major, "farmem");
	return ret;
}

static void __exit farmem_exit(void)
{
	farmem_ctl_exit();
	mutex_lock(&farmem_ctl_lock);
	farmem_dev_destroy();
	mutex_unlock(&farmem_ctl_lock);
	unregister_blkdev(farmem_major, "farmem");
}

module_init(farmem_init);
module_exit(farmem_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("farmem: a block device on memory lent by farmemd daemons, over RDMA");
