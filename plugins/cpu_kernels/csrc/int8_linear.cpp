// int8 weight-only linear on CPU (contract: plugins/int8_linear/reference.py): y [M, N] = x [M, K] fp32 times
// int8 codes scaled per output channel, the codes blocked by 64 output channels (codes_b [N/64, K, 64], each
// block one contiguous run). At decode (a few rows) the weights' bytes decide the time: each block walks down
// K once, widening 64 codes to fp32 in registers and adding x[m, k] times them into every row's accumulators -
// the weights are read once, in order, a quarter of fp32's bytes, with no horizontal sums. Many rows (a
// prefill) are a GEMM: the caller multiplies the widened codes dense instead (plugins/ops.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "blocked_rows.h"
#define TRTKV_INT8_AVX512 1
#endif

namespace trtkv {
namespace {

constexpr int64_t NB = 64;  // output channels a block
// Software prefetch this many bytes ahead of the read: a block is a fresh 4 KiB page every few k's, which the
// hardware prefetcher does not cross, so a decode step's short calls otherwise wait on DRAM at every page
// (measured on a Sapphire Rapids VM: 10 -> 15-18 GB/s over SmolLM2's projections at one row).
constexpr int64_t PREFETCH_BYTES = 4096;

#ifdef TRTKV_INT8_AVX512
// 16 codes of a block row widened to fp32 (lanes past the block's channels: 0)
inline __m512 widen16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

template <int R>
inline void block_avx512(const float* x, int64_t K, const int8_t* ct, int64_t N, int64_t n0, int64_t nvalid,
                         const float* scales, float* y) {
  __m512 acc[R][4];
  __mmask16 mk[4];
  blocked::channel_masks(nvalid, mk);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = ct + k * NB;
    _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES, _MM_HINT_T0);  // (a row: one cache line)
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = widen16(row + 16 * j, mk[j]);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 s = _mm512_maskz_loadu_ps(mk[j], scales + n0 + 16 * j);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n0 + 16 * j, mk[j], _mm512_mul_ps(acc[r][j], s));
  }
}

// More than 4 rows: each chunk of the block's codes widened once, every row run over it (blocked_rows.h)
inline void block_many_rows(const float* x, int64_t M, int64_t K, const int8_t* ct, int64_t N, int64_t n0,
                            int64_t nvalid, const float* scales, float* y) {
  alignas(64) float buf[blocked::KC * NB];
  __mmask16 mk[4];
  blocked::channel_masks(nvalid, mk);
  for (int64_t k0 = 0; k0 < K; k0 += blocked::KC) {
    const int64_t kn = std::min(blocked::KC, K - k0);
    for (int64_t kk = 0; kk < kn; ++kk) {
      const int8_t* row = ct + (k0 + kk) * NB;
      _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES, _MM_HINT_T0);
      for (int j = 0; j < 4; ++j) _mm512_store_ps(buf + kk * NB + 16 * j, widen16(row + 16 * j, mk[j]));
    }
    blocked::all_rows_over_chunk(x + k0, M, K, buf, kn, y + n0, N, mk, k0 == 0,
                                 k0 + kn >= K ? scales + n0 : nullptr);
  }
}
#endif

template <int R>
inline void block_generic(const float* x, int64_t K, const int8_t* ct, int64_t N, int64_t n0, int64_t nvalid,
                          const float* scales, float* y) {
  float acc[R][NB] = {};
  float w[NB];
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = ct + k * NB;
#pragma omp simd
    for (int64_t j = 0; j < nvalid; ++j) w[j] = static_cast<float>(row[j]);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma omp simd
      for (int64_t j = 0; j < nvalid; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nvalid; ++j) y[r * N + n0 + j] = acc[r][j] * scales[n0 + j];
}

template <int R>
inline void block(const float* x, int64_t K, const int8_t* ct, int64_t N, int64_t n0, int64_t nvalid,
                  const float* scales, float* y) {
#ifdef TRTKV_INT8_AVX512
  block_avx512<R>(x, K, ct, N, n0, nvalid, scales, y);
#else
  block_generic<R>(x, K, ct, N, n0, nvalid, scales, y);
#endif
}

}  // namespace

at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& codes_b, const at::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "int8_linear: x [M, K] fp32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "int8_linear: scales [N] fp32");
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel();
  TORCH_CHECK(codes_b.scalar_type() == at::kChar && codes_b.dim() == 3 && codes_b.is_contiguous() &&
                  codes_b.size(0) == (N + NB - 1) / NB && codes_b.size(1) == K && codes_b.size(2) == NB,
              "int8_linear: codes_b [ceil(N/64), K, 64] int8 contiguous");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes_b.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + NB - 1) / NB;
  // a grain of blocks worth ~64 KiB of codes: small products stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K * NB, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n0 = b * NB, nvalid = std::min(NB, N - n0);
      const int8_t* cb = cp + b * K * NB;
#ifdef TRTKV_INT8_AVX512
      if (M > 4) {
        block_many_rows(xp, M, K, cb, N, n0, nvalid, sp, yp);
        continue;
      }
#endif
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) block<4>(xp + m * K, K, cb, N, n0, nvalid, sp, yp + m * N);
      switch (M - m) {
        case 3: block<3>(xp + m * K, K, cb, N, n0, nvalid, sp, yp + m * N); break;
        case 2: block<2>(xp + m * K, K, cb, N, n0, nvalid, sp, yp + m * N); break;
        case 1: block<1>(xp + m * K, K, cb, N, n0, nvalid, sp, yp + m * N); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace trtkv
