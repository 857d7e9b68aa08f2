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

static void farmem_rdma_done(struct ib_cq *cq, struct ib_wc *wc)
{
	struct farmem_cmd *cmd = container_of(wc->wr_cqe, struct farmem_cmd, cqe);
	struct request *rq = blk_mq_rq_from_pdu(cmd);
	blk_status_t status = BLK_STS_OK;

	ib_dma_unmap_sg(cmd->peer->pd->device, cmd->sg, cmd->nents, cmd->dir);
	cmd->nents = 0;
	if (unlikely(wc->status != IB_WC_SUCCESS)) {
		atomic64_inc(&cmd->peer->errors);
		pr_err_ratelimited("farmem: %s of %u bytes at sector %llu on daemon %pI4:%u failed: %s\n",
				   cmd->dir == DMA_FROM_DEVICE ? "RDMA READ" : "RDMA WRITE",
				   blk_rq_bytes(rq), (unsigned long long)blk_rq_pos(rq),
				   &cmd->peer->addr.sin_addr, ntohs(cmd->peer->addr.sin_port),
				   ib_wc_status_msg(wc->status));
		status = BLK_STS_IOERR;
	}
	blk_mq_end_request(rq, status);
}

static blk_status_t farmem_queue_rq(struct blk_mq_hw_ctx *hctx, const struct blk_mq_queue_data *bd)
{
	struct request *rq = bd->rq;
	struct farmem_dev *dev = hctx->queue->queuedata;
	struct farmem_cmd *cmd = blk_mq_rq_to_pdu(rq);
	const struct ib_send_wr *bad;
	struct farmem_slab *slab;
	struct scatterlist *sg;
	u64 pos, off, len;
	int i, n, ret;

	switch (req_op(rq)) {
	case REQ_OP_FLUSH:
		/* A WRITE completes once the daemon's NIC acknowledged it (RC): nothing to flush. */
		blk_mq_start_request(rq);
		blk_mq_end_request(rq, BLK_STS_OK);
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
	slab = &dev->slabs[div64_u64_rem(pos, dev->slab_bytes, &off)];
	if (unlikely(pos + len > dev->size_bytes || off + len > dev->slab_bytes || !slab->peer))
		return BLK_STS_IOERR;
	cmd->peer = slab->peer;
	if (unlikely(!READ_ONCE(cmd->peer->connected)))
		return BLK_STS_IOERR;

	blk_mq_start_request(rq);
	sg_init_table(cmd->sg, FARMEM_MAX_SEGS);
	n = blk_rq_map_sg(hctx->queue, rq, cmd->sg);
	cmd->nents = n;
	n = ib_dma_map_sg(cmd->peer->pd->device, cmd->sg, n, cmd->dir);
	if (unlikely(n == 0)) {
		cmd->nents = 0;
		return BLK_STS_RESOURCE;
	}
	for_each_sg(cmd->sg, sg, n, i) {
		cmd->sge[i].addr = sg_dma_address(sg);
		cmd->sge[i].length = sg_dma_len(sg);
		cmd->sge[i].lkey = cmd->peer->pd->local_dma_lkey;
	}
	cmd->cqe.done = farmem_rdma_done;
	memset(&cmd->wr, 0, sizeof(cmd->wr));
	cmd->wr.wr.wr_cqe = &cmd->cqe;
	cmd->wr.wr.sg_list = cmd->sge;
	cmd->wr.wr.num_sge = n;
	cmd->wr.wr.opcode = cmd->dir == DMA_FROM_DEVICE ? IB_WR_RDMA_READ : IB_WR_RDMA_WRITE;
	cmd->wr.wr.send_flags = IB_SEND_SIGNALED;
	cmd->wr.remote_addr = slab->remote_addr + off;
	cmd->wr.rkey = slab->rkey;
	ret = ib_post_send(cmd->peer->qp, &cmd->wr.wr, &bad);
	if (unlikely(ret)) {
		ib_dma_unmap_sg(cmd->peer->pd->device, cmd->sg, cmd->nents, cmd->dir);
		cmd->nents = 0;
		pr_err_ratelimited("farmem: ib_post_send to %pI4:%u: %d\n",
				   &cmd->peer->addr.sin_addr, ntohs(cmd->peer->addr.sin_port), ret);
		return ret == -ENOMEM ? BLK_STS_RESOURCE : BLK_STS_IOERR;
	}
	return BLK_STS_OK;
}

static const struct blk_mq_ops farmem_mq_ops = {
	.queue_rq = farmem_queue_rq,
};

static const struct block_device_operations farmem_fops = {
	.owner = THIS_MODULE,
};

int farmem_dev_create(u64 size_bytes, u64 slab_bytes)
{
	struct farmem_dev *dev;

	if (farmem_dev0)
		return -EEXIST;
	if (!size_bytes || !slab_bytes || size_bytes % 4096 || slab_bytes % 4096 ||
	    slab_bytes > (u64)UINT_MAX * SECTOR_SIZE || div64_u64(size_bytes, slab_bytes) >= (1u << 24))
		return -EINVAL;
	dev = kzalloc(sizeof(*dev), GFP_KERNEL);
	if (!dev)
		return -ENOMEM;
	dev->size_bytes = size_bytes;
	dev->slab_bytes = slab_bytes;
	dev->nslabs = div64_u64(size_bytes + slab_bytes - 1, slab_bytes);
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
	u32 i;
	int ret;

	if (!dev)
		return -ENODEV;
	if (dev->disk)
		return -EBUSY;
	for (i = 0; i < dev->nslabs; i++) {
		if (!dev->slabs[i].peer) {
			pr_err("farmem: slab %u has no lease: add_slab it before start\n", i);
			return -EINVAL;
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
	blk_queue_flag_set(QUEUE_FLAG_NONROT, disk->queue);
	set_capacity(disk, dev->size_bytes >> SECTOR_SHIFT);
	ret = add_disk(disk);
	if (ret) {
		put_disk(disk);
		return ret;
	}
	dev->disk = disk;
	pr_info("farmem: farmem0: %llu bytes in %u slabs of %llu bytes\n", dev->size_bytes,
		dev->nslabs, dev->slab_bytes);
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
