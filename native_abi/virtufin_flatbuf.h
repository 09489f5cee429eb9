/*
 * virtufin_flatbuf.h - read the input CloudEvent and write the WorkerResponse of a native
 * worker without the FlatBuffers library (ABI version 1; worker_api.fbs, GUIDE.md).
 *
 * Header-only C99, also valid C++11; needs nothing beyond the C standard library. It knows
 * one schema, worker_api.fbs, and follows the FlatBuffers binary format: little-endian
 * scalars, 32-bit offsets, 16-bit vtables, NUL-terminated strings, every scalar aligned to
 * its size from the start of the buffer. Its answers pass the official verifiers; its reader
 * checks every offset and length against the buffer's size before reading, so a malformed
 * input is refused, never read out of bounds.
 *
 *     vfb_event in;
 *     if (vfb_event_read(&in, in_buf, in_len) != VFB_OK) return VIRTUFIN_ERR_INVALID_INPUT;
 *     ...
 *     return vfb_build_result(&answer, out_buf, out_len);    (and FreeResult is free())
 *
 * Every function is reentrant: none keeps state. Names starting with vfb__ are private.
 */
#ifndef VIRTUFIN_FLATBUF_H
#define VIRTUFIN_FLATBUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Results. Each equals the VIRTUFIN_* code of the same meaning (virtufin_worker_api.h), so
 * Process may return it as it is. */
#define VFB_OK 0
#define VFB_EMALFORMED 1 /* the input is not a valid CloudEvent buffer */
#define VFB_EINVAL 2     /* builder: required field missing, duplicate extension key, too big */
#define VFB_ENOMEM 3     /* builder: malloc failed */

/* Largest buffer, in bytes, that the official verifiers accept (2^31 - 2). */
#define VFB_MAX_SIZE ((size_t)INT32_MAX - 1)

/* A string: len bytes at ptr, followed by a NUL (so ptr is a C string when it holds no NUL
 * byte). ptr is NULL when the field is absent. */
typedef struct vfb_string {
    const char *ptr;
    size_t len;
} vfb_string;

/* A byte vector; ptr is NULL when the field is absent (an empty vector has len 0). */
typedef struct vfb_bytes {
    const uint8_t *ptr;
    size_t len;
} vfb_bytes;

/* An input CloudEvent, filled by vfb_event_read. Its strings and data point into the input
 * buffer: they are valid while it is, i.e. during the Process call. */
typedef struct vfb_event {
    vfb_string id, source, type;                            /* always present */
    vfb_string specversion, datacontenttype, subject, time; /* may be absent */
    vfb_bytes data;                                         /* may be absent */
    size_t extension_count;
    const char *error; /* when vfb_event_read refused the buffer: why (a static string) */
    const uint8_t *buf_; /* private: the buffer, its length, the extensions vector */
    size_t len_, extensions_;
} vfb_event;

/* One extension attribute of an answer; value.ptr NULL leaves the value absent. */
typedef struct vfb_extension {
    vfb_string key, value;
} vfb_extension;

/* The CloudEvent of an answer. A vfb_string or vfb_bytes with ptr NULL (and len 0) is left
 * out. The extensions may come in any order: the builder writes them sorted by key, as the
 * schema requires (in O(n^2): meant for a handful). Keys must be unique. */
typedef struct vfb_new_event {
    vfb_string id, source, type;                            /* required */
    vfb_string specversion, datacontenttype, subject, time; /* optional */
    vfb_bytes data;                                         /* optional */
    const vfb_extension *extensions;
    size_t extension_count;
} vfb_new_event;

/* --- small helpers ---------------------------------------------------------------------- */

/* A vfb_string of a C string (absent when text is NULL). */
static inline vfb_string vfb_str(const char *text)
{
    vfb_string s;
    s.ptr = text;
    s.len = text ? strlen(text) : 0;
    return s;
}

/* 1 when s is present and holds exactly the C string text, else 0. */
static inline int vfb_string_is(vfb_string s, const char *text)
{
    size_t n = strlen(text);
    return s.ptr != NULL && s.len == n && memcmp(s.ptr, text, n) == 0;
}

/* --- reading ---------------------------------------------------------------------------- */

static inline uint32_t vfb__get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline size_t vfb__get16(const uint8_t *p)
{
    return (size_t)p[0] | (size_t)p[1] << 8;
}

