/*
 * Kernel command line: whitespace-separated tokens "key=value" or "key".
 * setup.c copies the VMM's string into boot_cmdline_buf at start-up; here
 * a second copy is split into NUL-terminated tokens for lookups.
 */
#include "libcflat.h"

extern char boot_cmdline_buf[];
static char tokens[4096];
static int ntokens;

void params_init(void)
{
	size_t n = strlen(boot_cmdline_buf);
	memcpy(tokens, boot_cmdline_buf, n + 1);
	int in = 0;
	for (size_t i = 0; i < n; i++) {
		char c = tokens[i];
		if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
			tokens[i] = 0;
			in = 0;
		} else if (!in) {
			in = 1;
			ntokens++;
		}
	}
	tokens[n] = 0;
}

const char *boot_cmdline(void)
{
	return boot_cmdline_buf;
}

/* the token for key: points at "key" or "key=value"; last one wins */
static const char *find(const char *key)
{
	size_t klen = strlen(key), n = strlen(boot_cmdline_buf);
	const char *found = NULL;

	for (size_t i = 0; i < n;) {
		if (!tokens[i]) {
			i++;
			continue;
		}
		const char *t = &tokens[i];
		if (!strncmp(t, key, klen) && (t[klen] == '=' || t[klen] == 0))
			found = t;
		i += strlen(t);
	}
	return found;
}

int param_present(const char *key)
{
	return find(key) != NULL;
}

const char *param_str(const char *key, const char *def)
{
	const char *t = find(key);
	if (!t)
		return def;
	t += strlen(key);
	return *t == '=' ? t + 1 : "";
}

int list_has(const char *list, const char *name)
{
	size_t n = strlen(name);
	while (*list) {
		if (!strncmp(list, name, n) && (list[n] == ',' || !list[n]))
			return 1;
		while (*list && *list != ',')
			list++;
		if (*list == ',')
			list++;
	}
	return 0;
}

static int parse_u64(const char *s, u64 *out)
{
	u64 v = 0;
	int base = 10, digits = 0;

	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
		base = 16, s += 2;
	for (;; s++) {
		int d;
		if (*s >= '0' && *s <= '9')
			d = *s - '0';
		else if (base == 16 && *s >= 'a' && *s <= 'f')
			d = *s - 'a' + 10;
		else if (base == 16 && *s >= 'A' && *s <= 'F')
			d = *s - 'A' + 10;
		else
			break;
		v = v * base + d;
		digits++;
	}
	if (!digits)
		return -1;
	switch (*s) {
	case 'k': case 'K': v <<= 10; s++; break;
	case 'm': case 'M': v <<= 20; s++; break;
	case 'g': case 'G': v <<= 30; s++; break;
	}
	if (*s)
		return -1;
	*out = v;
	return 0;
}

u64 param_u64(const char *key, u64 def)
{
	const char *s = param_str(key, NULL);
	u64 v;

	if (!s)
		return def;
	if (parse_u64(s, &v)) {
		printf("warning: bad number in %s=%s, using %lu\n", key, s, def);
		return def;
	}
	return v;
}
