/*
 * DMA mapping over the VT-d driver: map(phys, len, dir) -> IOVA and
 * unmap(iova, len), with the vIOMMU paper's strategies chosen at run time
 * (param strategy=, default strict):
 *   strict        clear the PTE, invalidate the page and wait, at every
 *                 unmap (with Caching Mode every map invalidates too)
 *   shared        strict, but a map of a page that is already mapped
 *                 (same pages, permissions included) reuses its IOVA
 *                 (refcounted; found through an LRU cache of shared_cache
 *                 entries, default 256)
 *   async         clear the PTE and post the invalidation with a wait
 *                 descriptor, without waiting; the IOVA is freed (and can
 *                 be reused) only once that wait completed
 *   deferred      clear the PTE; flush the IOTLB once 250 unmaps are
 *                 pending or 10 ms after the oldest (checked on every
 *                 map/unmap and by waiting drivers every ms, by TSC)
 *   teardown256 / teardown4096
 *                 optimistic teardown: an unmapped mapping stays live for
 *                 reuse up to 10 ms, at most 256 / 4096 idle ones in a
 *                 FIFO; limits checked on every map/unmap; eviction clears
 *                 the PTE and invalidates (waiting)
 * The 10 ms limits are checked with 1 ms of slack (acting from 9 ms on), so
 * that the window, which ends when the invalidation completed, stays within
 * 10 ms while the driver keeps calling in (maps, unmaps, iommu_dma_poll()).
 * Every map with Caching Mode of fresh PTEs invalidates them and waits
 * (the emulation learns about maps only that way); reuse hits need none.
 * Counters: maps, unmaps, cycles spent in each, reuse hits, stale mappings
 * (logically unmapped, still reachable through the PTE or the IOTLB) now
 * and at most, and the longest window from logical unmap to completed
 * invalidation, in microseconds.
 */
#ifndef LUCID_IOMMU_DMA_H
#define LUCID_IOMMU_DMA_H

#include "types.h"
#include "vtd.h"

#define DMA_TO_DEVICE	1	/* the device reads */
#define DMA_FROM_DEVICE	2	/* the device writes */
#define DMA_BIDIR	3

enum iommu_strategy {
	IOMMU_STRICT, IOMMU_SHARED, IOMMU_ASYNC, IOMMU_DEFERRED, IOMMU_TEARDOWN256,
	IOMMU_TEARDOWN4096,
};

struct iommu_dma_stats {
	u64 maps, unmaps, map_cycles, unmap_cycles, reuse_hits;
	u64 stale, stale_max, window_max_us;
	/* the policy's part of the window: the oldest stale mapping's age when a
	 * flush was decided, and the longest gap between two checks of the limits
	 * (deferred / teardown); decide_max_us < 9 ms + check_gap_max_us */
	u64 decide_max_us, check_gap_max_us;
	u64 flushes;		/* invalidation batches (deferred) / evictions (teardown) */
	u64 faults_seen;
};

extern struct iommu_dma_stats iommu_stats;
extern struct vtd_domain iommu_domain;
extern int iommu_strategy;

/* "strict", ... -> strategy, -1 if unknown */
int iommu_strategy_parse(const char *s);
const char *iommu_strategy_name(int s);
/* the domain (did 1), the IOVA allocator and the caches; vtd_setup() first */
int iommu_dma_init(int strategy);
/* put requester sid in the domain */
int iommu_dma_attach(u16 sid);
/* IOVA for [phys, phys+len) (page offset kept), 0 when out of IOVA space */
u64 iommu_map(u64 phys, u64 len, int dir);
void iommu_unmap(u64 iova, u64 len);
/* apply the deferred / teardown / async limits now (also done on every map/unmap) */
void iommu_dma_poll(void);
/* TSC ticks between limit checks a waiting driver should allow: 1 ms for
 * async, deferred and teardown, 0 (no need to wake) for strict and shared */
u64 iommu_poll_tsc(void);
/* finish everything pending: invalidate what is stale (end of a run) */
void iommu_dma_drain(void);
/* read leftover fault records into faults_seen, print
 * "iommu-dma strategy=.. maps=.. ..." and report the keys to Lucid */
void iommu_dma_report(void);

/*
 * Convenience for the drivers: set the unit up (vtd_setup with fault
 * events on vector 0xe0), the strategy from `strategy=`, attach sid, turn
 * translation on. Prints what failed and returns -1 on error.
 */
int iommu_dma_setup_for(u16 sid);

#endif
