/* bigbss: a valid module whose .bss (64 MiB) does not fit any arena: "too big". */
#include "module.h"

char bigbss_buffer[64 << 20];

long module_init(void)
{
	bigbss_buffer[0] = 1;
	return bigbss_buffer[0];
}

void module_exit(void)
{
}
