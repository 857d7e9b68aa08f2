// SPDX-License-Identifier: GPL-2.0
/*
 * The control interface, /sys/kernel/farmem/ (docs/kmod.md "Interface"):
 *   version  read: the interface version ("4")
 *   control  write: one command per write(), words separated by spaces, first word the version:
 *     4 create SIZE_BYTES SLAB_BYTES [COPIES]  a device of SIZE bytes in slabs of SLAB bytes,
 *                                              each kept in COPIES (1..3, default 1) replicas
 *     4 owner CLIENT_ID_HEX32 IDENTITY         who holds the leases (kept for `slabs` only)
 *     4 peer INDEX IPV4 PORT TOKEN_HEX64 ENDPOINT
 *                                              connect to a daemon's rdma_cm port with its token;
 *                                              ENDPOINT: its control address (kept for `slabs`)
 *     4 slab INDEX PEER LEASE_ID RADDR RKEY [REPLICA]
 *                                              copy REPLICA (default 0) of slab INDEX lives at
 *                                              RADDR/RKEY on PEER
 *     4 start                                  add /dev/farmem0 (every slab given)
 *     4 rebuild INDEX REPLICA PEER LEASE_ID RADDR RKEY
 *                                              (running) copy REPLICA of slab INDEX moves to this
 *                                              new lease: copied from a live copy, returns once done
 *     4 move INDEX REPLICA PEER LEASE_ID RADDR RKEY
 *                                              (running) the same, copied from copy REPLICA's own
 *                                              (old) lease: its daemon gave notice, the lease still
 *                                              serves; the old lease is the tool's to free after
 *     4 remove                                 delete the disk, disconnect, forget everything
 *   A peer may be added while running (a daemon the device did not use yet, for a rebuild).
 *   status   read: "state=<none|created|running> size=.. slab=.. peers=N connected=N errors=N
 *            stale=N rebuilt=N rebuild_writes=N recopied=N moved=N";
 *            poll(2) for POLLPRI: it changes when the disk is added or removed or a daemon
 *            disconnects.
 *   slabs    read (root): what the module holds, for a restarted tool to re-adopt the device:
 *            "size SIZE SLAB COPIES", "owner ID IDENTITY", "peer INDEX IPV4 PORT ENDPOINT
 *            connected=0|1" and "slab INDEX PEER LEASE_ID RADDR RKEY REPLICA stale=0|1" lines.
 * A command that fails returns its errno from write() and leaves the state as it was; the reason
 * is in the kernel log.
 */
#include <linux/inet.h>
#include <linux/kobject.h>
#include <linux/module.h>
#include <linux/slab.h>
#include <linux/sysfs.h>

#include "farmem.h"

DEFINE_MUTEX(farmem_ctl_lock);
struct farmem_dev *farmem_dev0;
int farmem_major;
static struct kobject *farmem_kobj;
static struct work_struct farmem_notify_work;

static void farmem_notify_fn(struct work_struct *work)
{
	if (farmem_kobj)
		sysfs_notify(farmem_kobj, NULL, "status");
}

/* May be called from the rdma_cm handler: sysfs_notify itself runs in a work item. */
void farmem_ctl_notify(void)
{
	schedule_work(&farmem_notify_work);
}

