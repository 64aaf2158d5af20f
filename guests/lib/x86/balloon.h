/*
 * A virtio-balloon driver for probe guests (virtio 1.2, 5.5), on the kit's
 * virtio.c, all queues polled (no interrupts; the target is read from
 * config space when the guest looks). Queues are numbered as Linux does:
 * inflate 0, deflate 1, then stats and reporting if negotiated.
 */
#ifndef LUCID_BALLOON_H
#define LUCID_BALLOON_H

#include "virtio.h"

#define VIRTIO_DEV_BALLOON		0x1045
#define VIRTIO_BALLOON_F_MUST_TELL_HOST	0
#define VIRTIO_BALLOON_F_STATS_VQ	1
#define VIRTIO_BALLOON_F_DEFLATE_ON_OOM	2
#define VIRTIO_BALLOON_F_FREE_PAGE_HINT	3
#define VIRTIO_BALLOON_F_PAGE_POISON	4
#define VIRTIO_BALLOON_F_REPORTING	5

/* statistics tags */
#define VIRTIO_BALLOON_S_SWAP_IN	0
#define VIRTIO_BALLOON_S_SWAP_OUT	1
#define VIRTIO_BALLOON_S_MAJFLT		2
#define VIRTIO_BALLOON_S_MINFLT		3
#define VIRTIO_BALLOON_S_MEMFREE	4
#define VIRTIO_BALLOON_S_MEMTOT		5
#define VIRTIO_BALLOON_S_AVAIL		6
#define VIRTIO_BALLOON_S_CACHES		7
#define BALLOON_NSTATS			8

#define BALLOON_PFNS_PER_BUF		256	/* as Linux: one 1 KiB array per request */

struct balloon_stat {
	u16 tag;
	u64 val;
} __attribute__((packed));

struct balloon {
	struct virtio_dev dev;
	struct virtq *inflq, *deflq, *statsq, *repq;	/* NULL if not negotiated */
	u32 *pfns;				/* BALLOON_PFNS_PER_BUF entries */
	struct balloon_stat *stats;		/* BALLOON_NSTATS entries */
	int stats_held;				/* the device holds the stats buffer */
	u64 stats_sent;				/* stats buffers given to the device */
	u64 timeout_tsc;
};

/* probe the index-th balloon, negotiate (want_*: ask for the feature),
 * set up the queues; 0 on success */
int balloon_init(struct balloon *b, int index, int want_stats, int want_deflate_on_oom,
		 int want_reporting);
static inline int balloon_has(struct balloon *b, int bit)
{
	return virtio_has(&b->dev, bit);
}
/* config space: num_pages (the target, 4 KiB pages) and actual */
u32 balloon_target(struct balloon *b);
u32 balloon_actual(struct balloon *b);
void balloon_set_actual(struct balloon *b, u32 pages);
/* one inflate (deflate=0) or deflate buffer of n <= BALLOON_PFNS_PER_BUF
 * PFNs; waits until the device used it. 0 on success, -1 on timeout */
int balloon_pfns(struct balloon *b, int deflate, const u32 *pfns, int n);
/* an arbitrary chain on q (guest garbage, free page reports): n
 * descriptors of addr/len, device-writable where writable[i]; waits. */
int balloon_chain(struct balloon *b, struct virtq *q, const u64 *addr, const u32 *len,
		  const u8 *writable, int n);
/* statistics: set a value; the next buffer carries it */
void balloon_stat_set(struct balloon *b, u16 tag, u64 val);
/* gives the device a fresh stats buffer when it has given the last one back
 * (or none was sent yet). Returns 1 if a buffer was sent. */
int balloon_stats_poll(struct balloon *b);

#endif
