/* Batched memory copy for the `local` transport.
 *
 * Built into the package as the extension module `transports.native._copy` (an
 * empty module: its functions are called through ctypes, which releases the GIL for
 * the whole call, so several threads can copy parts of one batch at once).
 * Addresses and lengths are validated by the caller (transports.batch.validate_batch)
 * before they get here. */
#define Py_LIMITED_API 0x030B0000
#include <Python.h> /* first: it sets _GNU_SOURCE and the other feature macros */
#include <stdint.h>
#include <string.h>

void rfx_copy_batch(int64_t n, const int64_t *dst, const int64_t *src, const int64_t *len)
{
    for (int64_t i = 0; i < n; i++)
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)len[i]);
}

/* The guarded copy: a bus error (SIGBUS) inside it ends the copy with an error
 * instead of killing the process.
 *
 * A shared segment is a tmpfs file: when its owner shrinks it (ftruncate) under our
 * mapping, or tmpfs cannot back a page on first write (the filesystem is full), the
 * access raises SIGBUS, whose default action kills the whole daemon. A client can do
 * the first to its own segment at any moment, and no check before the copy can
 * close that window. So the copy runs under a handler: while this thread is inside a
 * guarded copy, SIGBUS jumps back (siglongjmp) to the copy's start, which reports
 * which copy faulted and at what address; the caller fails that batch (its
 * destination ranges are suspect) and the daemon keeps serving.
 *
 * A SIGBUS outside a guarded copy is not ours: it goes to the handler installed
 * before ours (e.g. Python's faulthandler), or to the default action. Our handler
 * is (re)installed at each guarded call when another one replaced it. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

/* initial-exec: the handler reads them without a call that could allocate */
#define RFX_TLS __thread __attribute__((tls_model("initial-exec")))
/* volatile: the compiler must not drop the stores (memcpy never reads them) */
static RFX_TLS sigjmp_buf *volatile rfx_guard; /* non-NULL while this thread copies */
static RFX_TLS void *volatile rfx_fault_at; /* si_addr of the last caught fault */
static struct sigaction rfx_prev;            /* the SIGBUS handler before ours */
static pthread_mutex_t rfx_install = PTHREAD_MUTEX_INITIALIZER;

static void rfx_on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    sigjmp_buf *jb = rfx_guard;
    if (jb != NULL) {
        rfx_guard = NULL;
        rfx_fault_at = info != NULL ? info->si_addr : NULL;
        siglongjmp(*jb, 1);
    }
    if (rfx_prev.sa_flags & SA_SIGINFO) {
        if (rfx_prev.sa_sigaction != NULL) {
            rfx_prev.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (rfx_prev.sa_handler != SIG_DFL && rfx_prev.sa_handler != SIG_IGN) {
        rfx_prev.sa_handler(sig);
        return;
    }
    /* Default action: restore it; the faulting access runs again and ends us. */
    signal(sig, SIG_DFL);
}

/* Install the handler unless it is the current one. Returns 0, or -1 (errno). */
int rfx_guard_install(void)
{
    struct sigaction cur, mine;
    int rc = 0;
    pthread_mutex_lock(&rfx_install);
    if (sigaction(SIGBUS, NULL, &cur) != 0) {
        rc = -1;
    } else if (!((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == rfx_on_sigbus)) {
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = rfx_on_sigbus;
        mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&mine.sa_mask);
        if (sigaction(SIGBUS, &mine, &rfx_prev) != 0)
            rc = -1;
    }
    pthread_mutex_unlock(&rfx_install);
    return rc;
}

/* Ask for the first lines of the next copy while this one runs. Scattered small
 * copies (shuffled 4 KiB pieces) each start on a page the hardware prefetcher has
 * not seen, so every copy would begin with a cache and TLB miss; hinting the next
 * one overlaps that wait with the current copy. A prefetch never faults, so an
 * address past a shrunk file is harmless here. Measured on the 2-core development
 * machine, 30 alternating pairs: 12-22% less time for shuffled 4 KiB pieces, none
 * lost at 1 MiB. rfx_copy_batch (the benches' plain memcpy baseline) has none. */
static inline void rfx_prefetch_next(int64_t dst, int64_t src)
{
    const char *s = (const char *)(intptr_t)src;
    const char *d = (const char *)(intptr_t)dst;
    __builtin_prefetch(s, 0, 0);
    __builtin_prefetch(s + 64, 0, 0);
    __builtin_prefetch(d, 1, 0);
    __builtin_prefetch(d + 64, 1, 0);
}

/* Copy like rfx_copy_batch. Returns -1 when every copy completed; else the index of
 * the copy a bus error stopped (copies before it completed, it and those after are
 * undefined), with the faulting address in *fault_at. Returns -2 when the handler
 * could not be installed (nothing copied). */
int64_t rfx_copy_batch_guarded(int64_t n, const int64_t *dst, const int64_t *src,
                               const int64_t *len, int64_t *fault_at)
{
    sigjmp_buf jb;
    volatile int64_t i = 0;
    if (rfx_guard_install() != 0)
        return -2;
    if (sigsetjmp(jb, 1) != 0) { /* 1: restore the mask, SIGBUS is unblocked again */
        *fault_at = (int64_t)(intptr_t)rfx_fault_at;
        return i;
    }
    rfx_guard = &jb;
    for (; i < n; i++) {
        if (i + 1 < n)
            rfx_prefetch_next(dst[i + 1], src[i + 1]);
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)len[i]);
    }
    rfx_guard = NULL;
    return -1;
}

