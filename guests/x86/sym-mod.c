/*
 * sym-mod: the symbiotic module loader's guest (docs/symbiotic.md §7).
 * Discovers Lucid, registers its SymSpy pages and SymCall entry, starts the
 * module loader (symmod.c) on an arena in RAM and polls the mailbox at CPL3
 * until `ms` milliseconds passed (0: until the VM is stopped).
 *
 * Parameters: ms=N, arena=GPA (default 8 MiB), arena_size=N (default
 * 2 MiB), poll_after_ms=N (the loader is ready but does not poll for N ms:
 * Lucid's requests time out meanwhile), try_write_ro=1 (after a read-only
 * module's init, write into its code and check the byte did not change).
 *
 * Prints `sym-mod: ready ...`, one `ro_write blocked=B` line per read-only
 * module with try_write_ro, and at the end `requests= loaded= arena_used=
 * module_counter= ro_checked= ro_blocked=`. Exit 0; 1 if a read-only write
 * went through; 2 not symbiotic or setup failed.
 */
#include "libcflat.h"
#include "sym.h"
#include "symcall.h"
#include "symmod.h"

static struct sym_global g;
static struct sym_vcpu v0;
static int try_ro;
static u64 ro_checked, ro_blocked;

static void on_load(u32 id, u64 base, u64 size, int read_only)
{
	if (!read_only || !try_ro || !size)
		return;
	volatile u8 *p = (volatile u8 *)base;
	u8 before = p[0];
	p[0] = before ^ 0xff;	/* a write to a read-only slot: an MMIO exit Lucid drops */
	u8 after = p[0];
	ro_checked++;
	ro_blocked += after == before;
	printf("ro_write blocked=%d id=%u base=%#lx\n", after == before, id, base);
}

static u64 ms_to_tsc(u64 ms)
{
	u64 khz = tsc_khz();
	return (khz ? khz : 1000000) * ms;
}

int main(void)
{
	u32 f = sym_discover();
	if (!f) {
		printf("sym: not offered\n");
		return 2;
	}
	if (!(f & SYM_FEAT_MODULES)) {
		printf("sym: modules not offered (features %#x)\n", f);
		return 2;
	}
	long rc = sym_register_global(&g);
	if (rc) {
		printf("sym: registration refused (%ld)\n", rc);
		return 2;
	}
	symcall_init(&g);
	symcall_attach_cpu(&v0, 0);
	rc = sym_register_vcpu(&v0, 0);
	if (rc) {
		printf("sym: vCPU registration refused (%ld)\n", rc);
		return 2;
	}
	u64 arena = param_u64("arena", 0x800000), size = param_u64("arena_size", 0x200000);
	if (ram_region_end(arena) < arena + size) {
		printf("sym-mod: arena %#lx+%#lx is not RAM\n", arena, size);
		return 2;
	}
	try_ro = param_u64("try_write_ro", 0) != 0;
	symmod_on_load = on_load;
	symmod_init(&g, (void *)arena, size);
	printf("sym-mod: ready arena=%#lx size=%#lx\n", arena, size);

	u64 start = rdtsc(), wait = param_u64("poll_after_ms", 0);
	if (wait) {
		printf("sym-mod: not polling for %lu ms\n", wait);
		while (rdtsc() - start < ms_to_tsc(wait))
			cpu_relax();
		printf("sym-mod: polling\n");
	}
	u64 ms = param_u64("ms", 0), requests = 0;
	start = rdtsc();
	while (!ms || rdtsc() - start < ms_to_tsc(ms)) {
		requests += symmod_poll();
		cpu_relax();
	}
	printf("requests=%lu loaded=%u arena_used=%lu module_counter=%lu ro_checked=%lu "
	       "ro_blocked=%lu\n", requests, symmod_loaded(), symmod_arena_used(),
	       sym_export_counter_add(0), ro_checked, ro_blocked);
	return ro_checked != ro_blocked ? 1 : 0;
}
