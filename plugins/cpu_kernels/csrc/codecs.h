// Scalar codecs shared by the CPU kernels: fp16/bf16 <-> fp32, E4M3 (fn), E2M1 and ternary elements.
// Decoders are branch-free so the compiler vectorizes the loops that call them; encoders replicate the
// torch references in plugins/formats/ step by step (fp32 math, same rounding), so kv_write is bit-exact.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace trtkv {

enum Fmt : int { FP32 = 0, FP16 = 1, BF16 = 2, FP8 = 3, NVFP4 = 4, TERNARY = 5, INT4 = 6, INT2 = 7,
                 NVFP4O = 8, TERNARYO = 9 };

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half -> fp32, exact for normals, subnormals, inf and NaN: shift the exponent/mantissa into
// fp32 position and rebias by multiplying with 2^112 (exact), then patch inf/NaN.
inline float half_to_float(uint16_t h) {
  uint32_t em = h & 0x7fffu;
  float mag = bits_to_float(em << 13) * 0x1p112f;
  uint32_t bits = float_to_bits(mag);
  bits = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : bits;
  return bits_to_float(bits | ((uint32_t)(h & 0x8000u) << 16));
}

inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

// n fp16 values -> fp32. Through F16C (vcvtph2ps, exact, 8 at a time) where the CPU has it: gcc leaves the
// portable conversion above scalar on AVX2.
inline void half_row_to_float(const uint16_t* src, int64_t n, float* dst) {
#ifdef __F16C__
  if (n % 8 == 0) {
    for (int64_t d = 0; d < n; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = half_to_float(src[d]);
}

// RNE casts with torch's NaN/inf handling (c10 implements exactly what Tensor.to() does on CPU).
inline uint16_t float_to_half_bits(float f) { return c10::Half(f).x; }
inline uint16_t float_to_bf16_bits(float f) { return c10::BFloat16(f).x; }

// n fp32 values -> fp16 bits, round to nearest even: F16C (vcvtps2ph, what Tensor.to(float16) runs on such
// CPUs) 8 at a time where the CPU has it, else c10's conversion per value.
inline void float_row_to_half(const float* src, int64_t n, uint16_t* dst) {
#ifdef __F16C__
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
  for (; d < n; ++d) dst[d] = float_to_half_bits(src[d]);
#else
  for (int64_t d = 0; d < n; ++d) dst[d] = float_to_half_bits(src[d]);
#endif
}

// E4M3fn bits -> fp32 (0x7F/0xFF are NaN), as plugins/formats/e4m3.py::e4m3_decode.
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 15, m = b & 7;
      float mag = e > 0 ? (float)(m + 8) * std::ldexp(1.0f, e - 10) : (float)m * 0x1p-9f;
      if ((b & 0x7f) == 0x7f) mag = NAN;
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
inline const E4M3Table& e4m3_table() { static const E4M3Table t; return t; }

// n E4M3 bytes -> fp32, as e4m3_table. With F16C (n % 8 == 0): a byte's exponent and mantissa bits become
// an fp16's (E4M3's bias 7 against fp16's 15: the fp16 is the value times 2^-8, subnormals included),
// converted 8 at a time and scaled back by 2^8 (exact); 0x7F/0xFF patched to NaN. ThinKV's annealed pages
// switch key group almost every token, and the table loop, once per switch and KV head, was ~40% of such an
// attention call.
inline void e4m3_row_to_float(const uint8_t* src, int64_t n, float* dst) {
#ifdef __F16C__
  if (n % 8 == 0) {
    const __m128i mag = _mm_set1_epi16(0x7f), sign = _mm_set1_epi16(0x80);
    const __m256 up = _mm256_set1_ps(256.0f);
    for (int64_t d = 0; d < n; d += 8) {
      const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
      const __m128i m = _mm_and_si128(x, mag);
      const __m128i h = _mm_or_si128(_mm_slli_epi16(m, 7), _mm_slli_epi16(_mm_and_si128(x, sign), 8));
      const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), up);  // 0x7F would read 480: NaN in E4M3fn
      const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(m, mag)));
      _mm256_storeu_ps(dst + d, _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan));
    }
    return;
  }
