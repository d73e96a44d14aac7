// Paged attention over the 4- and 2-bit formats' codes, without dequantizing K (x86-64 with AVX-512 VBMI here;
// AVX2 machines: code_attention_avx2.h, the same task with 8-lane registers).
//
// Why a second task: dequantizing K per token to fp32 and transposing it for the scores
// (paged_attention.cpp's float-tile task) made a 4-bit page cost what an fp16 page does — the work per
// token was the same, only the bytes read were fewer. Here a tile holds up to 16 live tokens of one key
// group (the per-channel key scales are the group's), and per KV head:
//  - K: the tile's packed rows are transposed as bytes (a 16 x 16-byte block per shuffle network, a quarter
//    of the data a fp32 transpose moves), each byte column is widened once and its 2 (4) codes mapped to
//    values by a register-held table; the scores accumulate against queries pre-multiplied by the group's
//    key scales, global scale and softmax scale (once per group and head, not per token);
//  - V: each row is decoded 16 channels per broadcast, multishift and table permute, scaled as the
//    reference does and stored once for the P.V.
// The online softmax and P.V are paged_common.h's, shared with the float-tile task. Results equal the
// reference to fp32 rounding (the scale products are formed in a different order).
#pragma once
#include "code_tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define TRTKV_CODE_ATTENTION 1

#include <array>

namespace trtkv {

struct alignas(64) ByteIndex {
  uint8_t v[64];
};

// vpermb index: a zmm holding 4 rows x 16 bytes (row r in 128-bit lane r) -> dword c = the 4 rows' byte c.
constexpr ByteIndex rows_to_dwords() {
  ByteIndex ix{};
  for (int c = 0; c < 16; ++c)
    for (int r = 0; r < 4; ++r) ix.v[4 * c + r] = (uint8_t)(16 * r + c);
  return ix;
}

// vpmultishiftqb control: dword e of the result starts at element e's bit offset within a block of 16
// codes held in one qword (4-bit) or one dword repeated twice (2-bit); the other bytes are don't-care.
template <int BITS>
constexpr ByteIndex element_offsets() {
  ByteIndex ix{};
  for (int e = 0; e < 16; ++e) ix.v[4 * e] = (uint8_t)(BITS * e);
  return ix;
}

// 16 rows of 16 bytes (row r at rows[r] + off) -> out[16 c + r] = row r's byte c.
inline void transpose_bytes16(const uint8_t* const* rows, int64_t off, uint8_t* out) {
  static constexpr ByteIndex gather = rows_to_dwords();
  const __m512i ix = _mm512_load_si512(gather.v);
  __m512i z[4];
  for (int q = 0; q < 4; ++q) {
    __m512i t = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q] + off)));
    t = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 1] + off)), 1);
    t = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 2] + off)), 2);
    t = _mm512_inserti32x4(t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 3] + off)), 3);
    z[q] = _mm512_permutexvar_epi8(ix, t);  // dword c = rows 4q..4q+3 of column c
  }
  for (int m = 0; m < 4; ++m) {  // columns 4m..4m+3: lane k = dword 4m+k of z0, z1, z2, z3
    const __m512i pick = _mm512_setr_epi32(4 * m, 16 + 4 * m, 0, 0, 4 * m + 1, 17 + 4 * m, 0, 0, 4 * m + 2,
                                           18 + 4 * m, 0, 0, 4 * m + 3, 19 + 4 * m, 0, 0);
    const __m512i a = _mm512_permutex2var_epi32(z[0], pick, z[1]);
    const __m512i b = _mm512_permutex2var_epi32(z[2], pick, z[3]);
    _mm512_store_si512(out + 64 * m, _mm512_unpacklo_epi64(a, b));
  }
}

// Scores of the tile's 16 lanes for GC query heads: byte column c holds channels c*PER .. c*PER+PER-1 of
// the 16 tokens; qs rows are the group-scaled queries, c0 the key offsets' constant per head.
template <int FMT, int64_t D, int GC>
inline void score_chunk(const uint8_t* cols, const float* qs /*[GC][D]*/, const float* c0, __m512 tab,
                        float* out /*[GC][TILE]*/) {
  constexpr int BITS = code_bits<FMT>, PER = 8 / BITS;
  constexpr int64_t RB = D * BITS / 8;
  __m512 s[GC][2];
  for (int g = 0; g < GC; ++g) s[g][0] = s[g][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < RB; ++c) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(cols + 16 * c)));
