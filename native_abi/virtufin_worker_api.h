/*
 * virtufin_worker_api.h - the C ABI between WorkManager and a native worker (ABI version 1).
 *
 * Plain C99, usable from C and C++. A worker is a shared library that exports Process and
 * FreeResult, and optionally Probe, its health probe (names may be changed in manifest.json:
 * "entry_point", "free_result", "probe").
 *
 *   in_buf   a FlatBuffer whose root is a virtufin.worker.CloudEvent (worker_api.fbs),
 *            valid only during the call; extensions["correlationid"] carries the
 *            input's correlation id when it has one.
 *   out_buf  on VIRTUFIN_OK, a FlatBuffer whose root is a virtufin.worker.WorkerResponse
 *            with exactly one of result_event and error_message set, allocated by the
 *            worker; the host hands it back to FreeResult exactly once (also when it
 *            refuses the buffer). *out_buf may stay NULL only on a non-zero return.
 *
 * Process may be called from several threads at once: it must be reentrant. Identity is in
 * the environment (VIRTUFIN_WORKER_ID, VIRTUFIN_WORKER_GROUP, VIRTUFIN_WORKER_TOPIC,
 * VIRTUFIN_TENANT_ID), set before the library is loaded; read it once at initialization. See GUIDE.md.
 */
#ifndef VIRTUFIN_WORKER_API_H
#define VIRTUFIN_WORKER_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VIRTUFIN_ABI_VERSION 1

/* Return codes of Process (any non-zero value is a failed delivery: retried, then
 * dead-lettered with the code in its error) and of Probe (any non-zero value is a failed
 * probe, the code in its reason). */
#define VIRTUFIN_OK 0
#define VIRTUFIN_ERR_INVALID_INPUT 1  /* in_buf could not be read */
#define VIRTUFIN_ERR_INTERNAL 2       /* the worker failed */
#define VIRTUFIN_ERR_OUT_OF_MEMORY 3  /* the worker could not allocate its answer */
#define VIRTUFIN_ERR_UNHEALTHY 4      /* Probe: the worker cannot work now (a dependency
                                         is down, ...) */

/* Return codes of gateway_call. */
#define VIRTUFIN_GATEWAY_OK 0
#define VIRTUFIN_GATEWAY_FAILED 1     /* refused, unreachable, or an error answer;
                                         *response holds {"error": "..."} */
#define VIRTUFIN_GATEWAY_BAD_REQUEST 2 /* arguments unusable (NULL, not JSON, ...) */

/* Levels of log. */
#define VIRTUFIN_LOG_TRACE 0
#define VIRTUFIN_LOG_DEBUG 1
#define VIRTUFIN_LOG_INFO 2
#define VIRTUFIN_LOG_WARN 3
#define VIRTUFIN_LOG_ERROR 4

typedef struct VirtufinHost {
    void*   engine_ptr;      /* opaque, first field */
    int32_t abi_version;     /* second field, 1 */
    void    (*log)(int32_t level, const char* message);  /* 0 trace .. 4 error */
    int32_t (*gateway_call)(const char* service, const char* method,
                            const uint8_t* request, int32_t request_len,
                            uint8_t** response, int32_t* response_len);
    void    (*free_response)(uint8_t* response);
} VirtufinHost;

/*
 * log:           message is UTF-8, copied during the call.
 * gateway_call:  request is a JSON object (request_len bytes, no terminator needed); on
 *                return *response holds response_len bytes of JSON (the service's answer,
 *                or {"error": "..."} on a non-zero return) that the worker releases with
 *                host->free_response. Calls go to the worker's api_host:api_port, only if
 *                that host is allowed (WM_GATEWAY_ALLOWED_HOSTS).
 */

int32_t Process(const VirtufinHost* host, const uint8_t* in_buf, int32_t in_len,
                uint8_t** out_buf, int32_t* out_len);   /* 0 = ok */
void    FreeResult(uint8_t* out_buf);

/*
 * Probe (optional; a library without it has no probe): the worker's health probe, called
 * every probe_interval_s (worker setting, default 30) on one node, within the worker's time
 * limit (timeout_s). Return VIRTUFIN_OK when the worker is healthy, any other code when not
 * (VIRTUFIN_ERR_UNHEALTHY, say): its reason names the code, and failed probes in a row make
 * the worker degraded, then unhealthy. host is valid during the call (log, gateway_call to
 * check a dependency). It may run while Process calls are in flight: it must be reentrant.
 * Past the time limit it is killed with its helper under isolation "subprocess"; in-process
 * it cannot be stopped, and its answer is dropped as a failure when it returns.
 */
int32_t Probe(const VirtufinHost* host);                /* 0 = healthy */

#ifdef __cplusplus
}
#endif

#endif /* VIRTUFIN_WORKER_API_H */
