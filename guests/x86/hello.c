/*
 * hello: prints a greeting (lines=N times, default 1), exits with code=N
 * (default 0).
 */
#include "libcflat.h"

int main(void)
{
	for (u64 n = param_u64("lines", 1); n; n--)
		printf("hello from the lucid probe kit\n");
	return param_u64("code", 0);
}