#pragma GCC unroll 4
    for (int e = 0; e < PER; ++e) {
      const __m512 kv = _mm512_permutexvar_ps(e ? _mm512_srli_epi32(x, BITS * e) : x, tab);
      for (int g = 0; g < GC; ++g)
        s[g][e & 1] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + c * PER + e]), kv, s[g][e & 1]);
    }
  }
  for (int g = 0; g < GC; ++g)
    _mm512_storeu_ps(out + g * TILE, _mm512_add_ps(_mm512_add_ps(s[g][0], s[g][1]), _mm512_set1_ps(c0[g])));
}

// P.V of the tile for GV query heads of KV head h, V decoded straight into registers: each token's row
// is decoded once (16 channels per broadcast, multishift and table permute, then scaled: code * block scale,
// the global scale folded into the weights, or code * scale + zero for the integer formats) and multiplied into
// every head's accumulator, which stays in registers across the tile (GV * D/16 <= 16 of them).
// pw: the heads' softmax weights [GV][TILE]; alpha: their accumulators' rescale; acc: GV rows [D], stride D.
template <int FMT, int64_t D, int GV>
inline void pv_chunk(const Pools& p, const int64_t* slot_row, int64_t n, int64_t h, __m512 tab, const float* pw,
                     const float* alpha, float* acc) {
  constexpr int BITS = code_bits<FMT>;
  constexpr int64_t RB = D * BITS / 8, NB = D / 16;
  static_assert(GV * NB <= 16, "accumulators must fit the registers");
  static constexpr ByteIndex offsets = element_offsets<BITS>();
  const __m512i ctl = _mm512_load_si512(offsets.v);
  const float* e4m3 = e4m3_table().v;
  const __m512 sv = _mm512_set1_ps(p.sv);
  const uint8_t* const codes = p.f[1];
  const uint8_t* const scales = p.f[2];
  const uint16_t* const vs = reinterpret_cast<const uint16_t*>(p.f[2]);
  const uint16_t* const vz = reinterpret_cast<const uint16_t*>(p.f[3]);
  const int64_t H = p.H;
  constexpr bool integer = FMT == INT4 || FMT == INT2;
  alignas(64) float pg[GV][TILE];  // the weights times the global V scale (block-scaled formats), so that a
  for (int g = 0; g < GV; ++g)     // decoded row needs one multiply (by its block scale), not two
    _mm512_store_ps(pg[g], integer ? _mm512_loadu_ps(pw + g * TILE) : _mm512_mul_ps(_mm512_loadu_ps(pw + g * TILE), sv));
  __m512 a[GV][NB];
  for (int g = 0; g < GV; ++g)
    for (int64_t c = 0; c < NB; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), _mm512_set1_ps(alpha[g]));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = slot_row[i] * H + h;
    const uint8_t* vr = codes + row * RB;
    const int64_t vrow = row * NB;  // per-token value params [page, slot, h, d/16]
    __m512 v[NB];
    for (int64_t c = 0; c < NB; ++c) {
      __m512i src;
      if constexpr (BITS == 4) {
        int64_t w;
        std::memcpy(&w, vr + 8 * c, 8);
        src = _mm512_set1_epi64(w);
      } else {
        int32_t w;
        std::memcpy(&w, vr + 4 * c, 4);
        src = _mm512_set1_epi32(w);
      }
      const __m512 val = _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctl, src), tab);
      if constexpr (integer)
        v[c] = _mm512_fmadd_ps(val, _mm512_set1_ps(_cvtsh_ss(vs[vrow + c])), _mm512_set1_ps(_cvtsh_ss(vz[vrow + c])));
      else
        v[c] = _mm512_mul_ps(val, _mm512_set1_ps(e4m3[scales[vrow + c]]));
    }
    for (int g = 0; g < GV; ++g) {
      const __m512 pb = _mm512_set1_ps(pg[g][i]);
      for (int64_t c = 0; c < NB; ++c) a[g][c] = _mm512_fmadd_ps(pb, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GV; ++g)
    for (int64_t c = 0; c < NB; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// Queries of KV head h scaled by key group `gid`'s per-channel key parameters (and the global and softmax
// scales): score = sum_d qs[d] * code[d] + c0, the reference's (q . k) * sm_scale up to rounding. The
// group's parameters are read 16 channels at a time (E4M3 scales by a gather from the 256-entry table,
// fp16 ones by a conversion), once per tile whose group differs from the head's last.
template <int FMT, int64_t D>
inline void scale_queries(const Pools& p, const float* q, int64_t h, int64_t G, int64_t gid, float sm_scale,
                          float* qs /*[G][D]*/, float* c0 /*[G]*/) {
  constexpr int64_t NB = D / 16;
  constexpr bool integer = FMT == INT4 || FMT == INT2;
  constexpr bool offset = integer || FMT == NVFP4O || FMT == TERNARYO;
  const int64_t grow = (gid * p.H + h) * D;  // group field [gid, h, d]
  const float* e4m3 = e4m3_table().v;
  __m512 a[NB], b[NB];
  for (int64_t c = 0; c < NB; ++c) {
    const int64_t at = grow + 16 * c;
    if constexpr (integer) {
      a[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          reinterpret_cast<const uint16_t*>(p.g[0]) + at)));
    } else {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.g[0] + at)));
      a[c] = _mm512_i32gather_ps(idx, e4m3, 4);
    }
    if constexpr (offset)
      b[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          reinterpret_cast<const uint16_t*>(p.g[1]) + at)));
  }
  const __m512 ks = _mm512_set1_ps(integer ? sm_scale : p.sk * sm_scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + (h * G + g) * D;
    __m512 cs = _mm512_setzero_ps();
    for (int64_t c = 0; c < NB; ++c) {
      const __m512 qv = _mm512_loadu_ps(qg + 16 * c);
      _mm512_storeu_ps(qs + g * D + 16 * c, _mm512_mul_ps(_mm512_mul_ps(qv, a[c]), ks));
      if constexpr (offset) cs = _mm512_fmadd_ps(qv, b[c], cs);
    }
    c0[g] = offset ? _mm512_reduce_add_ps(cs) * sm_scale : 0.0f;
  }
}