static int farmem_cmd_peer(char *args)
{
	char ip[32], hex[2 * FARMEM_TOKEN_BYTES + 2], endpoint[FARMEM_NAME_BYTES];
	u8 token[FARMEM_TOKEN_BYTES];
	struct farmem_peer *peer;
	unsigned int index, port;
	int ret;

	/* Also while running: a rebuild may need a daemon the device does not use yet. The I/O
	 * path reaches a peer only through a slab's copy, which a rebuild sets after this. */
	if (!farmem_dev0)
		return -EINVAL;
	if (sscanf(args, "%u %31s %u %65s %79s", &index, ip, &port, hex, endpoint) != 5 ||
	    index >= FARMEM_MAX_PEERS || port == 0 || port > 65535 ||
	    strlen(hex) != 2 * FARMEM_TOKEN_BYTES || hex2bin(token, hex, FARMEM_TOKEN_BYTES))
		return -EINVAL;
	if (farmem_dev0->peers[index])
		return -EEXIST;
	peer = kzalloc(sizeof(*peer), GFP_KERNEL);
	if (!peer)
		return -ENOMEM;
	peer->index = index;
	strscpy(peer->endpoint, endpoint, sizeof(peer->endpoint));
	peer->addr.sin_family = AF_INET;
	peer->addr.sin_port = htons(port);
	if (!in4_pton(ip, -1, (u8 *)&peer->addr.sin_addr.s_addr, -1, NULL)) {
		kfree(peer);
		return -EINVAL;
	}
	ret = farmem_peer_connect(peer, token);
	memzero_explicit(token, sizeof(token));
	if (!ret && farmem_dev0->ibdev && farmem_dev0->ibdev != peer->cm_id->device) {
		pr_err("farmem: daemon %s is reached through another RDMA device than the others\n",
		       ip);
		ret = -EOPNOTSUPP;
	}
	if (ret) {
		farmem_peer_destroy(peer);
		return ret;
	}
	farmem_dev0->ibdev = peer->cm_id->device;
	farmem_dev0->peers[index] = peer;
	return 0;
}

static int farmem_cmd_slab(char *args)
{
	unsigned int index, peer, replica = 0, r;
	unsigned long long lease_id, raddr;
	unsigned int rkey;
	struct farmem_replica *rep;
	int n;

	if (!farmem_dev0 || farmem_dev0->disk)
		return -EINVAL;
	n = sscanf(args, "%u %u %llu %llu %u %u", &index, &peer, &lease_id, &raddr, &rkey, &replica);
	if (n < 5 || index >= farmem_dev0->nslabs || peer >= FARMEM_MAX_PEERS ||
	    !farmem_dev0->peers[peer] || replica >= farmem_dev0->replicas)
		return -EINVAL;
	for (r = 0; r < farmem_dev0->replicas; r++) {
		/* Copies on one daemon would be lost together. */
		if (r != replica && farmem_dev0->slabs[index].r[r].peer == farmem_dev0->peers[peer])
			return -EINVAL;
	}
	rep = &farmem_dev0->slabs[index].r[replica];
	rep->peer = farmem_dev0->peers[peer];
	rep->lease_id = lease_id;
	rep->remote_addr = raddr;
	rep->rkey = rkey;
	return 0;
}

/*
 * `rebuild S R PEER LEASE RADDR RKEY`: copy R of slab S onto a new lease (farmem_rebuild.c),
 * copied from another live copy; `move ...` (move): copied from copy R's own old lease.
 */
static int farmem_cmd_rebuild(char *args, bool move)
{
	unsigned int index, replica, peer, rkey;
	unsigned long long lease_id, raddr;

	if (sscanf(args, "%u %u %u %llu %llu %u", &index, &replica, &peer, &lease_id, &raddr,
		   &rkey) != 6)
		return -EINVAL;
	return farmem_dev_rebuild(index, replica, peer, lease_id, raddr, rkey, move);
}

/* `owner CLIENT_ID IDENTITY`: 32 hex digits and a name; the module only keeps them. */
static int farmem_cmd_owner(char *args)
{
	char id[FARMEM_NAME_BYTES], identity[FARMEM_NAME_BYTES];
	u8 bin[16];

	if (!farmem_dev0)
		return -EINVAL;
	if (sscanf(args, "%79s %79s", id, identity) != 2 || strlen(id) != 2 * sizeof(bin) ||
	    hex2bin(bin, id, sizeof(bin)))
		return -EINVAL;
	strscpy(farmem_dev0->owner_id, id, sizeof(farmem_dev0->owner_id));
	strscpy(farmem_dev0->owner_identity, identity, sizeof(farmem_dev0->owner_identity));
	return 0;
}