#endif
  const float* t = e4m3_table().v;
  for (int64_t d = 0; d < n; ++d) dst[d] = t[src[d]];
}

// fp32 -> E4M3fn bits (plugins/formats/e4m3.py::e4m3_encode): RNE or ceiling of the magnitude,
// saturating at 448, NaN -> 0 (sign kept), sign bit from the input's IEEE sign. Branch-free, so the loops
// that call it vectorize: the exponent comes from the float's bits (fp32 subnormals clamp to -6 like
// frexp's would), and a * 2^(3-e) is an exact power-of-two scaling built from bits (3-e in [-5, 9]).
inline uint8_t e4m3_encode(float x, bool round_up) {
  const uint32_t neg = float_to_bits(x) >> 31;
  float a = std::fabs(x);
  a = a == a ? a : 0.0f;  // NaN -> 0
  a = a > 448.0f ? 448.0f : a;
  int e = (int)((float_to_bits(a) >> 23) & 0xffu) - 127;  // floor(log2 a) for normals
  e = e < -6 ? -6 : e;  // zero and fp32 subnormals too: their m is then a * 2^9 (0 for zero)
  float m = a * bits_to_float((uint32_t)(3 - e + 127) << 23);
  m = round_up ? std::ceil(m) : std::nearbyint(m);  // nearbyint: round half to even (default mode)
  const bool carry = m == 16.0f;
  e = carry ? e + 1 : e;
  m = carry ? 8.0f : m;
  const bool normal = m >= 8.0f;
  const int exp_field = normal ? e + 7 : 0;
  const int man = normal ? (int)m - 8 : (int)m;
  return (uint8_t)((exp_field << 3) | man | (int)(neg << 7));
}

// E2M1 nibble (bit 3 sign) -> fp32, and fp32 -> nibble with RNE ties (plugins/formats/nvfp4.py).
// Decode builds the fp32 bit pattern (exponent e+126, mantissa bit m) so it vectorizes without a gather.
inline float e2m1_decode(int c) {
  const uint32_t e = (c >> 1) & 3, m = c & 1;
  const float normal = bits_to_float(((e + 126u) << 23) | (m << 22));
  const float mag = e == 0 ? (float)m * 0.5f : normal;
  return bits_to_float(float_to_bits(mag) | ((uint32_t)(c & 8) << 28));
}
inline int e2m1_encode(float r) {
  // NaN compares false everywhere (code 0) and anything above 6 counts every threshold (code 7), which is
  // exactly the reference's NaN -> 0 and clamp at 6; branch-free so the callers' loops vectorize.
  const float a = std::fabs(r);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return code | (int)((float_to_bits(r) >> 31) << 3);
}

// Ternary crumb: 01 -> +1, 11 -> -1, 00/10 -> 0; encode = round-half-even clamped to {-1,0,1}.
inline float ternary_decode(int c) { return (float)((c & 1) * (1 - (c & 2))); }
inline int ternary_encode(float r) {
  float q = std::nearbyint(r);
  return q > 0.0f ? 1 : (q < 0.0f ? 3 : 0);
}

// exp(x) for x <= 0 (softmax arguments), branch-free so loops over it vectorize: Cody-Waite range
// reduction x = n ln2 + r, |r| <= ln2/2, and the degree-6 minimax polynomial of Cephes' expf (rel. error
// ~2e-7, within 2 ulp of libm). Below -87.3 (exp underflows fp32) it returns 0; exp(-inf) = 0.
inline float exp_neg(float x) {
  const bool under = x < -87.3f;
  x = under ? -87.3f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scale = bits_to_float((uint32_t)((int32_t)n + 127) << 23);
  return under ? 0.0f : p * scale;
}

}  // namespace trtkv