template <int FMT, int64_t D>
void attend_task_codes(const Pools& p, const float* q /*[H*G, D]*/, const int32_t* table, const int32_t* valid,
                       int64_t p_lo, int64_t p_hi, int64_t G, float sm_scale, float* logits /*[H*G, P*B] or null*/,
                       int64_t logit_stride, float* m /*[H*G]*/, float* l /*[H*G]*/, float* acc /*[H*G, D]*/) {
  constexpr int64_t RB = D * code_bits<FMT> / 8;
  static_assert(RB % 16 == 0, "byte columns are transposed 16 at a time");
  static const CodeTable<FMT> lanes;
  static const uint8_t zeros[RB] = {};  // rows of the lanes past n
  const __m512 tab = _mm512_load_ps(lanes.v);
  const int64_t H = p.H;
  std::vector<float> qs(H * G * D), c0(H * G), sc(G * TILE + 16), alpha(G);
  std::vector<int64_t> qs_gid(H, -1);  // key group the scaled queries of head h were made for
  alignas(64) uint8_t cols[RB * TILE];
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
      float* sh = &sc[0];  // [G][TILE]: scores, then softmax weights
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gc = std::min<int64_t>(4, G - g0);
        const float* qg = &qs[(h * G + g0) * D];
        const float* cg = &c0[h * G + g0];
        float* o = sh + g0 * TILE;
        switch (gc) {
          case 1: score_chunk<FMT, D, 1>(cols, qg, cg, tab, o); break;
          case 2: score_chunk<FMT, D, 2>(cols, qg, cg, tab, o); break;
          case 3: score_chunk<FMT, D, 3>(cols, qg, cg, tab, o); break;
          default: score_chunk<FMT, D, 4>(cols, qg, cg, tab, o); break;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        alpha[g] = softmax_tile(sh + g * TILE, n, m[hg], l[hg], logits ? logits + hg * logit_stride : nullptr, where);
      }
      constexpr int GV = D == 64 ? 4 : 2;  // heads whose accumulators fit the registers at once
      for (int64_t g0 = 0; g0 < G; g0 += GV) {
        const int64_t gv = std::min<int64_t>(GV, G - g0);
        float* ag = acc + (h * G + g0) * D;
        const float* pw = sh + g0 * TILE;
        if (gv == GV) pv_chunk<FMT, D, GV>(p, slot_row, n, h, tab, pw, &alpha[g0], ag);
        else if (gv == 1) pv_chunk<FMT, D, 1>(p, slot_row, n, h, tab, pw, &alpha[g0], ag);
        else if constexpr (GV > 2) {
          if (gv == 2) pv_chunk<FMT, D, 2>(p, slot_row, n, h, tab, pw, &alpha[g0], ag);
          else pv_chunk<FMT, D, 3>(p, slot_row, n, h, tab, pw, &alpha[g0], ag);
        }
      }
    }
    n = 0;
  };
  for_each_group_tile<FMT, D>(p, table, valid, p_lo, p_hi, slot_row, where, n, gid, update);
}

}  // namespace trtkv
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TRTKV_CODE_ATTENTION 1
#include "code_attention_avx2.h"
#endif
