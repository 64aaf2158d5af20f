/* hello: init prints and returns the low 32 bits of FNV-1a("hello"),
 * computed through the guest's exported sym_export_hash; module_call(x)
 * returns x * 2 + the number of calls so far (state in .data/.bss). */
#include "module.h"

static const char word[] = "hello";
static u64 calls;
u64 hello_scale = 2;

long module_init(void)
{
	u64 h = sym_export_hash(word, strlen(word));
	calls = 0;
	printf("module hello: init hash=%#lx\n", h);
	return (long)(h & 0xffffffff);
}

u64 module_call(u64 arg)
{
	return arg * hello_scale + calls++;
}

void module_exit(void)
{
	printf("module hello: exit calls=%lu\n", calls);
}
