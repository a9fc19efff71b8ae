/* The RMA calls ucxx's Python layer lacks, against the libucp instance ucxx loaded.
 *
 * Built into the package as the extension module `transports.native._ucx` (an empty
 * module; the functions are called through ctypes) against the headers of the
 * libucx wheel, with a runpath into that wheel. Struct layouts
 * (ucp_mem_map_params_t, ucp_request_param_t) are those of the UCP API version the
 * headers declare; `rfx_built_api` reports it so the loader can refuse a libucp of
 * another version before any struct crosses. A whole batch of GETs is posted from one C loop: at
 * 4 KiB a per-read Python/ctypes call (~9 us) would cap the rate near 0.4 GB/s.
 *
 * Every function returns a ucs_status_t (0 = UCS_OK, negative = error). Addresses
 * and keys were validated by the caller against registered regions.
 *
 * Every wait on a peer has a deadline (CLOCK_MONOTONIC, absolute, in ns: the same
 * clock as Python's time.monotonic_ns, so the owner process can set it): a hung or
 * stopped peer costs UCS_ERR_TIMED_OUT, never an endless wait. After a timeout GETs
 * may still be in flight and the flush callback may still run, so the wait state
 * lives on the heap and is leaked on purpose, and the caller must end the process
 * (see transports/ucx/worker.py): only then can no late GET write into memory whose
 * pull was already reported failed. */
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

typedef struct {
    volatile int done;
    ucs_status_t status;
} rfx_wait_t;

static void rfx_done_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)request;
    rfx_wait_t *w = (rfx_wait_t *)user_data;
    w->status = status;
    w->done = 1;
}

/* The version of the libucp actually loaded; returns the API version the headers
 * of the build declared, as (major << 16) | minor. */
int rfx_version(unsigned *major, unsigned *minor, unsigned *release)
{
    ucp_get_version(major, minor, release);
    return (UCP_API_MAJOR << 16) | UCP_API_MINOR;
}

#ifndef RFX_LIBUCX_VERSION
#define RFX_LIBUCX_VERSION "unknown"
#endif

/* The libucx wheel version whose headers this was built against (for messages). */
const char *rfx_built_libucx(void) { return RFX_LIBUCX_VERSION; }

int rfx_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *out)
{
    ucp_mem_map_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = addr;
    p.length = len;
    return ucp_mem_map(ctx, &p, out);
}

int rfx_mem_unmap(ucp_context_h ctx, ucp_mem_h memh) { return ucp_mem_unmap(ctx, memh); }

/* Copies the packed key into out[0..cap); *size receives its length. */
int rfx_rkey_pack(ucp_context_h ctx, ucp_mem_h memh, void *out, size_t cap, size_t *size)
{
    void *buf = NULL;
    size_t sz = 0;
    ucs_status_t st = ucp_rkey_pack(ctx, memh, &buf, &sz);
    if (st != UCS_OK)
        return st;
    *size = sz;
    if (sz <= cap)
        memcpy(out, buf, sz);
    ucp_rkey_buffer_release(buf);
    return sz <= cap ? UCS_OK : UCS_ERR_BUFFER_TOO_SMALL;
}

int rfx_rkey_unpack(ucp_ep_h ep, const void *buf, ucp_rkey_h *out) { return ucp_ep_rkey_unpack(ep, buf, out); }

void rfx_rkey_destroy(ucp_rkey_h rkey) { ucp_rkey_destroy(rkey); }

int rfx_worker_efd(ucp_worker_h w, int *fd) { return ucp_worker_get_efd(w, fd); }

/* The status a wait past its deadline returns (for the caller to compare with). */
int rfx_timed_out(void) { return UCS_ERR_TIMED_OUT; }

static int64_t rfx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Progress until *wt is done or the clock passes deadline_ns (CLOCK_MONOTONIC).
 * While a batch is moving, progress is polled: on the cma path the copies happen
 * inside ucp_worker_progress and raise no event, so sleeping on the event fd would
 * stall the batch. Only after a stretch without any progress (a remote peer that must
 * answer, the tcp path) does it arm and sleep in poll(), at most 1 ms at a time.
 * Returns UCS_ERR_TIMED_OUT at the deadline; *wt may then still be written by the
 * flush callback later, so it must not be stack memory of a frame that returns. */
