/* sym-call: LEAD stand-in (issue 9); its lane replaces this file. */
#include "libcflat.h"

int main(void)
{
	printf("sym-call: not built yet\n");
	return 2;
}
