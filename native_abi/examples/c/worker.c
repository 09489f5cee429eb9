/*
 * worker.c - the example native worker in C, on virtufin_flatbuf.h (see GUIDE.md).
 *
 * By the input event's subject:
 *   (any other)  answers <type>.processed from /native/c-example: the data with its ASCII
 *                letters upper-cased, extensions correlationid (copied), workerid, engine.
 *   "gateway"    calls the gateway's echo.ping with the data as the JSON request and answers
 *                its JSON response the same way, or an error_message when the call fails.
 *   "fail"       answers the error_message "asked to fail".
 *   "rc"         returns VIRTUFIN_ERR_INTERNAL: a failed delivery, retried.
 *
 * Reentrant: the only global is the identity, written once while the library loads.
 */
#include <stdlib.h>
#include <string.h>

#include "virtufin_flatbuf.h"
#include "virtufin_worker_api.h"

/* VIRTUFIN_WORKER_ID, read by a library constructor, which runs inside dlopen: the engine
 * sets the variable before loading this copy of the library, and another worker loaded later
 * in the same process changes it, so a lazy read (pthread_once in the first Process call)
 * could see the wrong worker's value. GCC and Clang both support constructors. */
static char *worker_id;

__attribute__((constructor)) static void read_identity(void)
{
    const char *id = getenv("VIRTUFIN_WORKER_ID");
    worker_id = strdup(id ? id : "unknown");
}

__attribute__((destructor)) static void forget_identity(void)
{
    free(worker_id);
}

/* a followed by b and a NUL, malloc'ed (NULL when out of memory). */
static char *join(const char *a, size_t a_len, const char *b, size_t b_len)
{
    char *s = malloc(a_len + b_len + 1);
    if (s) {
        memcpy(s, a, a_len);
        memcpy(s + a_len, b, b_len);
        s[a_len + b_len] = '\0';
    }
    return s;
}

/* The answer to in: <type>.processed carrying data and content_type. */
static int32_t answer(const vfb_event *in, vfb_bytes data, vfb_string content_type,
                      uint8_t **out_buf, int32_t *out_len)
{
    vfb_extension ext[3];
    vfb_new_event ev = {0};
    size_t count = 0;
    int32_t rc;
    char *type = join(in->type.ptr, in->type.len, ".processed", strlen(".processed"));
    if (!type)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    ext[count].key = vfb_str("correlationid");
    ext[count].value = vfb_event_find_extension(in, "correlationid");
    count += ext[count].value.ptr != NULL;
    ext[count].key = vfb_str("workerid"), ext[count++].value = vfb_str(worker_id);
    ext[count].key = vfb_str("engine"), ext[count++].value = vfb_str("c");
    ev.id = in->id;
    ev.source = vfb_str("/native/c-example");
    ev.type = vfb_str(type);
    ev.specversion = vfb_str("1.0");
    ev.datacontenttype = content_type;
    ev.data = data;
    ev.extensions = ext;
    ev.extension_count = count;
    rc = vfb_build_result(&ev, out_buf, out_len);
    free(type);
    return rc;
}

/* The input's data with its ASCII letters upper-cased, then the answer. */
static int32_t upper_case(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    vfb_bytes data = in->data;
    uint8_t *upper = malloc(data.len ? data.len : 1);
    size_t i;
    int32_t rc;
    if (!upper)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    for (i = 0; i < data.len; i++) {
        uint8_t c = data.ptr[i];
        upper[i] = c >= 'a' && c <= 'z' ? (uint8_t)(c - 'a' + 'A') : c;
    }
    if (data.ptr)
        data.ptr = upper;
    rc = answer(in, data, in->datacontenttype, out_buf, out_len);
    free(upper);
    return rc;
}

/* Calls echo.ping with the input's data; answers its response, or why it failed. */
static int32_t call_gateway(const VirtufinHost *host, const vfb_event *in, uint8_t **out_buf,
                            int32_t *out_len)
{
    static const char prefix[] = "gateway call failed: ";
    uint8_t *response = NULL;
    int32_t response_len = 0, rc;
    int32_t status = host->gateway_call("echo", "ping", in->data.ptr, (int32_t)in->data.len,
                                        &response, &response_len);
    vfb_bytes body;
    body.ptr = response ? response : (const uint8_t *)"";
    body.len = response && response_len > 0 ? (size_t)response_len : 0;
    if (status == VIRTUFIN_GATEWAY_OK) {
        rc = answer(in, body, vfb_str("application/json"), out_buf, out_len);
    } else {
        char *text = join(prefix, strlen(prefix), (const char *)body.ptr, body.len);
        vfb_string message;
        message.ptr = text;
        message.len = strlen(prefix) + body.len; /* the response may hold a NUL */
        rc = text ? vfb_build_error(message, out_buf, out_len) : VIRTUFIN_ERR_OUT_OF_MEMORY;
        free(text);
    }
    if (response)
        host->free_response(response);
    return rc;
}

static void log_processing(const VirtufinHost *host, vfb_string id)
{
    static const char prefix[] = "processing ";
    char *message = join(prefix, strlen(prefix), id.ptr, id.len);
    if (message)
        host->log(VIRTUFIN_LOG_INFO, message);
    free(message);
}

int32_t Process(const VirtufinHost *host, const uint8_t *in_buf, int32_t in_len,
                uint8_t **out_buf, int32_t *out_len)
{
    vfb_event in;
    *out_buf = NULL;
    *out_len = 0;
    if (!worker_id)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    if (vfb_event_read(&in, in_buf, in_len) != VFB_OK) {
        host->log(VIRTUFIN_LOG_WARN, in.error);
        return VIRTUFIN_ERR_INVALID_INPUT;
    }
    log_processing(host, in.id);
    if (vfb_string_is(in.subject, "rc"))
        return VIRTUFIN_ERR_INTERNAL;
    if (vfb_string_is(in.subject, "fail"))
        return vfb_build_error(vfb_str("asked to fail"), out_buf, out_len);
    if (vfb_string_is(in.subject, "gateway"))
        return call_gateway(host, &in, out_buf, out_len);
    return upper_case(&in, out_buf, out_len);
}

void FreeResult(uint8_t *out_buf)
{
    free(out_buf);
}
