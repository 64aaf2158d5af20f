/*
 * The symbiotic module loader (symmod.h). It trusts nothing in the object:
 * every offset, size, index and relocation target is checked against the
 * bytes Lucid said it copied, and a bad module gets a status and a message
 * in the reply instead of a fault.
 */
#include "libcflat.h"
#include "symmod.h"
#include "symcall.h"

#define MAX_EXPORTS 32
#define MAX_MODULES 16
#define MAX_BLOCKS 64
#define MAX_SECTIONS 64
#define BLOCK_ALIGN 4096

/* ---- ELF64 ---- */
struct ehdr {
	u8 ident[16];
	u16 type, machine;
	u32 version;
	u64 entry, phoff, shoff;
	u32 flags;
	u16 ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
};
struct shdr {
	u32 name, type;
	u64 flags, addr, offset, size;
	u32 link, info;
	u64 align, entsize;
};
struct esym {
	u32 name;
	u8 info, other;
	u16 shndx;
	u64 value, size;
};
struct rela {
	u64 offset, info;
	s64 addend;
};
#define SHT_PROGBITS 1
#define SHT_SYMTAB 2
#define SHT_STRTAB 3
#define SHT_RELA 4
#define SHT_NOBITS 8
#define SHT_REL 9
#define SHF_WRITE 1
#define SHF_ALLOC 2
#define SHN_UNDEF 0
#define SHN_LORESERVE 0xff00
#define SHN_ABS 0xfff1
#define R_64 1
#define R_PC32 2
#define R_PLT32 4
#define R_32 10
#define R_32S 11

/* ---- state ---- */
static struct sym_global *G;
static struct {
	u32 magic, count;
	struct sym_export e[MAX_EXPORTS];
} exports;
static u8 *arena;
static u64 arena_size;
static u8 *objbuf;
static u64 objbuf_size;
static struct { u64 off, size; } blocks[MAX_BLOCKS];	/* sorted by off */
static u32 nblocks;
static u64 used;
static u32 last_seq;
static u32 next_id = 1;
static volatile u64 module_counter;
void (*symmod_on_load)(u32 id, u64 base, u64 size, int read_only);

struct module {
	u32 id;
	int live, read_only, sealed;
	char name[SYM_MOD_NAME_LEN];
	u64 block, block_size;		/* writable (or, not read-only, all) sections */
	u64 staged, staged_size;	/* read-only: the linked code until SEAL */
	u64 code, code_size;		/* where the code runs */
	long (*init)(void);
	void (*exit)(void);
	u64 (*call)(u64);
};
static struct module mods[MAX_MODULES];

/* ---- exports ---- */
u64 sym_export_counter_add(u64 v)
{
	return __atomic_add_fetch(&module_counter, v, __ATOMIC_RELAXED);
}

