// int4 weight-only linear on CPU (contract: plugins/int4_linear/reference.py): y [M, N] = x [M, K] fp32 times
// w = code * scale + min, codes in [0, 15] in groups of G along K with one fp16 scale and min per (output
// channel, group), as llama.cpp's Q4_1: 0.625 bytes a weight at G = 32. The codes are blocked by 64 output channels and packed two k's a byte (codes_b [N/64, K/2, 64]
// uint8: low nibble k = 2i, high nibble k = 2i + 1), scales and mins blocked alike ([N/64, K/G, 64]). Each block
// walks down K once: 64 bytes give two k's of 64 channels, widened to fp32 with one fused multiply-add, then
// added times x[m, k] into every row's accumulators - half of int8's bytes, read once, in order.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "blocked_rows.h"
#define TRTKV_INT4_AVX512 1
#endif

namespace trtkv {
namespace {

constexpr int64_t NB = 64;
// Software prefetch ahead of the reads, as int8_linear.cpp does (a block crosses a 4 KiB page every 128 k's)
constexpr int64_t PREFETCH_BYTES = 4096;

#ifdef TRTKV_INT4_AVX512
// A group's scales and mins for the block's 64 channels, widened from fp16 once for its G / 2 rows of codes
inline void group_scales(const at::Half* srow, const at::Half* mrow, __m512* s, __m512* mn) {
  for (int j = 0; j < 4; ++j) {
    s[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(srow + 16 * j)));
    mn[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mrow + 16 * j)));
  }
}

// The two k's that the 64 bytes of a block row hold (k = 2i, 2i + 1), widened for channels 16j..16j+15: code *
// scale + min of its group, one fused multiply-add each
inline void widen_pair(const uint8_t* row, int j, __m512 s, __m512 mn, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), s, mn);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, mn);
}

// prefetch ahead of the codes at k, and at a group's start the next groups' scales and mins (128 bytes each)
inline void prefetch_ahead(int64_t k, int64_t G, const uint8_t* row, const at::Half* srow, const at::Half* mrow) {
  _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES, _MM_HINT_T0);
  if (k % G == 0)
    for (int64_t b = 0; b < 128; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(srow) + 1024 + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(mrow) + 1024 + b, _MM_HINT_T0);
    }
}

template <int R>
inline void block4_avx512(const float* x, int64_t K, int64_t G, const uint8_t* cb, const at::Half* sb,
                          const at::Half* mb, int64_t N, int64_t n0, int64_t nvalid, float* y) {
  __m512 acc[R][4], s[4], mn[4];
  __mmask16 mk[4];
  blocked::channel_masks(nvalid, mk);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint8_t* row = cb + (k / 2) * NB;
    const at::Half* srow = sb + (k / G) * NB;
    const at::Half* mrow = mb + (k / G) * NB;
    prefetch_ahead(k, G, row, srow, mrow);
    if (k % G == 0) group_scales(srow, mrow, s, mn);
    __m512 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) widen_pair(row, j, s[j], mn[j], lo[j], hi[j]);
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r * K + k]);
      const __m512 x1 = _mm512_set1_ps(x[r * K + k + 1]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(x1, hi[j], _mm512_fmadd_ps(x0, lo[j], acc[r][j]));
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n0 + 16 * j, mk[j], acc[r][j]);
}

// More than 4 rows: each chunk of the block's codes widened once, every row run over it (blocked_rows.h)
inline void block4_many_rows(const float* x, int64_t M, int64_t K, int64_t G, const uint8_t* cb,
                             const at::Half* sb, const at::Half* mb, int64_t N, int64_t n0, int64_t nvalid, float* y) {
  alignas(64) float buf[blocked::KC * NB];
  __m512 s[4], mn[4];
  __mmask16 mk[4];
  blocked::channel_masks(nvalid, mk);
  for (int64_t k0 = 0; k0 < K; k0 += blocked::KC) {
    const int64_t kn = std::min(blocked::KC, K - k0);  // (even: K and KC are)
    for (int64_t kk = 0; kk < kn; kk += 2) {
      const int64_t k = k0 + kk;
      const uint8_t* row = cb + (k / 2) * NB;
      const at::Half* srow = sb + (k / G) * NB;
      const at::Half* mrow = mb + (k / G) * NB;
      prefetch_ahead(k, G, row, srow, mrow);
      if (k % G == 0) group_scales(srow, mrow, s, mn);
      __m512 lo, hi;
      for (int j = 0; j < 4; ++j) {
        widen_pair(row, j, s[j], mn[j], lo, hi);
        _mm512_store_ps(buf + kk * NB + 16 * j, lo);
        _mm512_store_ps(buf + (kk + 1) * NB + 16 * j, hi);
      }
    }
    blocked::all_rows_over_chunk(x + k0, M, K, buf, kn, y + n0, N, mk, k0 == 0, nullptr);
  }
}
#endif

