/* Uses every function of virtufin_flatbuf.h (compiled as C99 and C++11 by test_native_abi). */
#include "virtufin_worker_api.h"
#include "virtufin_flatbuf.h"

int32_t Process(const VirtufinHost *host, const uint8_t *in_buf, int32_t in_len,
                uint8_t **out_buf, int32_t *out_len)
{
    vfb_event in;
    vfb_string key, value;
    vfb_extension ext[1];
    vfb_new_event ev;
    memset(&ev, 0, sizeof ev);
    if (vfb_event_read(&in, in_buf, in_len) != VFB_OK) {
        host->log(VIRTUFIN_LOG_WARN, in.error);
        return VIRTUFIN_ERR_INVALID_INPUT;
    }
    if (vfb_event_extension(&in, 0, &key, &value) == VFB_OK && vfb_string_is(key, "x"))
        return vfb_build_error(vfb_str("x"), out_buf, out_len);
    ext[0].key = vfb_str("correlationid");
    ext[0].value = vfb_event_find_extension(&in, "correlationid");
    ev.id = in.id, ev.source = in.source, ev.type = in.type, ev.data = in.data;
    ev.extensions = ext, ev.extension_count = 1;
    if (vfb_string_is(in.subject, "both"))
        return vfb_build_response(&ev, vfb_str("both"), out_buf, out_len);
    return vfb_build_result(&ev, out_buf, out_len);
}

void FreeResult(uint8_t *out_buf) { free(out_buf); }