u64 sym_export_hash(const void *p, u64 n)
{
	const u8 *b = p;
	u64 h = 0xcbf29ce484222325ULL;
	for (u64 i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ULL;
	return h;
}

int symmod_export(const char *name, const void *addr)
{
	if (exports.count >= MAX_EXPORTS || strlen(name) >= SYM_EXPORT_NAME_LEN)
		return 0;
	struct sym_export *e = &exports.e[exports.count++];
	e->addr = (u64)addr;
	memcpy(e->name, name, strlen(name) + 1);
	return 1;
}

static u64 lookup(const char *name)
{
	for (u32 i = 0; i < exports.count; i++)
		if (!strcmp(exports.e[i].name, name))
			return exports.e[i].addr;
	return 0;
}

/* ---- arena: first fit over the gaps between sorted blocks ---- */
static u64 arena_alloc(u64 size)
{
	u64 at = 0;
	size = (size + BLOCK_ALIGN - 1) & ~(u64)(BLOCK_ALIGN - 1);
	if (!size || nblocks >= MAX_BLOCKS)
		return 0;
	u32 i;
	for (i = 0; i <= nblocks; i++) {
		u64 end = i < nblocks ? blocks[i].off : arena_size;
		if (end - at >= size)
			break;
		if (i < nblocks)
			at = blocks[i].off + blocks[i].size;
	}
	if (i > nblocks)
		return 0;
	for (u32 j = nblocks; j > i; j--)
		blocks[j] = blocks[j - 1];
	blocks[i].off = at;
	blocks[i].size = size;
	nblocks++;
	used += size;
	return (u64)arena + at;
}

static void arena_free(u64 addr)
{
	for (u32 i = 0; i < nblocks; i++) {
		if ((u64)arena + blocks[i].off != addr)
			continue;
		used -= blocks[i].size;
		for (u32 j = i; j + 1 < nblocks; j++)
			blocks[j] = blocks[j + 1];
		nblocks--;
		return;
	}
}

u64 symmod_arena_used(void)
{
	return used;
}

u32 symmod_loaded(void)
{
	u32 n = 0;
	for (int i = 0; i < MAX_MODULES; i++)
		n += mods[i].live;
	return n;
}

/* ---- the mailbox ---- */
static struct sym_mod_request *req(void)
{
	return (struct sym_mod_request *)G->mailbox;
}
static struct sym_mod_reply *rep(void)
{
	return (struct sym_mod_reply *)G->mailbox_reply;
}

static void publish_usage(void)
{
	rep()->arena_used = used;
	rep()->loaded = symmod_loaded();
}

void symmod_init(struct sym_global *g, void *a, u64 size)
{
	G = g;
	objbuf_size = size / 4 > (1 << 20) ? (1 << 20) : size / 4;
	objbuf_size &= ~(u64)(BLOCK_ALIGN - 1);
	arena = a;
	arena_size = (size - objbuf_size) & ~(u64)(BLOCK_ALIGN - 1);
	objbuf = (u8 *)a + arena_size;
	symmod_export("printf", printf);
	symmod_export("snprintf", snprintf);
	symmod_export("memcpy", memcpy);
	symmod_export("memset", memset);
	symmod_export("strlen", strlen);
	symmod_export("symcall_register", symcall_register);
	symmod_export("sym_export_counter_add", sym_export_counter_add);
	symmod_export("sym_export_hash", sym_export_hash);
	exports.magic = SYM_EXPORTS_MAGIC;
	last_seq = req()->seq;
	struct sym_mod_reply *r = rep();
	r->arena = (u64)arena;
	r->arena_size = arena_size;
	r->object = (u64)objbuf;
	r->object_size = objbuf_size;
	publish_usage();
	sym_seq_begin(&g->seq);
	g->exports = (u64)&exports;
	sym_seq_end(&g->seq);
	g->h.generation++;
	asm volatile("" ::: "memory");
	r->magic = SYM_MOD_LOADER_MAGIC;
}

/* ---- linking ---- */
struct link {
	const u8 *obj;
	u64 size;
	const struct ehdr *eh;
	const struct shdr *sh;
	u64 addr[MAX_SECTIONS];		/* where section i runs */
	u8 *buf[MAX_SECTIONS];		/* where its bytes are written */
	const struct shdr *symtab, *strtab;
	u64 nsyms;
	char *msg;
};

#define FAIL(st, ...) do { snprintf(l->msg, SYM_MOD_MESSAGE_LEN, __VA_ARGS__); return (st); } while (0)

static int in_obj(const struct link *l, u64 off, u64 len)
{
	return off <= l->size && len <= l->size - off;
}

static const char *str_at(const struct link *l, const struct shdr *tab, u32 off)
{
	if (off >= tab->size)
		return 0;
	const char *s = (const char *)l->obj + tab->offset + off;
	u64 max = tab->size - off;
	for (u64 i = 0; i < max; i++)
		if (!s[i])
			return s;
	return 0;
}

static u32 check_headers(struct link *l)
{
	const struct ehdr *eh = l->eh;
	if (l->size < sizeof(*eh) || memcmp(eh->ident, "\x7f" "ELF", 4))
		FAIL(SYM_EINVAL, "not an ELF object");
	if (eh->ident[4] != 2 || eh->ident[5] != 1 || eh->machine != 62)
		FAIL(SYM_EINVAL, "not an ELF64 x86-64 object");
	if (eh->type != 1)
		FAIL(SYM_EINVAL, "ELF type %u is not ET_REL", eh->type);
	if (eh->shentsize != sizeof(struct shdr) || !eh->shnum || eh->shnum > MAX_SECTIONS)
		FAIL(SYM_EINVAL, "bad section table (%u sections)", eh->shnum);
	if (!in_obj(l, eh->shoff, (u64)eh->shnum * sizeof(struct shdr)) || eh->shoff % 8)
		FAIL(SYM_EINVAL, "section table outside the object");
	l->sh = (const struct shdr *)(l->obj + eh->shoff);
	for (u32 i = 1; i < eh->shnum; i++) {
		const struct shdr *s = &l->sh[i];
		if (s->type != SHT_NOBITS && !in_obj(l, s->offset, s->size))
			FAIL(SYM_EINVAL, "section %u outside the object", i);
		if (s->align > BLOCK_ALIGN || (s->align & (s->align - 1)))
			FAIL(SYM_EINVAL, "section %u alignment %lu", i, s->align);
		if (s->type == SHT_REL)
			FAIL(SYM_ENOEXEC, "REL section %u (x86-64 uses RELA)", i);
		if (s->type == SHT_SYMTAB) {
			if (l->symtab || s->entsize != sizeof(struct esym) ||
			    s->link >= eh->shnum || l->sh[s->link].type != SHT_STRTAB ||
			    s->offset % 8)
				FAIL(SYM_EINVAL, "bad symbol table");
			l->symtab = s;
			l->strtab = &l->sh[s->link];
			l->nsyms = s->size / sizeof(struct esym);
		}
	}
	if (!l->symtab)
		FAIL(SYM_EINVAL, "no symbol table");
	return SYM_OK;
}

static const struct esym *sym(const struct link *l, u64 i)
{
	return (const struct esym *)(l->obj + l->symtab->offset) + i;
}

/* lays out the allocated sections: `ro` ones (code, read-only data of a
 * read-only module) from ro_base, the others from rw_base; with base 0 it
 * only sums the sizes */
static void layout(struct link *l, int ro_split, u64 ro_base, u8 *ro_buf, u64 rw_base,
		   u64 *ro_size, u64 *rw_size)
{
	u64 ro = 0, rw = 0;
	for (u32 i = 1; i < l->eh->shnum; i++) {
		const struct shdr *s = &l->sh[i];
		u64 a = s->align ? s->align : 1;
		l->addr[i] = 0;
		l->buf[i] = 0;
		if (!(s->flags & SHF_ALLOC))
			continue;
		if (ro_split && !(s->flags & SHF_WRITE)) {
			ro = (ro + a - 1) & ~(a - 1);
			l->addr[i] = ro_base + ro;
			l->buf[i] = ro_buf + ro;
			ro += s->size;
		} else {
			rw = (rw + a - 1) & ~(a - 1);
			l->addr[i] = rw_base + rw;
			l->buf[i] = (u8 *)(rw_base + rw);
			rw += s->size;
		}
	}
	*ro_size = ro;
	*rw_size = rw;
}

static void copy_sections(struct link *l)
{
	for (u32 i = 1; i < l->eh->shnum; i++) {
		const struct shdr *s = &l->sh[i];
		if (!(s->flags & SHF_ALLOC) || !s->size)
			continue;
		if (s->type == SHT_NOBITS)
			memset(l->buf[i], 0, s->size);
		else
			memcpy(l->buf[i], l->obj + s->offset, s->size);
	}
}

static u32 resolve(struct link *l, u64 i, u64 *out)
{
	if (i >= l->nsyms)
		FAIL(SYM_EINVAL, "relocation names symbol %lu of %lu", i, l->nsyms);
	const struct esym *s = sym(l, i);
	const char *name = str_at(l, l->strtab, s->name);
	if (!name)
		FAIL(SYM_EINVAL, "symbol %lu has a bad name", i);
	if (s->shndx == SHN_UNDEF) {
		u64 a = lookup(name);
		if (!a)
			FAIL(SYM_ENOENT, "missing symbol %s", name);
		*out = a;
	} else if (s->shndx == SHN_ABS) {
		*out = s->value;
	} else if (s->shndx < l->eh->shnum && l->addr[s->shndx]) {
		if (s->value > l->sh[s->shndx].size)
			FAIL(SYM_EINVAL, "symbol %s outside its section", name);
		*out = l->addr[s->shndx] + s->value;
	} else {
		FAIL(SYM_EINVAL, "symbol %s in section %u, which is not loaded", name, s->shndx);
	}
	return SYM_OK;
}

static u32 relocate(struct link *l)
{
	for (u32 i = 1; i < l->eh->shnum; i++) {
		const struct shdr *rs = &l->sh[i];
		if (rs->type != SHT_RELA)
			continue;
		if (rs->info >= l->eh->shnum || rs->entsize != sizeof(struct rela) || rs->offset % 8)
			FAIL(SYM_EINVAL, "bad relocation section %u", i);
		const struct shdr *t = &l->sh[rs->info];
		if (!(t->flags & SHF_ALLOC))
			continue;	/* debug information */
		const struct rela *r = (const struct rela *)(l->obj + rs->offset);
		for (u64 k = 0; k < rs->size / sizeof(*r); k++) {
			u32 type = (u32)r[k].info;
			u64 s, width = type == R_64 ? 8 : 4;
			if (type != R_64 && type != R_PC32 && type != R_PLT32 && type != R_32 &&
			    type != R_32S)
				FAIL(SYM_ENOEXEC, "unsupported relocation type %u", type);
			if (r[k].offset > t->size || width > t->size - r[k].offset)
				FAIL(SYM_ENOEXEC, "relocation target %#lx outside its section (%lu bytes)",
				     r[k].offset, t->size);
			u32 st = resolve(l, r[k].info >> 32, &s);
			if (st)
				return st;
			u64 v = s + r[k].addend, p = l->addr[rs->info] + r[k].offset;
			u8 *where = l->buf[rs->info] + r[k].offset;
			s64 pc = (s64)(v - p);
			switch (type) {
			case R_64:
				memcpy(where, &v, 8);
				break;
			case R_PC32:
			case R_PLT32:
				if (pc != (s32)pc)
					FAIL(SYM_ENOEXEC, "relocation overflow (PC32 to %#lx)", v);
				memcpy(where, &pc, 4);
				break;
			case R_32:
				if (v != (u32)v)
					FAIL(SYM_ENOEXEC, "relocation overflow (32 to %#lx)", v);
				memcpy(where, &v, 4);
				break;
			case R_32S:
				if ((s64)v != (s32)v)
					FAIL(SYM_ENOEXEC, "relocation overflow (32S to %#lx)", v);
				memcpy(where, &v, 4);
				break;
			}
		}
	}
	return SYM_OK;
}

static u64 entry(struct link *l, const char *name)
{
	for (u64 i = 1; i < l->nsyms; i++) {
		const struct esym *s = sym(l, i);
		const char *n = str_at(l, l->strtab, s->name);
		if (n && (s->info >> 4) == 1 && s->shndx && s->shndx < l->eh->shnum &&
		    l->addr[s->shndx] && !strcmp(n, name) && s->value < l->sh[s->shndx].size)
			return l->addr[s->shndx] + s->value;
	}
	return 0;
}

static struct module *find(u32 id)
{
	for (int i = 0; i < MAX_MODULES; i++)
		if (mods[i].live && mods[i].id == id)
			return &mods[i];
	return 0;
}

static void drop(struct module *m)
{
	if (m->block)
		arena_free(m->block);
	if (m->staged)
		arena_free(m->staged);
	memset(m, 0, sizeof(*m));
}

static void run_init(struct module *m, struct sym_mod_reply *r)
{
	r->init = (u64)m->init();
	if (symmod_on_load)
		symmod_on_load(m->id, m->code, m->code_size, m->read_only);
}

static u32 do_load(const struct sym_mod_request *q, struct sym_mod_reply *r, char *msg)
{
	struct link L, *l = &L;
	struct module *m = 0;
	u64 ro_size, rw_size;
	u32 st;

	memset(l, 0, sizeof(*l));
	l->msg = msg;
	l->obj = objbuf;
	l->size = q->size;
	l->eh = (const struct ehdr *)objbuf;
	if (q->size > objbuf_size)
		FAIL(SYM_E2BIG, "too big: %lu bytes, the object buffer holds %lu", q->size, objbuf_size);
	if ((st = check_headers(l)))
		return st;
	for (int i = 0; i < MAX_MODULES; i++)
		if (!mods[i].live) {
			m = &mods[i];
			break;
		}
	if (!m)
		FAIL(SYM_ENOMEM, "too many modules (%d loaded)", MAX_MODULES);
	int ro = q->flags & SYM_MOD_FLAG_READ_ONLY;
	layout(l, ro, 0, 0, 0, &ro_size, &rw_size);
	if (ro && ro_size > q->ro_size)
		FAIL(SYM_E2BIG, "too big: %lu bytes of code, the read-only window holds %lu",
		     ro_size, q->ro_size);
	if (ro_size + rw_size > arena_size - used)
		FAIL(SYM_ENOMEM, "too big: %lu bytes, the arena has %lu free", ro_size + rw_size,
		     arena_size - used);
	memset(m, 0, sizeof(*m));
	m->live = 1;
	m->id = next_id++;
	m->read_only = ro;
	for (int i = 0; i < SYM_MOD_NAME_LEN - 1 && q->name[i]; i++)
		m->name[i] = q->name[i];
	if (rw_size && !(m->block = arena_alloc(rw_size)))
		goto nomem;
	m->block_size = rw_size;
	if (ro && ro_size && !(m->staged = arena_alloc(ro_size)))
		goto nomem;
	m->staged_size = ro ? ro_size : 0;
	layout(l, ro, q->ro_gpa, (u8 *)m->staged, m->block, &ro_size, &rw_size);
	m->code = ro ? q->ro_gpa : m->block;
	m->code_size = ro ? ro_size : rw_size;
	copy_sections(l);
	if ((st = relocate(l)))
		goto fail;
	m->init = (long (*)(void))entry(l, "module_init");
	m->exit = (void (*)(void))entry(l, "module_exit");
	m->call = (u64 (*)(u64))entry(l, "module_call");
	if (!m->init || !m->exit) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "missing symbol %s",
			 m->init ? "module_exit" : "module_init");
		st = SYM_ENOENT;
		goto fail;
	}
	r->id = m->id;
	r->base = m->code;
	r->size = m->block_size + m->staged_size;
	if (ro) {
		r->stage = SYM_MOD_STAGE_STAGED;
		r->staged = m->staged;
		r->staged_size = m->staged_size;
		return SYM_OK;
	}
	m->sealed = 1;
	run_init(m, r);
	return SYM_OK;
