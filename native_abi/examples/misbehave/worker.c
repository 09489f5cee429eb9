/*
 * worker.c - a native worker that misbehaves on request, for the tests of the host's
 * refusals (not an example to follow). By the input event's subject:
 *   "crash"    writes through a NULL pointer (SIGSEGV)
 *   "hang"     sleeps for ever
 *   "garbage"  returns OK with 64 bytes that are not a FlatBuffer
 *   "null"     returns OK with out_buf NULL
 *   "negative" returns OK with a valid answer but out_len -5
 *   "huge"     returns OK with a 16-byte buffer but out_len 0x7fffffff
 *   "both"     answers a WorkerResponse with result_event and error_message both set
 *   "neither"  answers a WorkerResponse with neither set
 *   "threads"  logs 50 messages from each of 6 threads of its own, then answers as below
 *   "slow"     sleeps 1.5 s, then answers as any other subject does:
 *   (other)    <type>.processed from /native/misbehave, as examples/c does: data upper-cased,
 *              extensions correlationid (copied), workerid, engine "misbehave".
 *
 * Its health probe (Probe) does as the environment variable MISBEHAVE_PROBE said when the
 * library loaded:
 *   unset      logs "probe: healthy" and returns VIRTUFIN_OK
 *   "fail"     logs "probe: asked to fail" and returns VIRTUFIN_ERR_UNHEALTHY
 *   "hang"     sleeps for ever
 *   "slow"     sleeps 1.5 s, then answers as when unset
 *   "crash"    writes through a NULL pointer (SIGSEGV)
 *   (other)    returns VIRTUFIN_ERR_INTERNAL
 *
 * Every buffer handed out is recorded until FreeResult releases it, so a test can check that
 * the host frees each one exactly once: OutstandingResults() counts those not yet released,
 * FreedTwice() the FreeResult calls on a pointer not handed out or already released (such a
 * pointer is not passed to free). At most MAX_LIVE results are outstanding at once; past that
 * Process returns VIRTUFIN_ERR_OUT_OF_MEMORY.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "virtufin_flatbuf.h"
#include "virtufin_worker_api.h"

#define MAX_LIVE 1024
#define GARBAGE_BYTES 64
#define HUGE_BYTES 16
#define PROCESSED ".processed"
#define CHATTY_THREADS 6
#define CHATTY_LOGS 50

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *live[MAX_LIVE]; /* the results handed out, not yet released */
static int32_t outstanding, freed_twice;
static char *worker_id;
static const char *probe_mode; /* MISBEHAVE_PROBE's value at load, or NULL */

/* Read while the library loads, as in examples/c/worker.c. */
__attribute__((constructor)) static void read_identity(void)
{
    const char *id = getenv("VIRTUFIN_WORKER_ID");
    const char *modes[] = {"fail", "hang", "slow", "crash"};
    const char *mode = getenv("MISBEHAVE_PROBE");
    size_t i;
    worker_id = strdup(id ? id : "unknown");
    probe_mode = mode ? "other" : NULL;
    for (i = 0; mode && i < sizeof modes / sizeof modes[0]; i++)
        if (strcmp(mode, modes[i]) == 0)
            probe_mode = modes[i];
}

__attribute__((destructor)) static void forget_identity(void)
{
    free(worker_id);
}

/* Hands buf out as the answer, reporting out_len = len. */
static int32_t hand_out(uint8_t *buf, int32_t len, uint8_t **out_buf, int32_t *out_len)
{
    int i, recorded = 0;
    if (!buf)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    pthread_mutex_lock(&live_lock);
    for (i = 0; i < MAX_LIVE && !recorded; i++)
        if (!live[i])
            live[i] = buf, outstanding++, recorded = 1;
    pthread_mutex_unlock(&live_lock);
    if (!recorded) {
        free(buf);
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    }
    *out_buf = buf;
    *out_len = len;
    return VIRTUFIN_OK;
}

