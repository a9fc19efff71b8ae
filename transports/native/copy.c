/* Batched memory copy for the `local` transport.
 *
 * Built into the package as the extension module `transports.native._copy` (an
 * empty module: its functions are called through ctypes, which releases the GIL for
 * the whole call, so several threads can copy parts of one batch at once).
 * Addresses and lengths are validated by the caller (transports.core.validate_batch)
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
