/* quiet: hello without the console (no exits of its own): init returns the
 * low 32 bits of FNV-1a("quiet") through the exported sym_export_hash; the
 * benchmark's module, so that load times are the loader's, not printf's. */
#include "module.h"

static const char word[] = "quiet";
static u64 calls;

long module_init(void)
{
	calls = 0;
	return (long)(sym_export_hash(word, strlen(word)) & 0xffffffff);
}

u64 module_call(u64 arg)
{
	return arg + calls++;
}

void module_exit(void)
{
	sym_export_counter_add(calls);
}
