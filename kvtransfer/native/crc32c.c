/* CRC-32C (Castagnoli, the iSCSI/ext4 polynomial) of KV pages, straight from pool memory.

   What kvtransfer/protocol/checksum.py's `crc32c` algorithm computes: the standard CRC-32C of a byte
   string given as blocks of a pool (no staging copy), with the x86 `crc32` instruction (SSE4.2) where
   the CPU has it and a table otherwise (same results).

   Speed: one `crc32` instruction takes 8 bytes but its result is ready only 3 cycles later, so one
   stream runs at a third of the instruction's rate (~9.5 GB/s on a Zen 4 core). The data is cut into
   chunks of three lanes of LANE bytes, hashed side by side and joined with the CRC's linearity:
   crc(A || B) = shift_|B|(crc(A)) ^ crc0(B), where crc0 starts from a zero register and shift_n(x),
   the register x after n zero bytes, is linear in x: four lookups in a table made once. Lanes of 128
   bytes keep the three streams within one 384-byte window, which the hardware prefetcher follows;
   long lanes (a third of a 6 KiB block each) were measured at half the speed from memory (8 vs 17
   GB/s; 23 vs 26 GB/s in cache).

   All functions take and return the raw register (no inversion); callers start from ~0 and invert
   the end, as the standard says. Plain C, no Python or torch headers: loaded with ctypes, which
   releases the GIL for each call. tandem_crc32c_init() must run once before any other call (the
   loader does, before any thread can call in). */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define TANDEM_X86 1
#endif

#define POLY 0x82F63B78u /* CRC-32C, reflected */
#define LANE 128

static uint32_t table8[256];   /* one byte at a time (the portable path and the shift table's maker) */
static uint32_t shift128[1024]; /* shift_LANE as four byte-indexed tables */
static int hw;                  /* the CPU has SSE4.2 */

static uint32_t sw_update(uint32_t r, const uint8_t *p, size_t n) {
    while (n--) r = (r >> 8) ^ table8[(r ^ *p++) & 0xFFu];
    return r;
}

static uint32_t shift(uint32_t x) {
    return shift128[x & 0xFFu] ^ shift128[256 + ((x >> 8) & 0xFFu)] ^ shift128[512 + ((x >> 16) & 0xFFu)] ^
           shift128[768 + (x >> 24)];
}

#ifdef TANDEM_X86
__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t r, const uint8_t *p, size_t n) {
    for (; n >= 3 * LANE; n -= 3 * LANE, p += 3 * LANE) {
        uint64_t a = r, b = 0, c = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + LANE + i, 8);
            memcpy(&z, p + 2 * LANE + i, 8);
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            c = _mm_crc32_u64(c, z);
        }
        r = shift(shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
    }
    uint64_t r64 = r;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        r64 = _mm_crc32_u64(r64, v);
    }
    r = (uint32_t)r64;
    for (; n; n--) r = _mm_crc32_u8(r, *p++);
    return r;
}
#endif

static uint32_t update(uint32_t r, const uint8_t *p, size_t n) {
#ifdef TANDEM_X86
    if (hw) return hw_update(r, p, n);
#endif
    return sw_update(r, p, n);
}

/* Fills the tables; returns 1 where the crc32 instruction is used, 0 where the table is. */
int tandem_crc32c_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int k = 0; k < 8; k++) r = (r >> 1) ^ (POLY & (0u - (r & 1u)));
        table8[b] = r;
    }
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) {
        uint32_t r = 1u << bit;
        for (int i = 0; i < LANE; i++) r = (r >> 8) ^ table8[r & 0xFFu];
        basis[bit] = r;
    }
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int bit = 0; bit < 8; bit++)
                if (b & (1u << bit)) v ^= basis[8 * k + bit];
            shift128[256 * k + b] = v;
        }
#ifdef TANDEM_X86
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    return hw;
}

/* The raw register after n bytes from p, starting from r. */
uint32_t tandem_crc32c_update(uint32_t r, const uint8_t *p, size_t n) { return update(r, p, n); }