nomem:
	snprintf(msg, SYM_MOD_MESSAGE_LEN, "too big: %lu bytes, no room in the arena",
		 ro_size + rw_size);
	st = SYM_ENOMEM;
fail:
	drop(m);
	return st;
}

static u32 do_seal(const struct sym_mod_request *q, struct sym_mod_reply *r, char *msg)
{
	struct module *m = find(q->id);
	if (!m || !m->read_only || m->sealed) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "no read-only module %u waiting to be sealed", q->id);
		return SYM_EINVAL;
	}
	/* Lucid copied the staged code into the window: check, then run from it */
	if (memcmp((void *)m->code, (void *)m->staged, m->staged_size)) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "the read-only window does not hold the linked code");
		drop(m);
		return SYM_EFAULT;
	}
	arena_free(m->staged);
	m->staged = 0;
	m->staged_size = 0;
	m->sealed = 1;
	r->id = m->id;
	r->base = m->code;
	r->size = m->block_size;
	run_init(m, r);
	return SYM_OK;
}

static u32 do_unload(const struct sym_mod_request *q, struct sym_mod_reply *r, char *msg)
{
	struct module *m = find(q->id);
	if (!m) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "no module %u", q->id);
		return SYM_ENOENT;
	}
	r->id = m->id;
	r->base = m->code;
	if (m->sealed)
		m->exit();
	drop(m);
	return SYM_OK;
}

