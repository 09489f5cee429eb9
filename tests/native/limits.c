/* A native worker for the limit tests (tests/test_limits.py), by the input event's subject:
 *   "spin"  burns the CPU for ever: a call that never returns;
 *   "leak"  keeps 48 MiB more, every page touched, then answers as the others;
 *   other   answers <type>.processed with the input's data.
 */
#include <stdlib.h>
#include <string.h>

#include "virtufin_flatbuf.h"
#include "virtufin_worker_api.h"

#define LEAK_BYTES (48 << 20)
#define PAGE 4096
#define PROCESSED ".processed"

static int32_t answer(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    size_t type_len = in->type.len + strlen(PROCESSED);
    char *type = malloc(type_len);
    vfb_new_event ev = {0};
    int rc;
    if (!type)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    memcpy(type, in->type.ptr, in->type.len);
    memcpy(type + in->type.len, PROCESSED, strlen(PROCESSED));
    ev.id = in->id, ev.source = vfb_str("/native/limits");
    ev.type.ptr = type, ev.type.len = type_len;
    ev.specversion = vfb_str("1.0"), ev.datacontenttype = in->datacontenttype;
    ev.data = in->data;
    rc = vfb_build_result(&ev, out_buf, out_len);
    free(type);
    return rc == VFB_OK ? VIRTUFIN_OK : VIRTUFIN_ERR_OUT_OF_MEMORY;
}

static void spin(void)
{
    volatile unsigned long turns = 0;
    for (;;)
        turns++;
}

#define MAX_KEPT 1024
static volatile char *kept[MAX_KEPT]; /* never freed: the blocks escape, so stay written */
static int kept_count;

static int leak(void)
{
    volatile char *block = malloc(LEAK_BYTES);
    size_t i;
    if (!block || kept_count == MAX_KEPT)
        return 0;
    for (i = 0; i < LEAK_BYTES; i += PAGE)
        block[i] = 1;
    kept[kept_count++] = block;
    return 1;
}

int32_t Process(const VirtufinHost *host, const uint8_t *in_buf, int32_t in_len,
                uint8_t **out_buf, int32_t *out_len)
{
    vfb_event in;
    (void)host;
    *out_buf = NULL;
    *out_len = 0;
    if (vfb_event_read(&in, in_buf, in_len) != VFB_OK)
        return VIRTUFIN_ERR_INVALID_INPUT;
    if (vfb_string_is(in.subject, "spin"))
        spin();
    if (vfb_string_is(in.subject, "leak") && !leak())
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    return answer(&in, out_buf, out_len);
}

void FreeResult(uint8_t *out_buf)
{
    free(out_buf);
}
