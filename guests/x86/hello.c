/* hello: prints a greeting, exits with code=N (default 0). */
#include "libcflat.h"

int main(void)
{
	printf("hello from the lucid probe kit\n");
	return param_u64("code", 0);
}