/* A table being read: its position, its vtable's, and the vtable's size in bytes. */
typedef struct vfb__table {
    size_t pos, vtable, vsize;
} vfb__table;

/* 1 when n bytes at pos lie inside the buffer and pos is a multiple of align. */
static inline int vfb__fits(const vfb_event *r, size_t pos, size_t n, size_t align)
{
    return pos % align == 0 && n <= r->len_ && pos <= r->len_ - n;
}

/* The target of the offset at pos, or 0 when it is malformed (no target can be 0). */
static inline size_t vfb__follow(const vfb_event *r, size_t pos)
{
    uint32_t o;
    if (!vfb__fits(r, pos, 4, 4))
        return 0;
    o = vfb__get32(r->buf_ + pos);
    if (o == 0 || o > INT32_MAX || o >= r->len_ - pos)
        return 0;
    return pos + o;
}

/* Checks the table at pos and its vtable; 1 when both are sound. */
static inline int vfb__open_table(const vfb_event *r, size_t pos, vfb__table *t)
{
    uint32_t raw;
    int64_t vtable;
    if (!vfb__fits(r, pos, 4, 4))
        return 0;
    raw = vfb__get32(r->buf_ + pos); /* soffset: the vtable is at pos - soffset */
    vtable = (int64_t)pos - (raw <= INT32_MAX ? (int64_t)raw : (int64_t)raw - 4294967296LL);
    if (vtable < 0 || (uint64_t)vtable >= r->len_ || !vfb__fits(r, (size_t)vtable, 2, 2))
        return 0;
    t->pos = pos;
    t->vtable = (size_t)vtable;
    t->vsize = vfb__get16(r->buf_ + t->vtable);
    return t->vsize % 2 == 0 && vfb__fits(r, t->vtable, t->vsize, 2);
}

/* Position of the offset that field id holds, or 0 when the field is absent. */
static inline size_t vfb__field(const vfb_event *r, const vfb__table *t, unsigned id)
{
    size_t entry = 4 + 2 * (size_t)id, offset;
    if (entry + 2 > t->vsize)
        return 0;
    offset = vfb__get16(r->buf_ + t->vtable + entry);
    return offset ? t->pos + offset : 0;
}

/* Reads string field id into *s (ptr NULL when absent); 0 when it is malformed. */
static inline int vfb__read_string(const vfb_event *r, const vfb__table *t, unsigned id,
                                   vfb_string *s)
{
    size_t field = vfb__field(r, t, id), pos, n;
    s->ptr = NULL;
    s->len = 0;
    if (!field)
        return 1;
    pos = vfb__follow(r, field);
    if (!pos || !vfb__fits(r, pos, 4, 4))
        return 0;
    n = vfb__get32(r->buf_ + pos);
    if (n >= r->len_ - pos - 4 || r->buf_[pos + 4 + n] != 0) /* n bytes, then a NUL */
        return 0;
    s->ptr = (const char *)r->buf_ + pos + 4;
    s->len = n;
    return 1;
}

/* Finds vector field id: its position (0 when absent) and count of elem_size-byte elements;
 * returns 0 when it is malformed. */
static inline int vfb__read_vector(const vfb_event *r, const vfb__table *t, unsigned id,
                                   size_t elem_size, size_t *pos, size_t *count)
{
    size_t field = vfb__field(r, t, id);
    *pos = 0;
    *count = 0;
    if (!field)
        return 1;
    *pos = vfb__follow(r, field);
    if (!*pos || !vfb__fits(r, *pos, 4, 4))
        return 0;
    *count = vfb__get32(r->buf_ + *pos);
    return *count <= (r->len_ - *pos - 4) / elem_size;
}

/* Reads extension i (key required, value optional); 0 when it is malformed. */
static inline int vfb__read_extension(const vfb_event *r, size_t i, vfb_string *key,
                                      vfb_string *value)
{
    vfb__table t;
    size_t pos = vfb__follow(r, r->extensions_ + 4 + 4 * i);
    return pos && vfb__open_table(r, pos, &t) && vfb__read_string(r, &t, 0, key) &&
           key->ptr != NULL && vfb__read_string(r, &t, 1, value);
}

static inline int vfb__refuse(vfb_event *ev, const char *why)
{
    memset(ev, 0, sizeof *ev);
    ev->error = why;
    return VFB_EMALFORMED;
}

