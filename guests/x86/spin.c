/* spin: loops forever at CPL3 and never exits (for timeout/kill tests). */
#include "libcflat.h"

int main(void)
{
	printf("spin: looping forever\n");
	for (;;)
		asm volatile("" ::: "memory");
}
