/* Batched memory copy for the `local` transport.
 *
 * Called through ctypes, which releases the GIL for the whole call, so several
 * threads can copy parts of one batch at once. Addresses and lengths are validated
 * by the caller (transports.core.validate_batch) before they get here. */
#include <stdint.h>
#include <string.h>

void rfx_copy_batch(int64_t n, const int64_t *dst, const int64_t *src, const int64_t *len)
{
    for (int64_t i = 0; i < n; i++)
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)len[i]);
}