/* Verifies that buf (len bytes) holds a FlatBuffer whose root is a CloudEvent and fills *ev
 * with its fields. Returns VFB_OK, or VFB_EMALFORMED with ev->error saying why (then every
 * field of *ev is absent). Checks what the official FlatBuffers verifier checks for this
 * schema: bounds, alignment, required fields, string terminators, every extension. */
static inline int vfb_event_read(vfb_event *ev, const uint8_t *buf, int32_t len)
{
    vfb_string *strings[7];
    vfb__table t;
    size_t root, data, extensions, count, i;
    vfb_string key, value;
    memset(ev, 0, sizeof *ev);
    if (buf == NULL || len < 12)
        return vfb__refuse(ev, "not a CloudEvent: shorter than the smallest FlatBuffer");
    ev->buf_ = buf;
    ev->len_ = (size_t)len;
    root = vfb__follow(ev, 0);
    if (!root || !vfb__open_table(ev, root, &t))
        return vfb__refuse(ev, "not a CloudEvent: bad root table");
    strings[0] = &ev->id, strings[1] = &ev->source, strings[2] = &ev->type;
    strings[3] = &ev->specversion, strings[4] = &ev->datacontenttype;
    strings[5] = &ev->subject, strings[6] = &ev->time;
    for (i = 0; i < 7; i++)
        if (!vfb__read_string(ev, &t, (unsigned)i, strings[i]))
            return vfb__refuse(ev, "not a CloudEvent: bad string field");
    if (!ev->id.ptr || !ev->source.ptr || !ev->type.ptr)
        return vfb__refuse(ev, "not a CloudEvent: id, source or type missing");
    if (!vfb__read_vector(ev, &t, 7, 1, &data, &count))
        return vfb__refuse(ev, "not a CloudEvent: bad data vector");
    ev->data.ptr = data ? buf + data + 4 : NULL;
    ev->data.len = count;
    if (!vfb__read_vector(ev, &t, 8, 4, &extensions, &count))
        return vfb__refuse(ev, "not a CloudEvent: bad extensions vector");
    ev->extensions_ = extensions;
    for (i = 0; i < count; i++)
        if (!vfb__read_extension(ev, i, &key, &value))
            return vfb__refuse(ev, "not a CloudEvent: bad extension");
    ev->extension_count = count;
    return VFB_OK;
}

/* Extension i (0 <= i < ev->extension_count) of a read event, in the buffer's order (sorted
 * by key): *key and *value (value.ptr NULL when it has none). VFB_EINVAL when i is out of
 * range. */
static inline int vfb_event_extension(const vfb_event *ev, size_t i, vfb_string *key,
                                      vfb_string *value)
{
    if (i >= ev->extension_count || !vfb__read_extension(ev, i, key, value))
        return VFB_EINVAL;
    return VFB_OK;
}

/* The value of the extension named key (e.g. "correlationid"); ptr NULL when the event has
 * no such extension or it has no value. Scans them all, so it does not rely on their order. */
static inline vfb_string vfb_event_find_extension(const vfb_event *ev, const char *key)
{
    vfb_string k, v, none = {NULL, 0};
    size_t i;
    for (i = 0; i < ev->extension_count; i++)
        if (vfb_event_extension(ev, i, &k, &v) == VFB_OK && vfb_string_is(k, key))
            return v;
    return none;
}

/* --- writing ---------------------------------------------------------------------------- */

/* An answer being written front to back, every offset pointing forward. It is written twice:
 * with buf NULL to measure it, then into one malloc'ed block of that size. */
typedef struct vfb__out {
    uint8_t *buf;
    size_t pos;
    int too_big;
} vfb__out;

static inline void vfb__put(vfb__out *o, const void *src, size_t n)
{
    if (o->too_big || n > VFB_MAX_SIZE - o->pos) {
        o->too_big = 1;
        return;
    }
    if (o->buf && n)
        memcpy(o->buf + o->pos, src, n);
    o->pos += n;
}

static inline void vfb__pad(vfb__out *o, size_t align)
{
    static const uint8_t zeros[4] = {0, 0, 0, 0};
    vfb__put(o, zeros, (align - o->pos % align) % align);
}

static inline void vfb__put16(vfb__out *o, size_t v)
{
    uint8_t b[2];
    b[0] = (uint8_t)v, b[1] = (uint8_t)(v >> 8);
    vfb__put(o, b, 2);
}

