/* counter: init registers a SymCall handler (SYMCALL_MODULE_COUNTER, 0x200)
 * through the exported symcall_register, so Lucid can call into the module:
 * value0 = the module's counter after adding arg0, value1 = the guest's
 * exported counter after adding 1. Exit unregisters it. */
#include "module.h"

#define SYMCALL_MODULE_COUNTER 0x200

static u64 count;

static u64 handler(const u64 args[5], u64 out[2])
{
	count += args[0];
	out[0] = count;
	out[1] = sym_export_counter_add(1);
	return 0;
}

long module_init(void)
{
	count = 0;
	if (!symcall_register(SYMCALL_MODULE_COUNTER, handler))
		return -1;
	printf("module counter: SymCall %#x registered\n", SYMCALL_MODULE_COUNTER);
	return SYMCALL_MODULE_COUNTER;
}

u64 module_call(u64 arg)
{
	count += arg;
	return count;
}

void module_exit(void)
{
	symcall_register(SYMCALL_MODULE_COUNTER, 0);
}
