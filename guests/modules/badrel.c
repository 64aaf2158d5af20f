/* badrel: built with -fpic, so the address of an external variable comes
 * from the GOT (R_X86_64_REX_GOTPCRELX / GOTPCREL): a relocation type the
 * loader refuses. */
#include "module.h"

extern u64 some_guest_variable;

long module_init(void)
{
	return (long)&some_guest_variable;
}

void module_exit(void)
{
}
