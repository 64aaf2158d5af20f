#include "libcflat.h"

void *memset(void *d, int c, size_t n)
{
	void *r = d;
	asm volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
	return r;
}

void *memcpy(void *d, const void *s, size_t n)
{
	void *r = d;
	asm volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) :: "memory");
	return r;
}

void *memmove(void *d, const void *s, size_t n)
{
	if ((u64)d <= (u64)s || (u64)d >= (u64)s + n)
		return memcpy(d, s, n);
	u8 *dp = d;
	const u8 *sp = s;
	while (n--)
		dp[n] = sp[n];
	return d;
}

int memcmp(const void *a, const void *b, size_t n)
{
	const u8 *x = a, *y = b;
	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i])
			return x[i] - y[i];
	return 0;
}

size_t strlen(const char *s)
{
	size_t n = 0;
	while (s[n])
		n++;
	return n;
}

int strcmp(const char *a, const char *b)
{
	while (*a && *a == *b)
		a++, b++;
	return (u8)*a - (u8)*b;
}

int strncmp(const char *a, const char *b, size_t n)
{
	for (; n; n--, a++, b++) {
		if (*a != *b)
			return (u8)*a - (u8)*b;
		if (!*a)
			return 0;
	}
	return 0;
}