static ucs_status_t rfx_wait(ucp_worker_h w, int efd, rfx_wait_t *wt, int64_t deadline_ns)
{
    unsigned idle = 0, busy = 0;
    while (!wt->done) {
        if (ucp_worker_progress(w)) {
            idle = 0;
            /* A peer that keeps the worker busy without ever finishing is also bounded. */
            if ((++busy & 1023) == 0 && rfx_now_ns() >= deadline_ns)
                return UCS_ERR_TIMED_OUT;
            continue;
        }
        if (++idle < 4096)
            continue;
        idle = 0;
        if (rfx_now_ns() >= deadline_ns)
            return UCS_ERR_TIMED_OUT;
        ucs_status_t st = ucp_worker_arm(w);
        if (st == UCS_ERR_BUSY)
            continue;
        struct pollfd p = {efd, POLLIN, 0};
        poll(&p, 1, 1);
        (void)st;
    }
    return wt->status;
}

/* Progress everything pending, then wait (blocking, no spin) until `fd` is readable
 * or `timeout_ms` passes: the data-plane process's idle loop, which keeps serving
 * peers that need target-side progress (the tcp path) while it waits for commands. */
int rfx_idle(ucp_worker_h w, int efd, int fd, int timeout_ms)
{
    for (;;) {
        while (ucp_worker_progress(w))
            ;
        ucs_status_t st = ucp_worker_arm(w);
        if (st == UCS_ERR_BUSY)
            continue;
        if (st != UCS_OK)
            return st;
        struct pollfd p[2] = {{fd, POLLIN, 0}, {efd, POLLIN, 0}};
        int r = poll(p, 2, timeout_ms);
        if (r <= 0 || (p[0].revents & (POLLIN | POLLHUP | POLLERR)))
            return UCS_OK;
    }
}

/* Post n GETs (dst[i] <- remote src[i], len[i] bytes, key rkey[i]) from one loop, then
 * flush the endpoint and wait for every one of them, until deadline_ns at the latest
 * (CLOCK_MONOTONIC). Stops posting at the first error or once the deadline passed, but
 * still flushes. Returns UCS_ERR_TIMED_OUT when the deadline passed before the flush
 * completed: GETs may then still be in flight, and the caller must end the process.
 * Otherwise nothing is in flight when it returns. *posted receives the number of GETs
 * handed to UCX. */
int rfx_get_batch(ucp_worker_h w, int efd, ucp_ep_h ep, int64_t n, const uint64_t *dst,
                  const uint64_t *src, const uint64_t *len, const uint64_t *rkey,
                  int64_t deadline_ns, int64_t *posted)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    ucs_status_t st = UCS_OK;
    int64_t i;
    for (i = 0; i < n; i++) {
        if (len[i] == 0)
            continue;
        ucs_status_ptr_t r = ucp_get_nbx(ep, (void *)(uintptr_t)dst[i], len[i], src[i],
                                         (ucp_rkey_h)(uintptr_t)rkey[i], &p);
        if (UCS_PTR_IS_ERR(r)) {
            st = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL)
            ucp_request_free(r); /* released by UCX on completion; the flush waits for it */
        /* Keep the send queues short on paths that complete asynchronously. */
        if ((i & 1023) == 1023) {
            while (ucp_worker_progress(w))
                ;
            if (rfx_now_ns() >= deadline_ns) {
                st = UCS_ERR_TIMED_OUT;
                i++;
                break;
            }
        }
    }
    *posted = i;
    /* Heap, not stack: after a timeout the flush callback may still write into it. */
    rfx_wait_t *wt = calloc(1, sizeof(*wt));
    if (wt == NULL)
        return UCS_ERR_NO_MEMORY; /* nothing to wait on: the caller ends the process */
    ucp_request_param_t fp;
    memset(&fp, 0, sizeof(fp));
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = rfx_done_cb;
    fp.user_data = wt;
    ucs_status_ptr_t fr = ucp_ep_flush_nbx(ep, &fp);
    ucs_status_t fst;
    if (fr == NULL) {
        fst = UCS_OK;
    } else if (UCS_PTR_IS_ERR(fr)) {
        fst = UCS_PTR_STATUS(fr);
    } else {
        fst = rfx_wait(w, efd, wt, deadline_ns);
        if (fst == UCS_ERR_TIMED_OUT)
            return fst; /* wt and fr stay: the process ends before they could matter */
        ucp_request_free(fr);
    }
    free(wt);
    if (st == UCS_ERR_TIMED_OUT || fst == UCS_ERR_TIMED_OUT)
        return UCS_ERR_TIMED_OUT;
    return st != UCS_OK ? st : fst;
}

static struct PyModuleDef rfx_module = {
    PyModuleDef_HEAD_INIT, "_ucx", "refitd's UCX RMA helper (called through ctypes)", -1, NULL,
};

PyMODINIT_FUNC PyInit__ucx(void) { return PyModule_Create(&rfx_module); }
