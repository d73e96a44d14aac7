// Paged attention over the 4- and 2-bit formats' codes on AVX2 (x86-64 without AVX-512 VBMI; included by
// code_attention.h, which holds the AVX-512 task and its rationale).
//
// With fp16 pages converted by F16C, the float-tile task made a 4-bit token cost more than an fp16 one on
// AVX2: the table decode, the per-element key scaling and the fp32 K transpose against one conversion per
// 8 elements. Here, as in the AVX-512 task, a tile is up to 16 live tokens of one key group and K never
// becomes fp32: the tile's packed rows are transposed as bytes (four rounds of SSE2 byte interleaves per
// 16 x 16 block), each byte column's 2 (4) codes of 16 tokens map to int8 values in one byte shuffle
// (paged_common.h's ByteCodes: the values times CODE_MULT) and widen to two 8-lane registers, and the scores
// accumulate against queries pre-multiplied by the group's key scales over CODE_MULT (once per group and head). V rows decode as in the float-tile task (load_v_row) and
// the softmax and P.V are paged_common.h's. Results equal the reference to fp32 rounding.
#pragma once
#include "code_tiles.h"

namespace trtkv {

// 16 rows of 16 bytes (row r at rows[r] + off) -> out[16 c + r] = row r's byte c: interleaving rows i and
// i + 8 byte by byte, four times over, transposes the block.
inline void transpose_bytes16(const uint8_t* const* rows, int64_t off, uint8_t* out) {
  __m128i a[16], b[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + off));
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 8; ++i) {
      b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]);
      b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
    }
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm_unpacklo_epi8(b[i], b[i + 8]);
      a[2 * i + 1] = _mm_unpackhi_epi8(b[i], b[i + 8]);
    }
  }
  for (int c = 0; c < 16; ++c) _mm_store_si128(reinterpret_cast<__m128i*>(out + 16 * c), a[c]);
}

inline float hsum8(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Queries of KV head h scaled by key group `gid`'s per-channel key parameters (and the global and softmax
// scales): score = sum_d qs[d] * code[d] + c0, the reference's (q . k) * sm_scale up to rounding.
template <int FMT, int64_t D>
inline void scale_queries(const Pools& p, const float* q, int64_t h, int64_t G, int64_t gid, float sm_scale,
                          float* qs /*[G][D]*/, float* c0 /*[G]*/) {
  constexpr bool integer = FMT == INT4 || FMT == INT2;
  constexpr bool offset = integer || FMT == NVFP4O || FMT == TERNARYO;
  const int64_t grow = (gid * p.H + h) * D;  // group field [gid, h, d]
  alignas(32) float a[D], b[offset ? D : 1];  // the group's key scales (fp32) and offsets / zeros
  for (int64_t c = 0; c < D; c += 8) {
    if constexpr (integer) {
      const uint16_t* g16 = reinterpret_cast<const uint16_t*>(p.g[0]) + grow + c;
      _mm256_store_ps(a + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g16))));
    } else {
      e4m3_row_to_float(p.g[0] + grow + c, 8, a + c);
    }
    if constexpr (offset) {
      const uint16_t* o16 = reinterpret_cast<const uint16_t*>(p.g[1]) + grow + c;
      _mm256_store_ps(b + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o16))));
    }
  }
  const __m256 ks = _mm256_set1_ps((integer ? sm_scale : p.sk * sm_scale) / CODE_MULT<FMT>);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + (h * G + g) * D;
    __m256 cs = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + c);
      _mm256_storeu_ps(qs + g * D + c, _mm256_mul_ps(_mm256_mul_ps(qv, _mm256_load_ps(a + c)), ks));
      if constexpr (offset) cs = _mm256_fmadd_ps(qv, _mm256_load_ps(b + c), cs);
    }
    c0[g] = offset ? hsum8(cs) * sm_scale : 0.0f;
  }
}

