/*
 * Console output on COM1. Every byte is one `outb` to 0x3f8 (one exit);
 * the line status register is not polled: virtual 16550s accept bytes at
 * once. Output of one printf() is kept together across CPUs by a spinlock.
 */
#include "libcflat.h"

volatile int print_lock;

static void lock(void)
{
	while (__atomic_exchange_n(&print_lock, 1, __ATOMIC_ACQUIRE))
		while (print_lock)
			cpu_relax();
}

static void unlock(void)
{
	__atomic_store_n(&print_lock, 0, __ATOMIC_RELEASE);
}

static void serial_write(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		outb(LUCID_SERIAL_PORT, s[i]);
}

void serial_reset(void)
{
	outb(LUCID_SERIAL_PORT + 3, 0x03);	/* LCR: 8N1, DLAB=0 */
	outb(LUCID_SERIAL_PORT + 1, 0x00);	/* IER: no interrupts */
	outb(LUCID_SERIAL_PORT + 4, 0x03);	/* MCR: DTR|RTS, no loopback */
}

void puts(const char *s)
{
	lock();
	serial_write(s, strlen(s));
	unlock();
}

struct out {
	char *buf;
	size_t size, len;
};

static void put(struct out *o, char c)
{
	if (o->len + 1 < o->size)
		o->buf[o->len] = c;
	o->len++;
}

static void put_num(struct out *o, u64 v, int base, int upper, int width,
		    int zero, int left, int neg, const char *prefix)
{
	char tmp[24];
	const char *digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
	int n = 0, plen = prefix ? strlen(prefix) : 0;

	do {
		tmp[n++] = digits[v % base];
		v /= base;
	} while (v);
	int total = n + plen + neg;
	if (!left && !zero)
		for (; total < width; width--)
			put(o, ' ');
	if (neg)
		put(o, '-');
	for (int i = 0; i < plen; i++)
		put(o, prefix[i]);
	if (!left && zero)
		for (; total < width; width--)
			put(o, '0');
	while (n)
		put(o, tmp[--n]);
	if (left)
		for (; total < width; width--)
			put(o, ' ');
}

int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap)
{
	struct out o = { buf, size, 0 };

	for (; *fmt; fmt++) {
		if (*fmt != '%') {
			put(&o, *fmt);
			continue;
		}
		int zero = 0, left = 0, alt = 0, width = 0, lng = 0;
		for (;; fmt++) {
			if (fmt[1] == '0')
				zero = 1;
			else if (fmt[1] == '-')
				left = 1;
			else if (fmt[1] == '#')
				alt = 1;
			else
				break;
		}
		fmt++;
		while (*fmt >= '0' && *fmt <= '9')
			width = width * 10 + (*fmt++ - '0');
		while (*fmt == 'l' || *fmt == 'z')
			lng++, fmt++;
		switch (*fmt) {
		case 'd':
		case 'i': {
			s64 v = lng ? va_arg(ap, s64) : va_arg(ap, int);
			put_num(&o, v < 0 ? -(u64)v : (u64)v, 10, 0, width, zero, left, v < 0, NULL);
			break;
		}
		case 'u':
			put_num(&o, lng ? va_arg(ap, u64) : va_arg(ap, unsigned), 10, 0, width, zero, left, 0, NULL);
			break;
		case 'x':
		case 'X':
			put_num(&o, lng ? va_arg(ap, u64) : va_arg(ap, unsigned), 16, *fmt == 'X',
				width, zero, left, 0, alt ? "0x" : NULL);
			break;
		case 'p':
			put_num(&o, (u64)va_arg(ap, void *), 16, 0, width, zero, left, 0, "0x");
			break;
		case 'c':
			put(&o, (char)va_arg(ap, int));
			break;
		case 's': {
			const char *s = va_arg(ap, const char *);
			int n;
			if (!s)
				s = "(null)";
			n = strlen(s);
			if (!left)
				for (; n < width; width--)
					put(&o, ' ');
			while (*s)
				put(&o, *s++);
			if (left)
				for (; n < width; width--)
					put(&o, ' ');
			break;
		}
		case '%':
			put(&o, '%');
			break;
		case 0:
			fmt--;
			break;
		default:
			put(&o, '%');
			put(&o, *fmt);
		}
	}
	if (size)
		buf[o.len < size ? o.len : size - 1] = 0;
	return o.len;
}

int snprintf(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	return n;
}

int printf(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	lock();
	serial_write(buf, n < (int)sizeof(buf) ? (size_t)n : sizeof(buf) - 1);
	unlock();
	return n;
}