/* One strided element row: n elements of `item` bytes, `step` bytes apart in src,
 * packed contiguously into dst. A constant size per case lets memcpy inline. */
static void rfx_row(char *dst, const char *src, int64_t n, int64_t step, int64_t item)
{
    if (step == item) {
        memcpy(dst, src, (size_t)(n * item));
        return;
    }
    switch (item) {
    case 1: for (int64_t k = 0; k < n; k++) memcpy(dst + k, src + k * step, 1); break;
    case 2: for (int64_t k = 0; k < n; k++) memcpy(dst + 2 * k, src + k * step, 2); break;
    case 4: for (int64_t k = 0; k < n; k++) memcpy(dst + 4 * k, src + k * step, 4); break;
    case 8: for (int64_t k = 0; k < n; k++) memcpy(dst + 8 * k, src + k * step, 8); break;
    default:
        for (int64_t k = 0; k < n; k++)
            memcpy(dst + k * item, src + k * step, (size_t)item);
    }
}

/* Gather the strided block at `src` (shape[ndim], strides in bytes, elements of
 * `item` bytes; ndim >= 1, every extent >= 1) into `dst` contiguously, under the
 * bus-error guard. Returns -1 when done, 0 when a bus error stopped it (the faulting
 * address in *fault_at; dst is then undefined), -2 when the guard could not be
 * installed (nothing copied). Bounds are the caller's (validated before). */
int64_t rfx_gather_guarded(int64_t ndim, const int64_t *shape, const int64_t *strides,
                           int64_t item, int64_t src, int64_t dst, int64_t *fault_at)
{
    sigjmp_buf jb;
    int64_t idx[32] = {0};
    if (ndim < 1 || ndim > 32)
        return -2;
    if (rfx_guard_install() != 0)
        return -2;
    if (sigsetjmp(jb, 1) != 0) {
        *fault_at = (int64_t)(intptr_t)rfx_fault_at;
        return 0;
    }
    rfx_guard = &jb;
    int64_t inner = shape[ndim - 1], row = inner * item;
    char *out = (char *)(intptr_t)dst;
    for (;;) {
        int64_t at = src;
        for (int64_t d = 0; d < ndim - 1; d++)
            at += idx[d] * strides[d];
        rfx_row(out, (const char *)(intptr_t)at, inner, strides[ndim - 1], item);
        out += row;
        int64_t d = ndim - 2;
        while (d >= 0 && ++idx[d] == shape[d])
            idx[d--] = 0;
        if (d < 0)
            break;
    }
    rfx_guard = NULL;
    return -1;
}

#include <sys/types.h>
#include <sys/uio.h>

/* The kernel ceiling of the cma path: one process_vm_readv per read, from process
 * `pid`, exactly as UCX's cma transport issues them. Used by `refitd bench transport`
 * to show how close UCX gets to it. Returns 0, or -1 with errno set. */
int rfx_pvr_batch(int64_t pid, int64_t n, const int64_t *dst, const int64_t *src, const int64_t *len)
{
    for (int64_t i = 0; i < n; i++) {
        struct iovec l = {(void *)(intptr_t)dst[i], (size_t)len[i]};
        struct iovec r = {(void *)(intptr_t)src[i], (size_t)len[i]};
        size_t done = 0;
        while (done < (size_t)len[i]) {
            l.iov_base = (char *)(intptr_t)dst[i] + done;
            l.iov_len = (size_t)len[i] - done;
            r.iov_base = (char *)(intptr_t)src[i] + done;
            r.iov_len = l.iov_len;
            ssize_t got = process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
            if (got <= 0)
                return -1;
            done += (size_t)got;
        }
    }
    return 0;
}

static struct PyModuleDef rfx_module = {
    PyModuleDef_HEAD_INIT, "_copy", "refitd's batched copy (called through ctypes)", -1, NULL,
};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&rfx_module); }
