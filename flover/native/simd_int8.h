/* Integer dot products on 16 lanes (the int8 tiles: weights of up to 6 bits, or Q8_0's signed
 * bytes, times inputs quantized to int8), whatever the instruction set, beside simd.h's float
 * mapping:
 *
 *   q64   64 bytes: 16 lanes (a block's 16 output rows) of 4 unsigned codes, each below 64
 *   i16   16 int32 lanes
 *   i_dot4(acc, w, x)   acc[r] += w[4r] x[0] + w[4r + 1] x[1] + w[4r + 2] x[2] + w[4r + 3] x[3]
 *                       (x: 4 signed bytes): AVX-512 VNNI / AVX-VNNI vpdpbusd, AVX-512BW / AVX2
 *                       maddubs + madd (no saturation below 64 x 127 x 2), NEON sdot (or
 *                       widening multiplies without dotprod), plain loops
 *   i_dot4x2(acc, w0, x0, w1, x1)   two of them: maddubs adds both pairs in int16 before
 *                       widening (at most 4 x 63 x 127), one widening instead of two
 *   q_high2(&h)         the next 2 bits of each byte of h moved to bits 4-5 (h's lowest two, then
 *                       h shifts down by 2 for the next call); q_or joins them to 4-bit codes:
 *                       6-bit codes from nibbles and their high bits
 *   q_lut16(b, table)    each byte (below 16) replaced by table[byte]: MXFP4's FP4 codes to
 *                       their values (plus 12, unsigned)
 *   q_crumb(&h)         h's lowest 2 bits of each byte (then h shifts down by 2): 2-bit codes
 *   q_bit2(&h)          h's lowest bit of each byte moved to bit 2 (then h shifts down by 1):
 *                       q_or joins it to a crumb, Q3_K's 3-bit codes
 *   q_fifth(&h, &lo, &hi)  5-bit codes from nibbles: h's bit 0 joins lo at bit 4, its bit 4
 *                       joins hi there, then h shifts down by 1 for the next call
 *   q_gather(p, stride, n)   16 rows' 4 bytes (rows stride bytes apart, rows n.. zeros), a lane each
 *   q_rows32(p, stride, n, out[8]), q_rows16(p, stride, n, out[4])   16 rows' 32 (16) bytes as 8 (4)
 *                       q_gather's: the keys of --kv-dtype's codes (AVX-512: loads and a transpose)
 *   s64   64 bytes of signed codes (-128..127: Q8_0's), as s_load prepares them
 *   s_dot4(acc, w, x)   i_dot4 for signed codes: VNNI adds (w + 128) x (its first operand is
 *                       unsigned), which s_done(acc, sum of the group's x) takes back once per
 *                       group; maddubs takes |w| times x with w's sign (at most 2 x 128 x 127);
 *                       NEON's sdot is signed already; s_from(w) prepares a q64 of signed
 *                       bytes the same way (IQ4's table values, looked up by q_lut16)
 *   g16   a group's sums before its scale (Q4_K's super-block tiles): maddubs' int16 pairs, or
 *         int32 where the family sums in int32 (VNNI, NEON, plain loops)
 *   G_INT32             1 where g16 sums in int32 (any number of calls before g_scaled)
 *   g_dot4x2(g, w0, x0, w1, x1)   i_dot4x2 into g: in int16 pairs at most 4 calls of codes below
 *                       16 before g_scaled (4 x 4 x 15 x 127 fits), or 1 of codes below 64
 *   g_scaled(acc, g, sc)   acc[r] += g[r] sc[r] (madd with the scale in both halves of a lane,
 *                       mullo, multiply-accumulate), sc from i_scales_u8 (16 unsigned bytes) or
 *                       i_scales_i8 (16 signed: Q6_K's)
 *   i_pairs_u8(a, b), i_pairs_dot(acc, pairs, two)   two groups' minimums per row (16 bytes
 *                       each), acc[r] += a[r] two[0] + b[r] two[1] (two int16: the inputs' sums);
 *                       i_pairs_i8 the same of signed bytes
 *   i_less32(a, b)      a[r] - 32 b[r] (Q6_K's offset taken back in integers)
 *
 * Every sum is exact (integers), so the families differ in no bit here.
 */
#ifndef FLOVER_SIMD_INT8_H
#define FLOVER_SIMD_INT8_H

#include "simd.h"

static inline int32_t x4_bytes(const int8_t *x) { /* 4 input bytes as one lane's worth */
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

#if defined(V_AVX512)
#include "arch/x86/avx512_int8.h"
#elif defined(V_AVX2)
#include "arch/x86/avx2_int8.h"
#elif defined(V_NEON)
#include "arch/arm/neon_int8.h"
#else
#include "arch/generic_int8.h"
#endif

#if !defined(HAVE_Q_ROWS) /* q_gather's lanes for 16 rows of 32 or 16 bytes */
static inline void q_rows32(const uint8_t *p, int64_t stride, int64_t n, q64 out[8]) {
    for (int i = 0; i < 8; i++) out[i] = q_gather(p + 4 * i, stride, n);
}
static inline void q_rows16(const uint8_t *p, int64_t stride, int64_t n, q64 out[4]) {
    for (int i = 0; i < 4; i++) out[i] = q_gather(p + 4 * i, stride, n);
}
#endif

#endif
