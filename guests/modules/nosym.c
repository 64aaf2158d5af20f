/* nosym: calls a function the guest does not export; the guest's loader
 * refuses it with "missing symbol sym_export_missing". */
#include "module.h"

u64 sym_export_missing(u64 v);

long module_init(void)
{
	return (long)sym_export_missing(1);
}

void module_exit(void)
{
}
