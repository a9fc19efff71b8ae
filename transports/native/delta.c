/* The delta refit's per-change work, one pass over the changes instead of numpy's
 * dozen (refitd.delta.native wraps it; refitd.delta.diff/stream/digest hold the
 * pure-numpy reference each function is tested against).
 *
 * Built into the package as the extension module `transports.native._delta` (an
 * empty module: its functions are called through ctypes, which releases the GIL for
 * the whole call, so the daemon's comparison threads and the event loop run apart).
 *
 * Why native: each numpy step over a million changes allocates a fresh array (one
 * page fault per 4 KiB of it) and walks memory once; the stages made about fifteen
 * such passes each, at 0.1 to 1 GB/s of model bytes. Here a change is read once and
 * written once, in a loop the compiler keeps in registers.
 *
 * A *unit* is 1, 2, 4 or 8 bytes (refitd.delta.diff). Units are read and written with
 * memcpy of a constant size, so unaligned memory is fine and the compiler emits one
 * load. Callers size and validate every buffer; each function still bounds what it
 * writes by what it was given and reports a bad input as a negative return. */
#define Py_LIMITED_API 0x030B0000
#include <Python.h> /* first: it sets _GNU_SOURCE and the other feature macros */
#include <stdint.h>
#include <string.h>

#define RFX_LANES 512
#define RFX_PAGE 255
#define RFX_ESCAPE (-128)