static ssize_t control_store(struct kobject *kobj, struct kobj_attribute *attr, const char *buf,
			     size_t count)
{
	char *line, *args, *verb;
	unsigned int version;
	int ret = -EINVAL, n = 0;

	line = kstrndup(buf, count, GFP_KERNEL);
	if (!line)
		return -ENOMEM;
	strim(line);
	if (sscanf(line, "%u %n", &version, &n) != 1 || version != FARMEM_IFACE_VERSION) {
		pr_err("farmem: control: commands start with the interface version %d\n",
		       FARMEM_IFACE_VERSION);
		kfree(line);
		return -EPROTO;
	}
	args = line + n;
	verb = strsep(&args, " ");
	if (!args)
		args = "";
	mutex_lock(&farmem_ctl_lock);
	if (!strcmp(verb, "create")) {
		unsigned long long size, slab;
		unsigned int copies = 1;

		if (sscanf(args, "%llu %llu %u", &size, &slab, &copies) >= 2)
			ret = farmem_dev_create(size, slab, copies);
	} else if (!strcmp(verb, "owner")) {
		ret = farmem_cmd_owner(args);
	} else if (!strcmp(verb, "peer")) {
		ret = farmem_cmd_peer(args);
	} else if (!strcmp(verb, "slab")) {
		ret = farmem_cmd_slab(args);
	} else if (!strcmp(verb, "rebuild")) {
		ret = farmem_cmd_rebuild(args, false);
	} else if (!strcmp(verb, "move")) {
		ret = farmem_cmd_rebuild(args, true);
	} else if (!strcmp(verb, "start")) {
		ret = farmem_dev_start();
	} else if (!strcmp(verb, "remove")) {
		farmem_dev_destroy();
		ret = 0;
	} else {
		pr_err("farmem: control: unknown command '%s'\n", verb);
	}
	mutex_unlock(&farmem_ctl_lock);
	if (ret)
		pr_err("farmem: control: '%s' failed: %d\n", verb, ret);
	kfree(line);
	if (!ret)
		farmem_ctl_notify();
	return ret ? ret : count;
}

static ssize_t status_show(struct kobject *kobj, struct kobj_attribute *attr, char *buf)
{
	struct farmem_dev *dev;
	int i, peers = 0, connected = 0, stale = 0;
	s64 errors = 0;
	ssize_t n;

	mutex_lock(&farmem_ctl_lock);
	dev = farmem_dev0;
	if (!dev) {
		mutex_unlock(&farmem_ctl_lock);
		return sysfs_emit(buf, "state=none\n");
	}
	for (i = 0; i < FARMEM_MAX_PEERS; i++) {
		if (!dev->peers[i])
			continue;
		peers++;
		connected += READ_ONCE(dev->peers[i]->connected);
		errors += atomic64_read(&dev->peers[i]->errors);
	}
	for (i = 0; i < dev->nslabs; i++)
		stale += hweight_long(READ_ONCE(dev->slabs[i].stale));
	n = sysfs_emit(buf,
		       "state=%s size=%llu slab=%llu copies=%u peers=%d connected=%d errors=%lld stale=%d rebuilt=%llu rebuild_writes=%lld recopied=%llu moved=%llu\n",
		       dev->disk ? "running" : "created", dev->size_bytes, dev->slab_bytes,
		       dev->replicas, peers, connected, errors, stale, dev->rebuilt,
		       atomic64_read(&dev->rebuild_writes), dev->recopied, dev->moved);
	mutex_unlock(&farmem_ctl_lock);
	return n;
}