static u32 do_call(const struct sym_mod_request *q, struct sym_mod_reply *r, char *msg)
{
	struct module *m = find(q->id);
	if (!m || !m->sealed) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "no module %u", q->id);
		return SYM_ENOENT;
	}
	if (!m->call) {
		snprintf(msg, SYM_MOD_MESSAGE_LEN, "module %u has no module_call", q->id);
		return SYM_ENOSYS;
	}
	r->id = m->id;
	r->init = m->call(q->arg);
	return SYM_OK;
}

int symmod_poll(void)
{
	if (!G)
		return 0;
	struct sym_mod_request *q = req();
	u32 seq = q->seq;
	if (seq == last_seq)
		return 0;
	asm volatile("" ::: "memory");	/* fields after the sequence (x86: ordered) */
	last_seq = seq;
	u32 op = q->op;
	if (op == SYM_MOD_OP_NONE)		/* withdrawn */
		return 0;
	struct sym_mod_reply *r = rep();
	char msg[SYM_MOD_MESSAGE_LEN];
	u32 st;

	msg[0] = 0;
	r->stage = SYM_MOD_STAGE_DONE;
	r->id = 0;
	r->base = r->size = r->init = r->staged = r->staged_size = 0;
	switch (op) {
	case SYM_MOD_OP_LOAD: st = do_load(q, r, msg); break;
	case SYM_MOD_OP_SEAL: st = do_seal(q, r, msg); break;
	case SYM_MOD_OP_UNLOAD: st = do_unload(q, r, msg); break;
	case SYM_MOD_OP_CALL: st = do_call(q, r, msg); break;
	default:
		snprintf(msg, sizeof(msg), "unknown operation %u", op);
		st = SYM_EINVAL;
	}
	/* Lucid gave up on this request while we worked (a new sequence): undo a
	 * load it will never record, so nothing stays loaded behind its back */
	if (q->seq != seq && op == SYM_MOD_OP_LOAD && !st) {
		struct module *m = find(r->id);
		if (m) {
			if (m->sealed)
				m->exit();
			drop(m);
		}
		publish_usage();
		return 1;
	}
	for (int i = 0; i < SYM_MOD_MESSAGE_LEN; i++)
		r->message[i] = msg[i];
	r->status = st;
	r->polls++;
	publish_usage();
	asm volatile("" ::: "memory");
	r->seq = seq;
	lucid_hypercall(SYM_HC_NOTIFY, SYM_NOTIFY_MODULE_REPLY, 0, 0);
	return 1;
}
