// SPDX-License-Identifier: GPL-2.0
/*
 * Rebuilding a lost copy of a slab (replicate:N), while the device keeps serving: the `rebuild`
 * command (docs/kmod.md "Rebuilding a copy"). The control tool has leased a replacement on a
 * daemon the slab does not use; the module
 *   1. installs it as the slab's copy R with the queue frozen for a moment (no request in flight):
 *      from then on every write to the slab also goes to it, but it serves no read (stale bit);
 *   2. copies the slab from a live copy into it, 64 KiB at a time (RDMA READ into bounce pages,
 *      RDMA WRITE from them), each chunk only while no write to it is in flight, and again if a
 *      write to it started or ended meanwhile (farmem_sync: in flight, dirty);
 *   3. clears the stale bit: the copy serves reads like the others.
 * Reads go to the surviving copy throughout; a write is never lost: one that reached the
 * survivor before a chunk's READ is in what the copier writes, one that started after the
 * chunk's last check found it clean is posted after the copier's WRITE completed.
 *
 * The `move` command is the same with the copy's own old lease as the survivor: a daemon that
 * gave notice (EVICT_NOTICE: memory pressure, a drain) still serves the lease until its
 * deadline, so even a slab's only copy (resilience none) can be moved without losing a byte.
 * The old descriptor is kept in farmem_sync.old; while the new one is being filled, every write
 * goes to both, and a read with no other live copy reads the old one. The end is installed
 * with the queue frozen too: the new copy serves, the old one is forgotten (or, if the move
 * failed, the old one is put back).
 *
 * Runs in the control write (process context, farmem_ctl_lock held), one rebuild at a time.
 */
#include <linux/blk-mq.h>
#include <linux/delay.h>
#include <linux/moduleparam.h>
#include <linux/slab.h>

#include "farmem.h"

#define FARMEM_COPY_PAGES DIV_ROUND_UP(FARMEM_SYNC_CHUNK, PAGE_SIZE)
#define FARMEM_COPY_TIMEOUT (30 * HZ) /* a work request to a dead daemon fails well before */
#define FARMEM_COPY_RETRIES 1000 /* copies of one chunk that writes kept overtaking */

/*
 * Test knob: a pause between the chunks of a rebuild, so that a test's writes land while a copy
 * is half copied (kmod_smoke_replicate; under TCG a rebuild is otherwise over before a writer
 * gets many writes in). 0, the default, in any real use.
 */
static unsigned int rebuild_chunk_delay_ms;
module_param(rebuild_chunk_delay_ms, uint, 0644);
MODULE_PARM_DESC(rebuild_chunk_delay_ms,
		 "test knob: milliseconds to pause between the 64 KiB chunks of a rebuild (default 0)");

/* The copier's bounce buffer and its one work request (one outstanding at a time). */
struct farmem_copy {
	struct ib_device *ibdev;
	struct ib_cqe cqe;
	struct completion done;
	enum ib_wc_status status;
	struct page *pages[FARMEM_COPY_PAGES];
	u64 dma[FARMEM_COPY_PAGES];
	struct ib_sge sge[FARMEM_COPY_PAGES];
	struct ib_rdma_wr wr;
};

void farmem_sync_free(struct farmem_sync *sync)
{
	kvfree(sync->inflight);
	kvfree(sync->dirty);
	sync->inflight = NULL;
	sync->dirty = NULL;
}

static int farmem_sync_alloc(struct farmem_dev *dev)
{
	struct farmem_sync *sync = &dev->sync;

	if (sync->inflight)
		return 0;
	sync->nchunks = DIV_ROUND_UP_ULL(dev->slab_bytes, FARMEM_SYNC_CHUNK);
	sync->inflight = kvcalloc(sync->nchunks, sizeof(*sync->inflight), GFP_KERNEL);
	sync->dirty = kvcalloc(BITS_TO_LONGS(sync->nchunks), sizeof(long), GFP_KERNEL);
	if (!sync->inflight || !sync->dirty) {
		farmem_sync_free(sync);
		return -ENOMEM;
	}
	return 0;
}

static void farmem_copy_done(struct ib_cq *cq, struct ib_wc *wc)
{
	struct farmem_copy *cp = container_of(wc->wr_cqe, struct farmem_copy, cqe);

	cp->status = wc->status;
	complete(&cp->done);
}