template <int R>
inline void block4_generic(const float* x, int64_t K, int64_t G, const uint8_t* cb, const at::Half* sb,
                           const at::Half* mb, int64_t N, int64_t n0, int64_t nvalid, float* y) {
  float acc[R][NB] = {};
  float lo[NB], hi[NB], sc[NB], mn[NB];
  for (int64_t k = 0; k < K; k += 2) {
    const uint8_t* row = cb + (k / 2) * NB;
    if (k % G == 0)  // the group's scales and mins, widened once for its G / 2 rows of codes
      for (int64_t j = 0; j < NB; ++j) {
        sc[j] = static_cast<float>(sb[(k / G) * NB + j]);
        mn[j] = static_cast<float>(mb[(k / G) * NB + j]);
      }
#pragma omp simd
    for (int64_t j = 0; j < NB; ++j) {
      lo[j] = static_cast<float>(row[j] & 15) * sc[j] + mn[j];
      hi[j] = static_cast<float>(row[j] >> 4) * sc[j] + mn[j];
    }
    for (int r = 0; r < R; ++r) {
      const float x0 = x[r * K + k], x1 = x[r * K + k + 1];
#pragma omp simd
      for (int64_t j = 0; j < NB; ++j) acc[r][j] = acc[r][j] + x0 * lo[j] + x1 * hi[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nvalid; ++j) y[r * N + n0 + j] = acc[r][j];
}

template <int R>
inline void block4(const float* x, int64_t K, int64_t G, const uint8_t* cb, const at::Half* sb, const at::Half* mb,
                   int64_t N, int64_t n0, int64_t nvalid, float* y) {
#ifdef TRTKV_INT4_AVX512
  block4_avx512<R>(x, K, G, cb, sb, mb, N, n0, nvalid, y);
#else
  block4_generic<R>(x, K, G, cb, sb, mb, N, n0, nvalid, y);
#endif
}

}  // namespace

at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales_b,
                           const at::Tensor& mins_b, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "int4_linear: x [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), N = n, nb = (N + NB - 1) / NB;
  TORCH_CHECK(K % 2 == 0, "int4_linear: K must be even");
  TORCH_CHECK(codes_b.scalar_type() == at::kByte && codes_b.is_contiguous() && codes_b.dim() == 3 &&
                  codes_b.size(0) == nb && codes_b.size(1) == K / 2 && codes_b.size(2) == NB,
              "int4_linear: codes_b [ceil(N/64), K/2, 64] uint8 contiguous");
  TORCH_CHECK(scales_b.scalar_type() == at::kHalf && scales_b.is_contiguous() && scales_b.dim() == 3 &&
                  scales_b.size(0) == nb && scales_b.size(2) == NB && K % scales_b.size(1) == 0 &&
                  (K / scales_b.size(1)) % 2 == 0,
              "int4_linear: scales_b [ceil(N/64), K/G, 64] fp16 contiguous, G even");
  TORCH_CHECK(mins_b.scalar_type() == at::kHalf && mins_b.is_contiguous() && mins_b.sizes() == scales_b.sizes(),
              "int4_linear: mins_b shaped as scales_b, fp16 contiguous");
  const int64_t G = K / scales_b.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes_b.data_ptr<uint8_t>();
  const at::Half* sp = scales_b.data_ptr<at::Half>();
  const at::Half* mp = mins_b.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K / 2 * NB, 1));
  at::parallel_for(0, nb, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n0 = b * NB, nvalid = std::min(NB, N - n0);
      const uint8_t* cb = cp + b * (K / 2) * NB;
      const at::Half* sb = sp + b * (K / G) * NB;
      const at::Half* mb = mp + b * (K / G) * NB;
#ifdef TRTKV_INT4_AVX512
      if (M > 4) {
        block4_many_rows(xp, M, K, G, cb, sb, mb, N, n0, nvalid, yp);
        continue;
      }
#endif
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) block4<4>(xp + m * K, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N);
      switch (M - m) {
        case 3: block4<3>(xp + m * K, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        case 2: block4<2>(xp + m * K, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        case 1: block4<1>(xp + m * K, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace trtkv
