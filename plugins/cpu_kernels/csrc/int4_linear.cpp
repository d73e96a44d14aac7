// int4 weight-only linear on CPU (contract: plugins/int4_linear/reference.py): y [M, N] = x [M, K] fp32 times
// w = code * scale + min, codes in [0, 15] in groups of G along K with one fp16 scale and min per (output
// channel, group), as llama.cpp's Q4_1: 0.625 bytes a weight at G = 32. The codes are blocked by 64 output
// channels and packed two k's a byte (codes_b [N/64, K/2, 64] uint8: low nibble k = 2i, high nibble k = 2i + 1),
// scales and mins blocked alike ([N/64, K/G, 64]). Each block walks down K once, reading its codes in order.
// The scale and min come out of each group's sum, as llama.cpp's dot products do: y = sum over groups of
// scale * (sum of code * x) + min * (sum of x), so a code costs one widening and one fused multiply-add a row
// (not a widening multiply-add by scale and min first: the kernel is compute-bound at one row). Rows go four
// at a time through the same arithmetic, so a row's result does not depend on its batch.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TRTKV_INT4_AVX512 1
#endif

namespace trtkv {
namespace {

constexpr int64_t NB = 64;
// Software prefetch ahead of the reads, as int8_linear.cpp does (a block crosses a 4 KiB page every 128 k's)
constexpr int64_t PREFETCH_BYTES = 4096;

#ifdef TRTKV_INT4_AVX512
// One group of G k's of a block for R rows: part[r][0:64] = sum over the group of code * x[r, k]
template <int R>
inline void group_sums(const float* x, int64_t K, int64_t k0, int64_t G, const uint8_t* cb, float (*part)[NB]) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k0 + G; k += 2) {
    const uint8_t* row = cb + (k / 2) * NB;
    _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES, _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), hi,
                                    _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), lo, acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(part[r] + 16 * j, acc[r][j]);
}

// tot[r][0:64] += scale * part[r] + min * xg[r] for one group: the group's sums folded into the block's totals
template <int R>
inline void fold_group(float (*tot)[NB], const float (*part)[NB], const float* xg, int64_t xg_stride,
                       const at::Half* srow, const at::Half* mrow) {
  for (int j = 0; j < 4; ++j) {
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(srow + 16 * j)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mrow + 16 * j)));
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_fmadd_ps(mn, _mm512_set1_ps(xg[r * xg_stride]), _mm512_loadu_ps(tot[r] + 16 * j));
      _mm512_storeu_ps(tot[r] + 16 * j, _mm512_fmadd_ps(sc, _mm512_loadu_ps(part[r] + 16 * j), t));
    }
  }
}
#else
// tot[r][0:64] += scale * part[r] + min * xg[r] for one group: the group's sums folded into the block's totals
template <int R>
inline void fold_group(float (*tot)[NB], const float (*part)[NB], const float* xg, int64_t xg_stride,
                       const at::Half* srow, const at::Half* mrow) {
  float sc[NB], mn[NB];
  for (int64_t j = 0; j < NB; ++j) {
    sc[j] = static_cast<float>(srow[j]);
    mn[j] = static_cast<float>(mrow[j]);
  }
  for (int r = 0; r < R; ++r) {
    const float xs = xg[r * xg_stride];
#pragma omp simd
    for (int64_t j = 0; j < NB; ++j) tot[r][j] = sc[j] * part[r][j] + (mn[j] * xs + tot[r][j]);
  }
}

template <int R>
inline void group_sums(const float* x, int64_t K, int64_t k0, int64_t G, const uint8_t* cb, float (*part)[NB]) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < NB; ++j) part[r][j] = 0.0f;
  float lo[NB], hi[NB];
  for (int64_t k = k0; k < k0 + G; k += 2) {
    const uint8_t* row = cb + (k / 2) * NB;
#pragma omp simd
    for (int64_t j = 0; j < NB; ++j) {
      lo[j] = static_cast<float>(row[j] & 15);
      hi[j] = static_cast<float>(row[j] >> 4);
    }
    for (int r = 0; r < R; ++r) {
      const float x0 = x[r * K + k], x1 = x[r * K + k + 1];
#pragma omp simd
      for (int64_t j = 0; j < NB; ++j) part[r][j] = x1 * hi[j] + (x0 * lo[j] + part[r][j]);
    }
  }
}
#endif

// R rows of one block of 64 output channels: every group's sums, folded by its scale and min
template <int R>
inline void block4(const float* x, const float* xg, int64_t K, int64_t G, const uint8_t* cb, const at::Half* sb,
                   const at::Half* mb, int64_t N, int64_t n0, int64_t nvalid, float* y) {
  alignas(64) float tot[R][NB] = {};
  alignas(64) float part[R][NB];
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
    group_sums<R>(x, K, g * G, G, cb, part);
    fold_group<R>(tot, part, xg + g, groups, sb + g * NB, mb + g * NB);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nvalid; ++j) y[r * N + n0 + j] = tot[r][j];
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
  // each row's sum of x over each group (what the groups' mins multiply), once for every block
  const int64_t groups = K / G;
  std::vector<float> xg_sums(M * groups);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) acc += xp[r * K + k];
      xg_sums[r * groups + g] = acc;
    }
  const float* xg = xg_sums.data();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K / 2 * NB, 1));
  at::parallel_for(0, nb, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n0 = b * NB, nvalid = std::min(NB, N - n0);
      const uint8_t* cb = cp + b * (K / 2) * NB;
      const at::Half* sb = sp + b * (K / G) * NB;
      const at::Half* mb = mp + b * (K / G) * NB;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) block4<4>(xp + m * K, xg + m * groups, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N);
      const float* xr = xp + m * K;
      const float* xgr = xg + m * groups;
      switch (M - m) {
        case 3: block4<3>(xr, xgr, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        case 2: block4<2>(xr, xgr, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        case 1: block4<1>(xr, xgr, K, G, cb, sb, mb, N, n0, nvalid, yp + m * N); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace trtkv