static inline void vfb__put32(vfb__out *o, size_t v)
{
    uint8_t b[4];
    b[0] = (uint8_t)v, b[1] = (uint8_t)(v >> 8), b[2] = (uint8_t)(v >> 16);
    b[3] = (uint8_t)(v >> 24);
    vfb__put(o, b, 4);
}

/* Writes an offset still to be pointed (a hole); returns its position. */
static inline size_t vfb__hole(vfb__out *o)
{
    size_t pos;
    vfb__pad(o, 4);
    pos = o->pos;
    vfb__put32(o, 0);
    return pos;
}

/* Points the offset at hole to what is written next. */
static inline void vfb__link(vfb__out *o, size_t hole)
{
    size_t end = o->pos;
    if (o->buf && !o->too_big) {
        o->pos = hole;
        vfb__put32(o, end - hole);
        o->pos = end;
    }
}

/* Writes a vtable, then a table of count offset fields of which present[i] are set, linked
 * from hole; holes[i] receives the position of each present field. */
static inline void vfb__table_out(vfb__out *o, size_t hole, const int *present, unsigned count,
                                  size_t *holes)
{
    unsigned i, used = 0, last = 0;
    size_t vtable;
    for (i = 0; i < count; i++)
        if (present[i])
            used++, last = i + 1;
    vfb__pad(o, 2);
    vtable = o->pos;
    vfb__put16(o, 4 + 2 * last); /* vtable size */
    vfb__put16(o, 4 + 4 * used); /* table size */
    for (i = 0, used = 0; i < last; i++)
        vfb__put16(o, present[i] ? 4 + 4 * used++ : 0);
    vfb__pad(o, 4);
    vfb__link(o, hole);
    vfb__put32(o, o->pos - vtable); /* soffset to the vtable, which comes before */
    for (i = 0; i < count; i++)
        if (present[i])
            holes[i] = vfb__hole(o);
}

/* Writes a string (NUL-terminated, hence with_nul) or a byte vector linked from hole. */
static inline void vfb__vector_out(vfb__out *o, size_t hole, const void *ptr, size_t len,
                                   int with_nul)
{
    vfb__pad(o, 4);
    vfb__link(o, hole);
    vfb__put32(o, len);
    vfb__put(o, ptr, len);
    vfb__put(o, "", with_nul ? 1 : 0);
}

static inline int vfb__compare(vfb_string a, vfb_string b)
{
    size_t n = a.len < b.len ? a.len : b.len;
    int c = n ? memcmp(a.ptr, b.ptr, n) : 0;
    return c ? c : (a.len > b.len) - (a.len < b.len);
}

/* How many keys sort before extension i's: its index in the sorted vector. */
static inline size_t vfb__rank(const vfb_extension *ext, size_t n, size_t i)
{
    size_t j, rank = 0;
    for (j = 0; j < n; j++)
        rank += vfb__compare(ext[j].key, ext[i].key) < 0;
    return rank;
}

static inline void vfb__extensions_out(vfb__out *o, size_t hole, const vfb_extension *ext,
                                       size_t n)
{
    size_t first, i, holes[2] = {0, 0};
    int present[2];
    vfb__pad(o, 4);
    vfb__link(o, hole);
    vfb__put32(o, n);
    first = o->pos;
    for (i = 0; i < n && !o->too_big; i++)
        vfb__put32(o, 0);
    for (i = 0; i < n && !o->too_big; i++) {
        present[0] = 1;
        present[1] = ext[i].value.ptr != NULL;
        vfb__table_out(o, o->buf ? first + 4 * vfb__rank(ext, n, i) : 0, present, 2, holes);
        vfb__vector_out(o, holes[0], ext[i].key.ptr, ext[i].key.len, 1);
        if (present[1])
            vfb__vector_out(o, holes[1], ext[i].value.ptr, ext[i].value.len, 1);
    }
}