/* The raw register after the pages of `runs` ([n_runs][2]: first page, page count) of every region,
   region-major, then run, then page: region g starts at base + g * region_stride, and page p's
   `piece` bytes in it at p * page_stride (a run is one span of count * piece bytes where
   piece == page_stride). The order a tcp WRITE puts the bytes on the wire (kvtransfer/base.py,
   Geometry). */
uint32_t tandem_crc32c_runs(uint32_t r, const uint8_t *base, int64_t regions, int64_t region_stride,
                            int64_t piece, int64_t page_stride, const int64_t *runs, int64_t n_runs) {
    const int whole = piece == page_stride;
    for (int64_t g = 0; g < regions; g++)
        for (int64_t i = 0; i < n_runs; i++) {
            const uint8_t *p = base + g * region_stride + runs[2 * i] * page_stride;
            if (whole) r = update(r, p, (size_t)(runs[2 * i + 1] * piece));
            else
                for (int64_t k = 0; k < runs[2 * i + 1]; k++) r = update(r, p + k * page_stride, (size_t)piece);
        }
    return r;
}

/* The raw register after the bytes of iovecs ([n][2]: address, length), in order. */
uint32_t tandem_crc32c_iov(uint32_t r, const uint64_t *iov, int64_t n) {
    for (int64_t i = 0; i < n; i++) r = update(r, (const uint8_t *)(uintptr_t)iov[2 * i], (size_t)iov[2 * i + 1]);
    return r;
}

#define COPY_CHUNK (32 << 10) /* hashed, then copied while it is in the L1/L2 cache */

#ifdef TANDEM_X86
#include <emmintrin.h>
/* memcpy with stores that bypass the cache (x86-64 always has SSE2). A KV write is far larger than
   the cache and read next by another process: regular stores would first read every destination line
   from memory (read-for-ownership) and evict the source. Measured on the 2-core box, 1,024 scattered
   360 KiB pages: 19-20 ms against memcpy's 26-27 ms. Weakly ordered: tandem_copy_runs fences once at
   its end, before the caller tells the reader. */
__attribute__((target("sse2"))) static void stream_copy(uint8_t *d, const uint8_t *s, size_t n) {
    for (; n && ((uintptr_t)d & 15); n--) *d++ = *s++;
    for (; n >= 64; n -= 64, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
__attribute__((target("sse2"))) static void store_fence(void) { _mm_sfence(); }
#else
static void stream_copy(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
static void store_fence(void) {}
#endif

static uint32_t copy_span(uint32_t r, int sum, uint8_t *d, const uint8_t *s, size_t left) {
    while (left) {
        size_t n = left < COPY_CHUNK ? left : COPY_CHUNK;
        if (sum) r = update(r, s, n);   /* the source chunk into the cache, then copied from there */
        stream_copy(d, s, n);
        s += n, d += n, left -= n;
    }
    return r;
}

/* Copies runs ([n_runs][3]: src page, dst page, count) of every region from src to dst (regions
   `src_stride` / `dst_stride` bytes apart; a page's `piece` bytes every `page_stride` bytes in a
   region), in tandem_crc32c_runs's order; with `sum`, returns the raw register after the source
   bytes in that order, starting from r (each chunk is hashed just before it is copied: one read of
   the source from memory for both). */
uint32_t tandem_copy_runs(uint32_t r, int sum, uint8_t *dst, const uint8_t *src, int64_t regions,
                          int64_t dst_stride, int64_t src_stride, int64_t piece, int64_t page_stride,
                          const int64_t *runs, int64_t n_runs) {
    const int whole = piece == page_stride;
    for (int64_t g = 0; g < regions; g++)
        for (int64_t i = 0; i < n_runs; i++) {
            const uint8_t *s = src + g * src_stride + runs[3 * i] * page_stride;
            uint8_t *d = dst + g * dst_stride + runs[3 * i + 1] * page_stride;
            if (whole) r = copy_span(r, sum, d, s, (size_t)(runs[3 * i + 2] * piece));
            else
                for (int64_t k = 0; k < runs[3 * i + 2]; k++)
                    r = copy_span(r, sum, d + k * page_stride, s + k * page_stride, (size_t)piece);
        }
    store_fence();
    return r;
}
