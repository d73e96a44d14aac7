// The int8 weight-only linear's lane masks of a block and its many-row half (int8_linear.cpp): a block's 64
// output channels over a chunk of KC inputs, already widened to fp32 in an L1-resident buffer, times every row.
// With more than 4 rows the kernels widen each chunk once and run every group of 4 rows over it, instead of
// widening the codes again for each group; a row's sums still add over k in order with one fused multiply-add
// per k (the accumulators live in y between chunks), so every row's result is the one-row kernel's, bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace trtkv {
namespace blocked {

constexpr int64_t NB = 64;  // output channels a block
constexpr int64_t KC = 64;  // inputs a chunk: a 16 KiB fp32 buffer

// the lanes of a block's four 16-channel vectors that hold one of its nvalid channels
inline void channel_masks(int64_t nvalid, __mmask16* mk) {
  for (int j = 0; j < 4; ++j) {
    const int64_t v = nvalid - 16 * j;
    mk[j] = v >= 16 ? static_cast<__mmask16>(0xFFFF) : v <= 0 ? 0 : static_cast<__mmask16>((1u << v) - 1);
  }
}

// y[r, 0:64] = (first ? 0 : y[r, 0:64]) + sum over kk < kn of x[r, kk] * buf[kk, 0:64], for R rows of x (row
// stride K) and y (row stride N), channels masked by mk; times scales[0:64] after the sums when given
template <int R>
inline void rows_over_chunk(const float* x, int64_t K, const float* buf, int64_t kn, float* y, int64_t N,
                            const __mmask16* mk, bool first, const float* scales) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[j], y + r * N + 16 * j);
  for (int64_t kk = 0; kk < kn; ++kk) {
    const float* row = buf + kk * NB;
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_load_ps(row + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + kk]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 s = scales ? _mm512_maskz_loadu_ps(mk[j], scales + 16 * j) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + r * N + 16 * j, mk[j], scales ? _mm512_mul_ps(acc[r][j], s) : acc[r][j]);
  }
}

// every row of x [M, K] over one widened chunk, in groups of 4
inline void all_rows_over_chunk(const float* x, int64_t M, int64_t K, const float* buf, int64_t kn, float* y,
                                int64_t N, const __mmask16* mk, bool first, const float* scales) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows_over_chunk<4>(x + m * K, K, buf, kn, y + m * N, N, mk, first, scales);
  switch (M - m) {
    case 3: rows_over_chunk<3>(x + m * K, K, buf, kn, y + m * N, N, mk, first, scales); break;
    case 2: rows_over_chunk<2>(x + m * K, K, buf, kn, y + m * N, N, mk, first, scales); break;
    case 1: rows_over_chunk<1>(x + m * K, K, buf, kn, y + m * N, N, mk, first, scales); break;
    default: break;
  }
}

}  // namespace blocked
}  // namespace trtkv