/* Renders `slabs` (see the top of this file) into a fresh buffer; *len is its length. */
static char *farmem_render_slabs(size_t *len)
{
	struct farmem_dev *dev = farmem_dev0;
	size_t cap, n = 0;
	char *buf;
	u32 s, r;
	int i;

	if (!dev) {
		*len = 0;
		return NULL;
	}
	cap = 512 + FARMEM_MAX_PEERS * (64 + FARMEM_NAME_BYTES) +
	      (size_t)dev->nslabs * dev->replicas * 96;
	buf = kvmalloc(cap, GFP_KERNEL);
	if (!buf)
		return ERR_PTR(-ENOMEM);
	n += scnprintf(buf + n, cap - n, "size %llu %llu %u\n", dev->size_bytes, dev->slab_bytes,
		       dev->replicas);
	if (dev->owner_id[0])
		n += scnprintf(buf + n, cap - n, "owner %s %s\n", dev->owner_id,
			       dev->owner_identity);
	for (i = 0; i < FARMEM_MAX_PEERS; i++) {
		struct farmem_peer *p = dev->peers[i];

		if (p)
			n += scnprintf(buf + n, cap - n, "peer %d %pI4 %u %s connected=%d\n", i,
				       &p->addr.sin_addr, ntohs(p->addr.sin_port), p->endpoint,
				       READ_ONCE(p->connected) ? 1 : 0);
	}
	for (s = 0; s < dev->nslabs; s++) {
		for (r = 0; r < dev->replicas; r++) {
			struct farmem_replica *rep = &dev->slabs[s].r[r];

			if (!rep->peer)
				continue;
			n += scnprintf(buf + n, cap - n, "slab %u %d %llu %llu %u %u stale=%d\n", s,
				       rep->peer->index, rep->lease_id, rep->remote_addr, rep->rkey,
				       r, test_bit(r, &dev->slabs[s].stale) ? 1 : 0);
		}
	}
	*len = n;
	return buf;
}

/* A binary attribute: a sysfs text file holds at most a page, and `slabs` has a line per slab. */
static ssize_t slabs_read(struct file *file, struct kobject *kobj, struct bin_attribute *attr,
			  char *out, loff_t off, size_t count)
{
	size_t len = 0;
	char *buf;

	mutex_lock(&farmem_ctl_lock);
	buf = farmem_render_slabs(&len);
	mutex_unlock(&farmem_ctl_lock);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	if (off >= len) {
		count = 0;
	} else {
		count = min_t(size_t, count, len - off);
		memcpy(out, buf + off, count);
	}
	kvfree(buf);
	return count;
}

static ssize_t version_show(struct kobject *kobj, struct kobj_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%d\n", FARMEM_IFACE_VERSION);
}

static struct kobj_attribute control_attr = __ATTR_WO(control);
static struct kobj_attribute status_attr = __ATTR_RO(status);
static struct kobj_attribute version_attr = __ATTR_RO(version);
static struct attribute *farmem_attrs[] = {
	&control_attr.attr,
	&status_attr.attr,
	&version_attr.attr,
	NULL,
};
static BIN_ATTR(slabs, 0400, slabs_read, NULL, 0);
static struct bin_attribute *farmem_bin_attrs[] = {
	&bin_attr_slabs,
	NULL,
};
static const struct attribute_group farmem_group = {
	.attrs = farmem_attrs,
	.bin_attrs = farmem_bin_attrs,
};

int farmem_ctl_init(void)
{
	int ret;

	INIT_WORK(&farmem_notify_work, farmem_notify_fn);
	farmem_kobj = kobject_create_and_add("farmem", kernel_kobj);
	if (!farmem_kobj)
		return -ENOMEM;
	ret = sysfs_create_group(farmem_kobj, &farmem_group);
	if (ret) {
		kobject_put(farmem_kobj);
		farmem_kobj = NULL;
	}
	return ret;
}

void farmem_ctl_exit(void)
{
	struct kobject *kobj = farmem_kobj;

	sysfs_remove_group(kobj, &farmem_group); /* waits for running control writes */
	farmem_kobj = NULL;
	flush_work(&farmem_notify_work);
	kobject_put(kobj);
}