static inline uint64_t rfx_load(const uint8_t *p, int64_t unit)
{
    switch (unit) {
    case 1: return p[0];
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static inline void rfx_store(uint8_t *p, uint64_t v, int64_t unit)
{
    switch (unit) {
    case 1: p[0] = (uint8_t)v; break;
    case 2: { uint16_t w = (uint16_t)v; memcpy(p, &w, 2); break; }
    case 4: { uint32_t w = (uint32_t)v; memcpy(p, &w, 4); break; }
    default: memcpy(p, &v, 8);
    }
}

/* new - old as a signed integer of `unit` bytes (modular, as the reference's
 * `(new - old).view(signed)`). */
static inline int64_t rfx_signed_diff(uint64_t old, uint64_t new, int64_t unit)
{
    uint64_t d = new - old;
    switch (unit) {
    case 1: return (int8_t)(uint8_t)d;
    case 2: return (int16_t)(uint16_t)d;
    case 4: return (int32_t)(uint32_t)d;
    default: return (int64_t)d;
    }
}

/* Add the lane digest of `n` bytes at `buf` into `lanes` (RFX_LANES uint64): word i
 * (little-endian, from buf) into lane i % RFX_LANES, a last partial word zero-padded
 * (refitd.delta.diff.lanes_of). */
void rfx_lanes(int64_t n, const uint8_t *buf, uint64_t *lanes)
{
    int64_t words = n / 8, i = 0;
    const int64_t row = RFX_LANES;
    for (; i + row <= words; i += row) {
        const uint8_t *p = buf + 8 * i;
        for (int64_t j = 0; j < row; j++) {
            uint64_t w;
            memcpy(&w, p + 8 * j, 8);
            lanes[j] += w;
        }
    }
    for (; i < words; i++) {
        uint64_t w;
        memcpy(&w, buf + 8 * i, 8);
        lanes[i % row] += w;
    }
    if (n % 8) {
        uint64_t w = 0;
        memcpy(&w, buf + 8 * words, (size_t)(n % 8));
        lanes[words % row] += w;
    }
}

/* Compare `n` bytes (a whole number of units) of `old` and `new`: the lanes of each
 * added into lanes_old / lanes_new (either may be NULL: not taken), and each unit that
 * differs written as its byte offset into at[] and its old then new bytes into
 * vals[] (2 * unit bytes a change). at and vals hold n / unit changes. Returns the
 * number of changes (refitd.delta.diff.compare_chunk). */
int64_t rfx_compare(int64_t n, const uint8_t *old, const uint8_t *new, int64_t unit,
                    uint64_t *lanes_old, uint64_t *lanes_new, int64_t *at, uint8_t *vals)
{
    if (lanes_old != NULL)
        rfx_lanes(n, old, lanes_old);
    if (lanes_new != NULL)
        rfx_lanes(n, new, lanes_new);
    int64_t c = 0, words = n / 8;
    /* Most words are equal: compare 8 bytes at a time, units only inside a word
     * that differs. */
    for (int64_t i = 0; i < words; i++) {
        uint64_t a, b;
        memcpy(&a, old + 8 * i, 8);
        memcpy(&b, new + 8 * i, 8);
        if (a == b)
            continue;
        for (int64_t o = 8 * i; o < 8 * i + 8; o += unit) {
            if (memcmp(old + o, new + o, (size_t)unit) != 0) {
                at[c] = o;
                memcpy(vals + 2 * unit * c, old + o, (size_t)unit);
                memcpy(vals + 2 * unit * c + unit, new + o, (size_t)unit);
                c++;
            }
        }
    }
    for (int64_t o = 8 * words; o + unit <= n; o += unit) {
        if (memcmp(old + o, new + o, (size_t)unit) != 0) {
            at[c] = o;
            memcpy(vals + 2 * unit * c, old + o, (size_t)unit);
            memcpy(vals + 2 * unit * c + unit, new + o, (size_t)unit);
            c++;
        }
    }
    return c;
}

/* rfx_compare over np pieces laid end to end in `old` and `new` (piece p: len[p]
 * bytes, a whole number of units; old NULL: lanes of `new` only). Piece p's lanes go
 * to lanes_*[lanes_at[p] ...], its own word 0 in lane 0 (the caller gives it
 * min(RFX_LANES, ceil(len / 8)) zeroed lanes there); its changes' offsets are
 * dst_off[p] plus their offset in the piece, per_piece[p] how many. at and vals
 * hold one change per unit of the pieces. Returns the changes. */
int64_t rfx_compare_pieces(int64_t np, const int64_t *len, const int64_t *dst_off,
                           const uint8_t *old, const uint8_t *new, int64_t unit,
                           const int64_t *lanes_at, uint64_t *lanes_old, uint64_t *lanes_new,
                           int64_t *at, uint8_t *vals, int64_t *per_piece)
{
    int64_t c = 0, pos = 0;
    for (int64_t p = 0; p < np; p++) {
        int64_t n = len[p];
        rfx_lanes(n, new + pos, lanes_new + lanes_at[p]);
        if (old == NULL) {
            per_piece[p] = 0;
            pos += n;
            continue;
        }
        rfx_lanes(n, old + pos, lanes_old + lanes_at[p]);
        int64_t got = rfx_compare(n, old + pos, new + pos, unit, NULL, NULL, at + c,
                                  vals + 2 * unit * c);
        for (int64_t j = c; j < c + got; j++)
            at[j] += dst_off[p];
        per_piece[p] = got;
        c += got;
        pos += n;
    }
    return c;
}

/* The source's staging of a delta (refitd.delta.stream.select, encode,
 * changed_pairs and encode_values in one pass). For each of the stream's m reads,
 * in stream order: its source offset read_off[r], its first stream unit
 * read_start[r], and the changes [lo[r], hi[r]) of the version's change index that
 * lie inside it (offsets[] ascending within a read; values[] each change's old then
 * new unit). Writes the page counts (counts[], `pages` bytes, zeroed by the caller),
 * each change's offset in its page (low[]), its difference byte (diff[]) and, for
 * a difference beyond +-127, the new unit into exc[] (capacity: one per change).
 * With bits 4 the differences are 4-bit, two a byte (diff[] zeroed by the caller),
 * and one beyond +-7 is escaped (nibble 8). *mid: the differences beyond +-7 but
 * within +-127 (what 4-bit differences would escape more). Returns the number of
 * exceptions, or -1 when a change lies past the last page (the caller's stream is
 * not the one the reads make). */
int64_t rfx_encode(int64_t m, const int64_t *read_off, const int64_t *read_start,
                   const int64_t *lo, const int64_t *hi, const int64_t *offsets,
                   const uint8_t *values, int64_t unit, int64_t shift, uint8_t *counts,
                   int64_t pages, uint8_t *low, int8_t *diff, uint8_t *exc, int64_t bits,
                   int64_t *mid)
{
    int64_t c = 0, e = 0, far = bits == 4 ? 7 : 127, wide = 0;
    for (int64_t r = 0; r < m; r++) {
        int64_t base = read_start[r] - (read_off[r] >> shift);
        for (int64_t j = lo[r]; j < hi[r]; j++, c++) {
            int64_t k = base + (offsets[j] >> shift);
            int64_t page = k / RFX_PAGE;
            if (k < 0 || page >= pages)
                return -1;
            counts[page]++;
            low[c] = (uint8_t)(k - page * RFX_PAGE);
            const uint8_t *v = values + 2 * unit * j;
            uint64_t a = rfx_load(v, unit), b = rfx_load(v + unit, unit);
            int64_t d = rfx_signed_diff(a, b, unit);
            if (d < -7 || d > 7)
                wide += d >= -127 && d <= 127; /* escapes only with 4-bit differences */
            int escaped = d < -far || d > far;
            if (escaped) {
                memcpy(exc + unit * e, v + unit, (size_t)unit);
                e++;
            }
            if (bits == 4) /* two a byte, the first in the low nibble; 8: the escape */
                ((uint8_t *)diff)[c >> 1] |= (uint8_t)(((escaped ? 8 : d) & 0xF) << (4 * (c & 1)));
            else
                diff[c] = escaped ? RFX_ESCAPE : (int8_t)d;
        }
    }
    *mid = wide;
    return e;
}

/* The engine's placing of a delta whose every read lands whole in its memory
 * (refitd.delta.stream.decode, pieces_of and decode_values, and the gather of the
 * old units, in one pass). Positions: counts[pages] and low[changed]; differences
 * diff[changed] with the escaped ones' new units in exc[nexc]. The stream's pieces:
 * ends[p] the stream unit after piece p (ascending), origin[p] the engine unit of
 * stream unit 0 for piece p (so stream unit k of piece p lands at origin[p] + k).
 * bits: 8, a signed byte a difference; 4, two a byte (rfx_encode).
 * engine: the engine's memory, engine_units units. Writes each change's engine unit
 * index idx[] and the unit it finds old[]; then either
 * - with `new` (rfx_place): the unit it becomes into new[], nothing of the engine
 *   written;
 * - with `lanes` (rfx_place_write): the unit written into the engine at once and the
 *   engine digest's per-block lanes (blocks of 1 << block_shift bytes, `blocks` of
 *   them; rfx_digest_update) updated from it, while its cache line is at hand: the
 *   engine memory is walked once, not three times. On a bad input every unit written
 *   and every lane updated is put back, last first, before returning.
 * Returns the changes placed, or: -1 the counts name more positions than `changed`,
 * -2 fewer; -3 a position past the stream's end; -4 a position lands outside the
 * engine (or its digest); -5 positions not strictly ascending (or an offset in page
 * >= 255); -6 the escapes are not `nexc`. */
static inline int64_t rfx_place_core(int64_t pages, const uint8_t *counts, const uint8_t *low,
                                     int64_t changed, const int8_t *diff, const uint8_t *exc,
                                     int64_t nexc, int64_t npieces, const int64_t *ends,
                                     const int64_t *origin, int64_t unit, uint8_t *engine,
                                     int64_t engine_units, int64_t *idx, uint8_t *old,
                                     uint8_t *new, int64_t bits, uint64_t *lanes,
                                     int64_t block_shift, int64_t blocks)
{
    int64_t c = 0, e = 0, piece = 0, prev = -1, rc = 0;
    for (int64_t p = 0; p < pages && !rc; p++) {
        int64_t n = counts[p];
        if (c + n > changed) {
            rc = -1;
            break;
        }
        for (int64_t q = 0; q < n; q++, c++) {
            int64_t l = low[c];
            int64_t k = p * RFX_PAGE + l;
            if (l >= RFX_PAGE || k <= prev) {
                rc = -5;
                break;
            }
            prev = k;
            while (piece < npieces && ends[piece] <= k)
                piece++;
            if (piece >= npieces) {
                rc = -3;
                break;
            }
            int64_t i = origin[piece] + k;
            if (i < 0 || i >= engine_units || (lanes && ((i * unit) >> block_shift) >= blocks)) {
                rc = -4;
                break;
            }
            idx[c] = i;
            uint64_t a = rfx_load(engine + unit * i, unit), b;
            int64_t d = diff[c >> (bits == 4)];
            if (bits == 4) {
                d = (((uint8_t)d) >> (4 * (c & 1))) & 0xF;
                d = d == 8 ? RFX_ESCAPE : (d ^ 8) - 8; /* sign-extended */
            }
            if (d == RFX_ESCAPE) {
                if (e >= nexc) {
                    rc = -6;
                    break;
                }
                b = rfx_load(exc + unit * e, unit);
                e++;
            } else {
                b = a + (uint64_t)d; /* modular, truncated by the store */
            }
            rfx_store(old + unit * c, a, unit);
            if (new) {
                rfx_store(new + unit * c, b, unit);
            } else {
                rfx_store(engine + unit * i, b, unit);
                b = rfx_load(engine + unit * i, unit); /* as stored: truncated */
                int64_t at = i * unit;
                int64_t lane = ((at >> block_shift) * RFX_LANES) + ((at >> 3) & (RFX_LANES - 1));
                lanes[lane] += (b - a) << (8 * (at & 7));
            }
        }
    }
    if (!rc && c != changed)
        rc = -2;
    if (!rc && e != nexc)
        rc = -6;
    if (!rc)
        return c;
    if (!new) /* put back what was written, last first */
        for (int64_t j = c - 1; j >= 0; j--) {
            int64_t at = idx[j] * unit;
            uint64_t a = rfx_load(old + unit * j, unit), b = rfx_load(engine + at, unit);
            rfx_store(engine + at, a, unit);
            int64_t lane = ((at >> block_shift) * RFX_LANES) + ((at >> 3) & (RFX_LANES - 1));
            lanes[lane] -= (b - a) << (8 * (at & 7));
        }
    return rc;
}

/* rfx_place_core decoding only: idx[], old[] and new[] of every change, nothing
 * written. */
int64_t rfx_place(int64_t pages, const uint8_t *counts, const uint8_t *low, int64_t changed,
                  const int8_t *diff, const uint8_t *exc, int64_t nexc, int64_t npieces,
                  const int64_t *ends, const int64_t *origin, int64_t unit,
                  const uint8_t *engine, int64_t engine_units, int64_t *idx, uint8_t *old,
                  uint8_t *new, int64_t bits)
{
    return rfx_place_core(pages, counts, low, changed, diff, exc, nexc, npieces, ends, origin,
                          unit, (uint8_t *)engine, engine_units, idx, old, new, bits, NULL, 0,
                          0);
}

/* rfx_place_core placing, writing and digesting in one pass: idx[] and old[] of every
 * change (the undo record), the engine written and its lanes updated. */
int64_t rfx_place_write(int64_t pages, const uint8_t *counts, const uint8_t *low,
                        int64_t changed, const int8_t *diff, const uint8_t *exc, int64_t nexc,
                        int64_t npieces, const int64_t *ends, const int64_t *origin,
                        int64_t unit, uint8_t *engine, int64_t engine_units, int64_t *idx,
                        uint8_t *old, int64_t bits, uint64_t *lanes, int64_t block_shift,
                        int64_t blocks)
{
    return rfx_place_core(pages, counts, low, changed, diff, exc, nexc, npieces, ends, origin,
                          unit, engine, engine_units, idx, old, NULL, bits, lanes, block_shift,
                          blocks);
}

/* Write the units new[n] at engine unit indices idx[n] (the caller validated each,
 * rfx_place did). */
void rfx_scatter(int64_t n, const int64_t *idx, const uint8_t *new, int64_t unit,
                 uint8_t *engine)
{
    switch (unit) {
    case 1: for (int64_t c = 0; c < n; c++) engine[idx[c]] = new[c]; break;
    case 2: for (int64_t c = 0; c < n; c++) memcpy(engine + 2 * idx[c], new + 2 * c, 2); break;
    case 4: for (int64_t c = 0; c < n; c++) memcpy(engine + 4 * idx[c], new + 4 * c, 4); break;
    default: for (int64_t c = 0; c < n; c++) memcpy(engine + 8 * idx[c], new + 8 * c, 8);
    }
}

/* Update the engine digest's per-block lanes (blocks of 1 << block_shift bytes,
 * RFX_LANES uint64 each, `blocks` of them) after the units at engine unit indices
 * idx[n] changed from old[] to new[] (refitd.delta.digest.EngineDigest.update): a
 * word changes by (new - old) << (8 * its byte in the word), modulo 2**64. Returns
 * 0, or -1 (nothing updated) when an index lies outside the blocks. */
int64_t rfx_digest_update(int64_t n, const int64_t *idx, const uint8_t *old,
                          const uint8_t *new, int64_t unit, int64_t block_shift,
                          int64_t blocks, uint64_t *lanes)
{
    for (int64_t c = 0; c < n; c++)
        if (idx[c] < 0 || ((idx[c] * unit) >> block_shift) >= blocks)
            return -1;
    for (int64_t c = 0; c < n; c++) {
        int64_t at = idx[c] * unit;
        uint64_t d = rfx_load(new + unit * c, unit) - rfx_load(old + unit * c, unit);
        int64_t lane = ((at >> block_shift) * RFX_LANES) + ((at >> 3) & (RFX_LANES - 1));
        lanes[lane] += d << (8 * (at & 7));
    }
    return 0;
}

static struct PyModuleDef rfx_module = {
    PyModuleDef_HEAD_INIT, "_delta", "refitd's delta refit kernels (called through ctypes)", -1, NULL,
};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&rfx_module); }