static inline void vfb__event_out(vfb__out *o, size_t hole, const vfb_new_event *ev)
{
    const vfb_string *strings[7];
    int present[9];
    size_t holes[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    unsigned i;
    strings[0] = &ev->id, strings[1] = &ev->source, strings[2] = &ev->type;
    strings[3] = &ev->specversion, strings[4] = &ev->datacontenttype;
    strings[5] = &ev->subject, strings[6] = &ev->time;
    for (i = 0; i < 7; i++)
        present[i] = strings[i]->ptr != NULL;
    present[7] = ev->data.ptr != NULL;
    present[8] = ev->extension_count > 0;
    vfb__table_out(o, hole, present, 9, holes);
    for (i = 0; i < 7; i++)
        if (present[i])
            vfb__vector_out(o, holes[i], strings[i]->ptr, strings[i]->len, 1);
    if (present[7])
        vfb__vector_out(o, holes[7], ev->data.ptr, ev->data.len, 0);
    if (present[8])
        vfb__extensions_out(o, holes[8], ev->extensions, ev->extension_count);
}

static inline void vfb__response_out(vfb__out *o, const vfb_new_event *event, vfb_string error)
{
    int present[2];
    size_t holes[2] = {0, 0};
    size_t root = vfb__hole(o);
    present[0] = event != NULL;
    present[1] = error.ptr != NULL;
    vfb__table_out(o, root, present, 2, holes);
    if (event)
        vfb__event_out(o, holes[0], event);
    if (error.ptr)
        vfb__vector_out(o, holes[1], error.ptr, error.len, 1);
    vfb__pad(o, 4);
}

static inline int vfb__usable(vfb_string s)
{
    return s.ptr != NULL || s.len == 0;
}

/* 1 when ev can be written: required fields set, no length without a pointer, unique keys. */
static inline int vfb__check_event(const vfb_new_event *ev)
{
    size_t i, j;
    if (!ev->id.ptr || !ev->source.ptr || !ev->type.ptr || (!ev->data.ptr && ev->data.len))
        return 0;
    if (!vfb__usable(ev->specversion) || !vfb__usable(ev->datacontenttype) ||
        !vfb__usable(ev->subject) || !vfb__usable(ev->time))
        return 0;
    if (ev->extension_count && !ev->extensions)
        return 0;
    for (i = 0; i < ev->extension_count; i++) {
        if (!ev->extensions[i].key.ptr || !vfb__usable(ev->extensions[i].value))
            return 0;
        for (j = 0; j < i; j++)
            if (vfb__compare(ev->extensions[i].key, ev->extensions[j].key) == 0)
                return 0;
    }
    return 1;
}

/* Writes a WorkerResponse holding event (NULL: none) and error_message (ptr NULL: none) into
 * one malloc'ed block: *out_buf (released with free()) of *out_len bytes. The low-level form:
 * it writes both or neither if asked, which the host refuses; prefer vfb_build_result and
 * vfb_build_error. Returns VFB_OK, VFB_EINVAL or VFB_ENOMEM (then *out_buf is NULL). */
static inline int vfb_build_response(const vfb_new_event *event, vfb_string error_message,
                                     uint8_t **out_buf, int32_t *out_len)
{
    vfb__out o = {NULL, 0, 0};
    size_t size;
    *out_buf = NULL;
    *out_len = 0;
    if ((event && !vfb__check_event(event)) || !vfb__usable(error_message))
        return VFB_EINVAL;
    vfb__response_out(&o, event, error_message);
    if (o.too_big)
        return VFB_EINVAL;
    size = o.pos;
    o.buf = (uint8_t *)malloc(size);
    if (!o.buf)
        return VFB_ENOMEM;
    o.pos = 0;
    vfb__response_out(&o, event, error_message);
    *out_buf = o.buf;
    *out_len = (int32_t)size;
    return VFB_OK;
}

/* Writes a WorkerResponse whose result_event is event (see vfb_build_response). */
static inline int vfb_build_result(const vfb_new_event *event, uint8_t **out_buf,
                                   int32_t *out_len)
{
    vfb_string none = {NULL, 0};
    if (!event) {
        *out_buf = NULL;
        *out_len = 0;
        return VFB_EINVAL;
    }
    return vfb_build_response(event, none, out_buf, out_len);
}

/* Writes a WorkerResponse whose error_message is message (see vfb_build_response). */
static inline int vfb_build_error(vfb_string message, uint8_t **out_buf, int32_t *out_len)
{
    if (!message.ptr) {
        *out_buf = NULL;
        *out_len = 0;
        return VFB_EINVAL;
    }
    return vfb_build_response(NULL, message, out_buf, out_len);
}

#endif /* VIRTUFIN_FLATBUF_H */