/* Hands out what a vfb_build_* call wrote (rc being its result). */
static int32_t hand_out_built(int rc, uint8_t *buf, int32_t len, uint8_t **out_buf,
                              int32_t *out_len)
{
    return rc == VFB_OK ? hand_out(buf, len, out_buf, out_len) : rc;
}

/* Answers <type>.processed, with error_message too when it is present; the type and the
 * upper-cased data live in one scratch block. */
static int32_t respond(const vfb_event *in, vfb_string error_message, uint8_t **out_buf,
                       int32_t *out_len)
{
    size_t type_len = in->type.len + strlen(PROCESSED), i, count = 0;
    char *scratch = malloc(type_len + in->data.len + 1);
    vfb_new_event ev = {0};
    vfb_extension ext[3];
    uint8_t *buf;
    int32_t len;
    int rc;
    if (!scratch)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    memcpy(scratch, in->type.ptr, in->type.len);
    memcpy(scratch + in->type.len, PROCESSED, strlen(PROCESSED));
    for (i = 0; i < in->data.len; i++) {
        uint8_t c = in->data.ptr[i];
        scratch[type_len + i] = (char)(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
    }
    ext[count].key = vfb_str("correlationid");
    ext[count].value = vfb_event_find_extension(in, "correlationid");
    count += ext[count].value.ptr != NULL;
    ext[count].key = vfb_str("workerid"), ext[count++].value = vfb_str(worker_id);
    ext[count].key = vfb_str("engine"), ext[count++].value = vfb_str("misbehave");
    ev.id = in->id, ev.source = vfb_str("/native/misbehave");
    ev.type.ptr = scratch, ev.type.len = type_len;
    ev.specversion = vfb_str("1.0"), ev.datacontenttype = in->datacontenttype;
    ev.data.ptr = in->data.ptr ? (const uint8_t *)scratch + type_len : NULL;
    ev.data.len = in->data.len;
    ev.extensions = ext, ev.extension_count = count;
    rc = vfb_build_response(&ev, error_message, &buf, &len);
    free(scratch);
    return hand_out_built(rc, buf, len, out_buf, out_len);
}

static int32_t echo(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    return respond(in, vfb_str(NULL), out_buf, out_len);
}

static int32_t crash(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    volatile int *volatile nowhere = NULL; /* volatile: the store must stay */
    (void)in, (void)out_buf, (void)out_len;
    *nowhere = 1;
    return VIRTUFIN_ERR_INTERNAL;
}

static int32_t hang(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    (void)in, (void)out_buf, (void)out_len;
    for (;;)
        sleep(3600);
    return VIRTUFIN_ERR_INTERNAL; /* not reached */
}

static int32_t garbage(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    uint8_t *buf = malloc(GARBAGE_BYTES);
    int i;
    (void)in;
    for (i = 0; buf && i < GARBAGE_BYTES; i++)
        buf[i] = (uint8_t)(i * 37 + 11);
    return hand_out(buf, GARBAGE_BYTES, out_buf, out_len);
}

static int32_t null(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    (void)in, (void)out_buf, (void)out_len;
    return VIRTUFIN_OK;
}

static int32_t negative(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    uint8_t *buf;
    int32_t len;
    int rc = vfb_build_error(vfb_str("negative"), &buf, &len);
    (void)in;
    return hand_out_built(rc, buf, -5, out_buf, out_len);
}

static int32_t huge(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    (void)in;
    return hand_out(calloc(1, HUGE_BYTES), INT32_MAX, out_buf, out_len);
}

static int32_t both(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    return respond(in, vfb_str("asked for both"), out_buf, out_len);
}

static int32_t neither(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    uint8_t *buf;
    int32_t len;
    int rc = vfb_build_response(NULL, vfb_str(NULL), &buf, &len);
    (void)in;
    return hand_out_built(rc, buf, len, out_buf, out_len);
}

static void nap(void)
{
    struct timespec left = {1, 500000000L};
    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ;
}

static int32_t slow(const vfb_event *in, uint8_t **out_buf, int32_t *out_len)
{
    nap();
    return echo(in, out_buf, out_len);
}

static void *chat(void *arg)
{
    const VirtufinHost *host = arg;
    int i;
    for (i = 0; i < CHATTY_LOGS; i++)
        host->log(VIRTUFIN_LOG_INFO, "chatter from a thread of the worker's own");
    return NULL;
}

/* host->log from threads the worker started, all at once; then the usual answer. */
static int32_t chatter(const VirtufinHost *host, const vfb_event *in, uint8_t **out_buf,
                       int32_t *out_len)
{
    pthread_t threads[CHATTY_THREADS];
    int i, started = 0;
    for (i = 0; i < CHATTY_THREADS; i++)
        if (pthread_create(&threads[i], NULL, chat, (void *)host) == 0)
            started++;
    for (i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    if (started < CHATTY_THREADS)
        return VIRTUFIN_ERR_INTERNAL;
    return echo(in, out_buf, out_len);
}

static const struct {
    const char *subject;
    int32_t (*run)(const vfb_event *in, uint8_t **out_buf, int32_t *out_len);
} behaviours[] = {
    {"crash", crash},     {"hang", hang}, {"garbage", garbage}, {"null", null},
    {"negative", negative}, {"huge", huge}, {"both", both},     {"neither", neither},
    {"slow", slow},
};

int32_t Process(const VirtufinHost *host, const uint8_t *in_buf, int32_t in_len,
                uint8_t **out_buf, int32_t *out_len)
{
    vfb_event in;
    size_t i;
    *out_buf = NULL;
    *out_len = 0;
    if (!worker_id)
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    if (vfb_event_read(&in, in_buf, in_len) != VFB_OK) {
        host->log(VIRTUFIN_LOG_WARN, in.error);
        return VIRTUFIN_ERR_INVALID_INPUT;
    }
    if (vfb_string_is(in.subject, "threads"))
        return chatter(host, &in, out_buf, out_len);
    for (i = 0; i < sizeof behaviours / sizeof behaviours[0]; i++)
        if (vfb_string_is(in.subject, behaviours[i].subject))
            return behaviours[i].run(&in, out_buf, out_len);
    return echo(&in, out_buf, out_len);
}

void FreeResult(uint8_t *out_buf)
{
    int i, known = 0;
    if (!out_buf)
        return;
    pthread_mutex_lock(&live_lock);
    for (i = 0; i < MAX_LIVE && !known; i++)
        if (live[i] == out_buf)
            live[i] = NULL, outstanding--, known = 1;
    if (!known)
        freed_twice++;
    pthread_mutex_unlock(&live_lock);
    if (known)
        free(out_buf);
}

/* Results handed out and not yet released by FreeResult. */
int32_t OutstandingResults(void)
{
    int32_t n;
    pthread_mutex_lock(&live_lock);
    n = outstanding;
    pthread_mutex_unlock(&live_lock);
    return n;
}

/* FreeResult calls on a pointer that was not outstanding (a double free, or a stranger). */
int32_t FreedTwice(void)
{
    int32_t n;
    pthread_mutex_lock(&live_lock);
    n = freed_twice;
    pthread_mutex_unlock(&live_lock);
    return n;
}

int32_t Probe(const VirtufinHost *host)
{
    if (probe_mode && strcmp(probe_mode, "fail") == 0) {
        host->log(VIRTUFIN_LOG_WARN, "probe: asked to fail");
        return VIRTUFIN_ERR_UNHEALTHY;
    }
    if (probe_mode && strcmp(probe_mode, "hang") == 0)
        return hang(NULL, NULL, NULL);
    if (probe_mode && strcmp(probe_mode, "crash") == 0)
        return crash(NULL, NULL, NULL);
    if (probe_mode && strcmp(probe_mode, "slow") == 0)
        nap();
    else if (probe_mode)
        return VIRTUFIN_ERR_INTERNAL;
    host->log(VIRTUFIN_LOG_INFO, "probe: healthy");
    return VIRTUFIN_OK;
}