static void farmem_copy_free(struct farmem_copy *cp)
{
	int i;

	for (i = 0; i < FARMEM_COPY_PAGES; i++) {
		if (!cp->pages[i])
			continue;
		if (cp->dma[i])
			ib_dma_unmap_page(cp->ibdev, cp->dma[i], PAGE_SIZE, DMA_BIDIRECTIONAL);
		__free_page(cp->pages[i]);
	}
	kfree(cp);
}

static struct farmem_copy *farmem_copy_alloc(struct ib_device *ibdev)
{
	struct farmem_copy *cp = kzalloc(sizeof(*cp), GFP_KERNEL);
	int i;

	if (!cp)
		return NULL;
	cp->ibdev = ibdev;
	cp->cqe.done = farmem_copy_done;
	init_completion(&cp->done);
	for (i = 0; i < FARMEM_COPY_PAGES; i++) {
		cp->pages[i] = alloc_page(GFP_KERNEL);
		if (!cp->pages[i])
			goto fail;
		cp->dma[i] = ib_dma_map_page(ibdev, cp->pages[i], 0, PAGE_SIZE, DMA_BIDIRECTIONAL);
		if (ib_dma_mapping_error(ibdev, cp->dma[i])) {
			cp->dma[i] = 0;
			goto fail;
		}
	}
	return cp;
fail:
	farmem_copy_free(cp);
	return NULL;
}

/* One RDMA READ or WRITE of len bytes between the bounce pages and copy `rep` at off. */
static int farmem_copy_op(struct farmem_copy *cp, struct farmem_replica *rep, u64 off, u32 len,
			  enum ib_wr_opcode opcode)
{
	const struct ib_send_wr *bad;
	int i, n = DIV_ROUND_UP(len, PAGE_SIZE), ret;

	for (i = 0; i < n; i++) {
		cp->sge[i].addr = cp->dma[i];
		cp->sge[i].length = min_t(u32, PAGE_SIZE, len - i * PAGE_SIZE);
		cp->sge[i].lkey = rep->peer->pd->local_dma_lkey;
	}
	memset(&cp->wr, 0, sizeof(cp->wr));
	cp->wr.wr.wr_cqe = &cp->cqe;
	cp->wr.wr.sg_list = cp->sge;
	cp->wr.wr.num_sge = n;
	cp->wr.wr.opcode = opcode;
	cp->wr.wr.send_flags = IB_SEND_SIGNALED;
	cp->wr.remote_addr = rep->remote_addr + off;
	cp->wr.rkey = rep->rkey;
	reinit_completion(&cp->done);
	ret = ib_post_send(rep->peer->qp, &cp->wr.wr, &bad);
	if (ret)
		return ret;
	if (!wait_for_completion_timeout(&cp->done, FARMEM_COPY_TIMEOUT))
		return -ETIMEDOUT; /* the work request still owns cp: the caller leaks it */
	if (cp->status != IB_WC_SUCCESS) {
		pr_err("farmem: rebuild: %s at %llu on daemon %pI4:%u failed: %s\n",
		       opcode == IB_WR_RDMA_READ ? "RDMA READ" : "RDMA WRITE", off,
		       &rep->peer->addr.sin_addr, ntohs(rep->peer->addr.sin_port),
		       ib_wc_status_msg(cp->status));
		return -EIO;
	}
	return 0;
}

/* Whether the copy the copier reads from still holds every write (FARMEM_OLD_COPY: moving). */
static bool farmem_src_live(struct farmem_dev *dev, struct farmem_slab *slab, int src)
{
	if (src == FARMEM_OLD_COPY)
		return farmem_old_usable(dev);
	return !test_bit(src, &slab->stale) && READ_ONCE(slab->r[src].peer->connected);
}

/*
 * Chunk c of the slab from copy src (FARMEM_OLD_COPY: the old lease of the copy being moved)
 * into copy r, until no write to it overtook the copy.
 */
static int farmem_copy_chunk(struct farmem_dev *dev, struct farmem_copy *cp,
			     struct farmem_slab *slab, int src, int r, u32 c)
{
	struct farmem_sync *sync = &dev->sync;
	const u64 off = (u64)c << FARMEM_SYNC_SHIFT;
	const u32 len = min_t(u64, FARMEM_SYNC_CHUNK, dev->slab_bytes - off);
	const unsigned long deadline = jiffies + FARMEM_COPY_TIMEOUT;
	unsigned long flags;
	bool clean;
	int tries, ret;