// Scores of the tile's 16 lanes for GC query heads: byte column c holds channels c*PER .. c*PER+PER-1 of
// the 16 tokens; qs rows are the group-scaled queries (over CODE_MULT), c0 the key offsets' constant per head.
template <int FMT, int64_t D, int GC>
inline void score_chunk(const uint8_t* cols, const float* qs /*[GC][D]*/, const float* c0, float* out /*[GC][TILE]*/) {
  constexpr int BITS = code_bits<FMT>, PER = 8 / BITS;
  constexpr int64_t RB = D * BITS / 8;
  static const ByteCodes<FMT> codes;
  const __m128i tab = _mm_load_si128(reinterpret_cast<const __m128i*>(codes.v));
  const __m128i mask = _mm_set1_epi8((1 << BITS) - 1);
  __m256 s[GC][2];
  for (int g = 0; g < GC; ++g) s[g][0] = s[g][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < RB; ++c) {
    const __m128i x = _mm_load_si128(reinterpret_cast<const __m128i*>(cols + 16 * c));
#pragma GCC unroll 4
    for (int e = 0; e < PER; ++e) {  // element e of each byte: a shift within 16-bit lanes, then the mask
      const __m128i vals = _mm_shuffle_epi8(tab, _mm_and_si128(e ? _mm_srli_epi16(x, BITS * e) : x, mask));
      const __m256 k0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vals));
      const __m256 k1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(vals, 8)));
      for (int g = 0; g < GC; ++g) {
        const __m256 qv = _mm256_set1_ps(qs[g * D + c * PER + e]);
        s[g][0] = _mm256_fmadd_ps(qv, k0, s[g][0]);
        s[g][1] = _mm256_fmadd_ps(qv, k1, s[g][1]);
      }
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m256 cg = _mm256_set1_ps(c0[g]);
    _mm256_storeu_ps(out + g * TILE, _mm256_add_ps(s[g][0], cg));
    _mm256_storeu_ps(out + g * TILE + 8, _mm256_add_ps(s[g][1], cg));
  }
}

template <int FMT, int64_t D>
void attend_task_codes(const Pools& p, const float* q /*[H*G, D]*/, const int32_t* table, const int32_t* valid,
                       int64_t p_lo, int64_t p_hi, int64_t G, float sm_scale, float* logits /*[H*G, P*B] or null*/,
                       int64_t logit_stride, float* m /*[H*G]*/, float* l /*[H*G]*/, float* acc /*[H*G, D]*/) {
  constexpr int64_t RB = D * code_bits<FMT> / 8;
  static_assert(RB % 16 == 0, "byte columns are transposed 16 at a time");
  static const uint8_t zeros[RB] = {};  // rows of the lanes past n
  const int64_t H = p.H;
  std::vector<float> qs(H * G * D), c0(H * G), sc(G * TILE), vt(TILE * D);
  std::vector<int64_t> qs_gid(H, -1);  // key group the scaled queries of head h were made for
  alignas(32) uint8_t cols[RB * TILE];
  const uint8_t* rows[TILE];
  int64_t where[TILE], slot_row[TILE];  // logit column, slot index page * B + slot
  int64_t n = 0, gid = -1;
  std::fill(m, m + H * G, NEG_INF);
  std::fill(l, l + H * G, 0.0f);
  std::fill(acc, acc + H * G * D, 0.0f);
  auto update = [&]() {  // fold the tile's n tokens (one key group) into every query head's state
    for (int64_t h = 0; h < H; ++h) {
      if (qs_gid[h] != gid) {
        scale_queries<FMT, D>(p, q, h, G, gid, sm_scale, &qs[h * G * D], &c0[h * G]);
        qs_gid[h] = gid;
      }
      for (int64_t i = 0; i < TILE; ++i) rows[i] = i < n ? p.f[0] + (slot_row[i] * H + h) * RB : zeros;
      for (int64_t blk = 0; blk < RB / 16; ++blk) transpose_bytes16(rows, 16 * blk, cols + 256 * blk);
      float* sh = sc.data();  // [G][TILE]: scores, then softmax weights
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gc = std::min<int64_t>(4, G - g0);
        const float* qg = &qs[(h * G + g0) * D];
        const float* cg = &c0[h * G + g0];
        float* o = sh + g0 * TILE;
        switch (gc) {
          case 1: score_chunk<FMT, D, 1>(cols, qg, cg, o); break;
          case 2: score_chunk<FMT, D, 2>(cols, qg, cg, o); break;
          case 3: score_chunk<FMT, D, 3>(cols, qg, cg, o); break;
          default: score_chunk<FMT, D, 4>(cols, qg, cg, o); break;
        }
      }
      for (int64_t i = 0; i < n; ++i) load_v_row<FMT>(p, slot_row[i] * H + h, &vt[i * D]);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        fold_tile<D>(sh + g * TILE, n, m[hg], l[hg], acc + hg * D, vt.data(), D,
                     logits ? logits + hg * logit_stride : nullptr, where);
      }
    }
    n = 0;
  };
  for_each_group_tile<FMT, D>(p, table, valid, p_lo, p_hi, slot_row, where, n, gid, update);
}

}  // namespace trtkv
