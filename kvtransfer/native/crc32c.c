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

   Where the CPU has VPCLMULQDQ (carry-less multiplies on 256-bit registers: Ice Lake, Zen 3 and
   later), long inputs are folded instead: eight 32-byte accumulators each take the next 256 bytes
   after multiplying their two 64-bit halves by x^(2048+64) and x^2048 mod P (the same class, so the
   CRC is unchanged), and the last 16-byte accumulator is hashed with the crc32 instruction (which
   multiplies by x^32 and reduces, the CRC's own definition). The multiplies are not serialised like
   the crc32 instruction, and a copy that hashes folds each 32-byte load before storing it, so the
   source is read once, into registers. On the 2-core Zen 4 box, 1,024 scattered 360 KiB pages
   (377 MB): the copy that hashes 43 -> 23 ms (as fast as the copy alone), the check of what landed
   26 -> 17 ms (docs/benchmarks.md, "KV transfer"). Without VPCLMULQDQ the lanes above stay (128-bit
   PCLMULQDQ alone is no faster than them on most of those CPUs).

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

#ifdef TANDEM_X86
#include <immintrin.h>
#define FOLD_BLOCK 256 /* bytes the eight accumulators take per step */

/* x^e mod P as the 64-bit operand a reflected carry-less multiply needs: the remainder's 32 bits
   reversed into the high half. The product of such an operand and a reflected 64-bit value comes out
   one degree short, so fold constants use e - 1. */
static uint64_t xpow_reflected(int e) {
    uint32_t v = 1; /* normal (unreflected) form */
    for (int i = 0; i < e; i++) v = (v << 1) ^ ((v & 0x80000000u) ? 0x1EDC6F41u : 0u);
    uint32_t r = 0;
    for (int b = 0; b < 32; b++) r |= ((v >> b) & 1u) << (31 - b);
    return (uint64_t)r << 32;
}

/* Per fold distance d (bits; 2048, 1024, 512, 256, 128): (x^(d+63), x^(d-1)) for a 16-byte lane's
   earlier and later halves. */
static uint64_t fold_k[5][2];
static int clmul; /* the fold is in use (tandem_crc32c_use) */

#define CLMUL_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

CLMUL_TARGET static __m256i fold256(__m256i x, __m256i k, __m256i next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), next);
}

CLMUL_TARGET static __m256i kpair(int i) {
    return _mm256_set_epi64x((long long)fold_k[i][1], (long long)fold_k[i][0], (long long)fold_k[i][1],
                             (long long)fold_k[i][0]);
}

/* The register after the eight accumulators: folded into one 16-byte lane, which the crc32
   instruction reduces. */
CLMUL_TARGET static uint32_t clmul_reduce(__m256i *x) {
    const __m256i k1024 = kpair(1), k512 = kpair(2), k256 = kpair(3);
    for (int i = 0; i < 4; i++) x[i + 4] = fold256(x[i], k1024, x[i + 4]);
    x[6] = fold256(x[4], k512, x[6]);
    x[7] = fold256(x[5], k512, x[7]);
    x[7] = fold256(x[6], k256, x[7]);
    __m128i lo = _mm256_castsi256_si128(x[7]), hi = _mm256_extracti128_si256(x[7], 1);
    const __m128i k128 = _mm_set_epi64x((long long)fold_k[4][1], (long long)fold_k[4][0]);
    hi = _mm_xor_si128(hi, _mm_xor_si128(_mm_clmulepi64_si128(lo, k128, 0x00), _mm_clmulepi64_si128(lo, k128, 0x11)));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(hi));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(hi, 1));
}

/* The register after the whole FOLD_BLOCKs of p (n >= FOLD_BLOCK); the caller hashes the rest. */
CLMUL_TARGET static uint32_t clmul_update(uint32_t r, const uint8_t *p, size_t n) {
    __m256i x[8];
    for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_si256((const __m256i *)(p + 32 * i));
    x[0] = _mm256_xor_si256(x[0], _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)r)); /* the register starts it */
    const __m256i k2048 = kpair(0);
    for (p += FOLD_BLOCK, n -= FOLD_BLOCK; n >= FOLD_BLOCK; p += FOLD_BLOCK, n -= FOLD_BLOCK)
        for (int i = 0; i < 8; i++) x[i] = fold256(x[i], k2048, _mm256_loadu_si256((const __m256i *)(p + 32 * i)));
    return clmul_reduce(x);
}

/* clmul_update of s's whole FOLD_BLOCKs while they are stored to d (32-byte aligned) past the cache:
   one load of each byte for both. */
CLMUL_TARGET static uint32_t clmul_copy(uint32_t r, uint8_t *d, const uint8_t *s, size_t n) {
    __m256i x[8];
    for (int i = 0; i < 8; i++) {
        x[i] = _mm256_loadu_si256((const __m256i *)(s + 32 * i));
        _mm256_stream_si256((__m256i *)(d + 32 * i), x[i]);
    }
    x[0] = _mm256_xor_si256(x[0], _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)r));
    const __m256i k2048 = kpair(0);
    for (s += FOLD_BLOCK, d += FOLD_BLOCK, n -= FOLD_BLOCK; n >= FOLD_BLOCK; s += FOLD_BLOCK, d += FOLD_BLOCK, n -= FOLD_BLOCK)
        for (int i = 0; i < 8; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(s + 32 * i));
            _mm256_stream_si256((__m256i *)(d + 32 * i), v);
            x[i] = fold256(x[i], k2048, v);
        }
    return clmul_reduce(x);
}
#endif

static uint32_t update(uint32_t r, const uint8_t *p, size_t n) {
#ifdef TANDEM_X86
    if (clmul && n >= FOLD_BLOCK) {
        size_t whole = n - n % FOLD_BLOCK;
        r = clmul_update(r, p, whole);
        p += whole, n -= whole;
    }
    if (hw) return hw_update(r, p, n);
#endif
    return sw_update(r, p, n);
}

int tandem_crc32c_use(int level);
#ifdef TANDEM_X86
static int cpu_hw, cpu_clmul; /* what the CPU has, found once by tandem_crc32c_init */
#endif

/* Fills the tables; returns the path in effect (tandem_crc32c_use: 2 the fold, 1 the crc32
   instruction, 0 the table). */
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
    const int d[5] = {2048, 1024, 512, 256, 128};
    for (int i = 0; i < 5; i++) fold_k[i][0] = xpow_reflected(d[i] + 63), fold_k[i][1] = xpow_reflected(d[i] - 1);
    cpu_hw = hw;
    cpu_clmul = hw && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
                __builtin_cpu_supports("pclmul");   /* and the OS saves their registers */
#endif
    return tandem_crc32c_use(2);
}

/* Which path hashes from now on, at most `level` (0: the table, 1: the crc32 instruction's lanes,
   2: the carry-less fold where the CPU has it); returns the level in effect. For tests and
   benchmarks: call it before other threads hash. */
int tandem_crc32c_use(int level) {
#ifdef TANDEM_X86
    hw = level >= 1 && cpu_hw;
    clmul = level >= 2 && cpu_clmul;
    return clmul ? 2 : hw ? 1 : 0;
#else
    (void)level;
    return 0;
#endif
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
#ifdef TANDEM_X86
    if (sum && clmul && left >= FOLD_BLOCK && !((uintptr_t)d & 31)) {  /* hashed in registers as copied */
        size_t whole = left - left % FOLD_BLOCK;
        r = clmul_copy(r, d, s, whole);
        s += whole, d += whole, left -= whole;
    }
#endif
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