	for (tries = 0; tries < FARMEM_COPY_RETRIES; tries++) {
		/* Wait for the writes to the chunk in flight to end; then it is clean. */
		for (;;) {
			spin_lock_irqsave(&sync->lock, flags);
			clean = sync->inflight[c] == 0;
			if (clean)
				__clear_bit(c, sync->dirty);
			spin_unlock_irqrestore(&sync->lock, flags);
			if (clean)
				break;
			if (time_after(jiffies, deadline))
				return -EBUSY;
			usleep_range(50, 200);
		}
		ret = farmem_copy_op(cp, farmem_copy_of(dev, slab, src), off, len, IB_WR_RDMA_READ);
		if (!ret)
			ret = farmem_copy_op(cp, &slab->r[r], off, len, IB_WR_RDMA_WRITE);
		if (ret)
			return ret;
		/* The survivor must have taken every write the copy carries. */
		if (READ_ONCE(sync->failed) || !farmem_src_live(dev, slab, src))
			return -EIO;
		spin_lock_irqsave(&sync->lock, flags);
		clean = sync->inflight[c] == 0 && !test_bit(c, sync->dirty);
		spin_unlock_irqrestore(&sync->lock, flags);
		if (clean)
			return 0;
		dev->recopied++;
	}
	return -EBUSY;
}

/*
 * Installs (begin) or ends the copy of slab s's copy r with no request in flight: a write that
 * chose its copies before would miss the new copy and not be counted, and a request that saw
 * the old copy of a move must end before it is forgotten. New requests wait in
 * blk_queue_enter meanwhile.
 */
static int farmem_freeze(struct farmem_dev *dev)
{
	struct request_queue *q = dev->disk->queue;

	blk_freeze_queue_start(q);
	if (!blk_mq_freeze_queue_wait_timeout(q, FARMEM_COPY_TIMEOUT)) {
		blk_mq_unfreeze_queue(q);
		pr_err("farmem: rebuild: requests did not drain in %d s\n", FARMEM_COPY_TIMEOUT / HZ);
		return -ETIMEDOUT;
	}
	return 0;
}

/*
 * The end of a move, queue frozen: the new copy serves (ok), or the old one is put back as it
 * was (stale if it may have missed a write: an I/O to it failed, or its daemon went away).
 */
static void farmem_move_end(struct farmem_dev *dev, struct farmem_slab *slab, u32 r, bool ok)
{
	struct farmem_sync *sync = &dev->sync;

	if (ok) {
		clear_bit(r, &slab->stale);
	} else {
		slab->r[r] = sync->old;
		if (!farmem_old_usable(dev))
			set_bit(r, &slab->stale);
		else
			clear_bit(r, &slab->stale);
	}
	sync->moving = false;
	WRITE_ONCE(sync->slab, FARMEM_NO_SYNC);
}

int farmem_dev_rebuild(u32 s, u32 r, u32 peer_index, u64 lease_id, u64 raddr, u32 rkey,
		       bool move)
{
	struct farmem_dev *dev = farmem_dev0;
	const char *what = move ? "move" : "rebuild";
	struct farmem_peer *peer;
	struct farmem_slab *slab;
	struct farmem_copy *cp;
	int i, src = -1, ret;
	bool frozen_end;
	u32 c;

	if (!dev || !dev->disk || s >= dev->nslabs || r >= dev->replicas ||
	    peer_index >= FARMEM_MAX_PEERS || !dev->peers[peer_index])
		return -EINVAL;
	peer = dev->peers[peer_index];
	slab = &dev->slabs[s];
	if (!READ_ONCE(peer->connected)) {
		pr_err("farmem: %s: daemon %pI4:%u is not connected\n", what, &peer->addr.sin_addr,
		       ntohs(peer->addr.sin_port));
		return -ENOTCONN;
	}
	for (i = 0; i < dev->replicas; i++) {
		if (i == r)
			continue;
		if (slab->r[i].peer == peer)
			return -EINVAL; /* two copies on one daemon would be lost together */
		if (src < 0 && slab->r[i].peer && READ_ONCE(slab->r[i].peer->connected) &&
		    !test_bit(i, &slab->stale))
			src = i;
	}
	if (move) {
		/* The copy's own lease is the source: it must hold every write and be reachable. */
		if (slab->r[r].peer == peer)
			return -EINVAL; /* a second work request per request on one queue pair */
		if (!slab->r[r].peer || !READ_ONCE(slab->r[r].peer->connected) ||
		    test_bit(r, &slab->stale)) {
			pr_err("farmem: move: slab %u copy %u is stale or its daemon is not connected: rebuild it from another copy\n",
			       s, r);
			return -ENODATA;
		}
		src = FARMEM_OLD_COPY;
	} else if (src < 0) {
		pr_err("farmem: rebuild: slab %u has no live copy to copy from: its bytes are lost\n",
		       s);
		return -ENODATA;
	}
	ret = farmem_sync_alloc(dev);
	if (ret)
		return ret;
	cp = farmem_copy_alloc(dev->ibdev);
	if (!cp)
		return -ENOMEM;

	ret = farmem_freeze(dev);
	if (ret) {
		farmem_copy_free(cp);
		return ret;
	}
	dev->sync.moving = move;
	dev->sync.old_failed = false;
	if (move)
		dev->sync.old = slab->r[r];
	set_bit(r, &slab->stale);
	slab->r[r].peer = peer;
	slab->r[r].lease_id = lease_id;
	slab->r[r].remote_addr = raddr;
	slab->r[r].rkey = rkey;
	dev->sync.replica = r;
	dev->sync.failed = false;
	memset(dev->sync.inflight, 0, dev->sync.nchunks * sizeof(*dev->sync.inflight));
	bitmap_zero(dev->sync.dirty, dev->sync.nchunks);
	WRITE_ONCE(dev->sync.slab, s);
	blk_mq_unfreeze_queue(dev->disk->queue);
	/* (The copy takes seconds under load: its start is worth a line, e.g. to see it stall.) */
	pr_info("farmem: %s of slab %u copy %u to daemon %pI4:%u (lease %llu) started\n", what, s, r,
		&peer->addr.sin_addr, ntohs(peer->addr.sin_port), lease_id);

	for (c = 0; c < dev->sync.nchunks && !ret; c++) {
		ret = farmem_copy_chunk(dev, cp, slab, src, r, c);
		if (!ret && READ_ONCE(rebuild_chunk_delay_ms))
			msleep(READ_ONCE(rebuild_chunk_delay_ms));
	}
	if (move) {
		/*
		 * Requests that saw the old copy must end before it is dropped (or put back). If
		 * they do not drain, the end is installed anyway: the old descriptor stays valid
		 * memory (dev->sync.old) until the next rebuild, which freezes first.
		 */
		frozen_end = farmem_freeze(dev) == 0;
		/*
		 * A write to the new copy that failed after the last chunk: it may miss it. (One
		 * that failed on the old copy only does not matter now: every chunk was copied
		 * while the old copy held every write, and the new one took every write since.)
		 */
		if (!ret && READ_ONCE(dev->sync.failed))
			ret = -EIO;
		farmem_move_end(dev, slab, r, !ret);
		if (frozen_end)
			blk_mq_unfreeze_queue(dev->disk->queue);
	} else {
		if (!ret)
			clear_bit(r, &slab->stale); /* it holds every byte: it serves reads from now on */
		smp_mb__after_atomic();
		WRITE_ONCE(dev->sync.slab, FARMEM_NO_SYNC);
	}
	if (ret == -ETIMEDOUT)
		pr_err("farmem: %s: a work request did not complete in %d s (its bounce buffer is leaked)\n",
		       what, FARMEM_COPY_TIMEOUT / HZ);
	else
		farmem_copy_free(cp);
	if (ret) {
		if (move)
			pr_err("farmem: move of slab %u copy %u to daemon %pI4:%u failed: %d (the old lease is its copy again%s)\n",
			       s, r, &peer->addr.sin_addr, ntohs(peer->addr.sin_port), ret,
			       test_bit(r, &slab->stale) ? ", stale" : "");
		else
			pr_err("farmem: rebuild of slab %u copy %u on daemon %pI4:%u failed: %d (it stays stale)\n",
			       s, r, &peer->addr.sin_addr, ntohs(peer->addr.sin_port), ret);
		return ret;
	}
	if (move) {
		dev->moved++;
		pr_info("farmem: slab %u copy %u moved to daemon %pI4:%u (lease %llu) from its old lease %llu on %pI4:%u\n",
			s, r, &peer->addr.sin_addr, ntohs(peer->addr.sin_port), lease_id,
			dev->sync.old.lease_id, &dev->sync.old.peer->addr.sin_addr,
			ntohs(dev->sync.old.peer->addr.sin_port));
		return 0;
	}
	dev->rebuilt++;
	pr_info("farmem: slab %u copy %u rebuilt on daemon %pI4:%u (lease %llu) from copy %d\n", s,
		r, &peer->addr.sin_addr, ntohs(peer->addr.sin_port), lease_id, src);
	return 0;
}
