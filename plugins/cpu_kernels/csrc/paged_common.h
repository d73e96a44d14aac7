// Pieces shared by the CPU paged-attention tasks (paged_attention.cpp, code_attention.h): the pools' raw
// pointers, key-group rows, code tables, and the online-softmax fold of one tile.
#pragma once
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "codecs.h"

#if defined(__AVX2__) || defined(__F16C__) || (defined(__AVX512F__) && defined(__AVX512BW__))
#include <immintrin.h>
#endif

namespace trtkv {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t SERIAL_SLOT_HEADS = 4096;

struct Pools {
  const uint8_t* f[4] = {nullptr, nullptr, nullptr, nullptr};
  const uint8_t* g[2] = {nullptr, nullptr};
  const int32_t* k_group = nullptr;
  int64_t H = 0, D = 0, B = 0;
  float sk = 1.0f, sv = 1.0f;
};

// Key-group parameters of recent (flush group, KV head) pairs decoded to fp32 rows [D], cached across the
// slots of a task, direct-mapped by group id: a flush group's 16 tokens usually sit side by side (one entry
// would do), but an annealed page's freed slots are refilled by newer groups, so its slots alternate between
// a few groups (ThinKV at budget 256: runs of ~2 tokens) and a single entry was decoded again every other slot.
struct GroupRows {
  static constexpr int64_t WAYS = 16;  // a power of two
  int64_t gid[WAYS];
  std::vector<float> a, b;  // [WAYS][D] block-scaled: E4M3 key scale, key offset; int: key scale, key zero
  explicit GroupRows(int64_t D) : a(WAYS * D), b(WAYS * D) { std::fill(gid, gid + WAYS, int64_t(-1)); }
};

// Offset of group `gid`'s rows (head h) in gr.a / gr.b, decoding them into their entry on a miss.
template <int FMT>
inline int64_t load_group(const Pools& p, int64_t gid, int64_t h, GroupRows& gr) {
  const int64_t D = p.D, e = gid & (GroupRows::WAYS - 1), off = e * D;
  if (gr.gid[e] == gid) return off;
  gr.gid[e] = gid;
  const int64_t grow = (gid * p.H + h) * D;  // group field [gid, h, d]
  if constexpr (FMT == INT4 || FMT == INT2) {
    const uint16_t* ks = reinterpret_cast<const uint16_t*>(p.g[0]) + grow;
    const uint16_t* kz = reinterpret_cast<const uint16_t*>(p.g[1]) + grow;
    half_row_to_float(ks, D, gr.a.data() + off);
    half_row_to_float(kz, D, gr.b.data() + off);
  } else {
    e4m3_row_to_float(p.g[0] + grow, D, gr.a.data() + off);
    if constexpr (FMT == NVFP4O || FMT == TERNARYO) {
      const uint16_t* ko = reinterpret_cast<const uint16_t*>(p.g[1]) + grow;
      half_row_to_float(ko, D, gr.b.data() + off);
    }
  }
  return off;
}

// Packed codes -> element values through one table row per byte (the scalar decoders' exact values; a
// byte holds 2 four-bit or 4 two-bit codes, element d at bits BITS*(d % per) of byte d / per): one small copy per byte instead
// of a shift, mask and decode per element, which did not vectorize (NVFP4 pages were read ~7x slower than
// fp16 ones; docs/benchmarks.md). INT codes become their integer values.
template <int FMT>
struct ByteLut {
  static constexpr int PER = (FMT == NVFP4 || FMT == NVFP4O || FMT == INT4) ? 2 : 4;
  float v[256][PER];
  ByteLut() {
    constexpr int BITS = 8 / PER;
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < PER; ++j) {
        const int c = (b >> (BITS * j)) & ((1 << BITS) - 1);
        v[b][j] = (FMT == INT4 || FMT == INT2) ? (float)c : (PER == 2 ? e2m1_decode(c) : ternary_decode(c));
      }
  }
};

template <int FMT>
inline void unpack_bytes(const uint8_t* bytes, int64_t nbytes, float* out) {
  static const ByteLut<FMT> lut;
  constexpr int PER = ByteLut<FMT>::PER;
  for (int64_t i = 0; i < nbytes; ++i) std::memcpy(out + i * PER, lut.v[bytes[i]], PER * sizeof(float));
}

// The (at most 16) element values of a format's codes, indexed by a code's low 4 bits (the vector unpacks).
template <int FMT>
struct CodeTable {
  alignas(64) float v[16];
  CodeTable() {
    const ByteLut<FMT> lut;
    constexpr int PER = ByteLut<FMT>::PER;
    for (int i = 0; i < 16; ++i) {
      const int c = PER == 2 ? i : (i & 3);
      v[i] = lut.v[PER == 2 ? c | (c << 4) : c * 0x55][0];
    }
  }
};

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__AVX2__)
// The codes of 16 packed bytes as byte indices in element order, 16 elements at a time: store(indices,
// first element) for each of the 2 (4-bit) or 4 (2-bit) groups of 16 elements.
template <int PER, typename Store>
inline void code_indices16(__m128i b, Store&& store) {
  if constexpr (PER == 2) {  // byte k = elements 2k (low nibble), 2k+1
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    store(_mm_unpacklo_epi8(lo, hi), 0);
    store(_mm_unpackhi_epi8(lo, hi), 16);
  } else {  // byte k = elements 4k .. 4k+3, from the low bits up
    const __m128i m = _mm_set1_epi8(0x03);
    const __m128i c0 = _mm_and_si128(b, m), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
    const __m128i a01 = _mm_unpacklo_epi8(c0, c1), a23 = _mm_unpacklo_epi8(c2, c3);
    const __m128i b01 = _mm_unpackhi_epi8(c0, c1), b23 = _mm_unpackhi_epi8(c2, c3);
    store(_mm_unpacklo_epi16(a01, a23), 0);
    store(_mm_unpackhi_epi16(a01, a23), 16);
    store(_mm_unpacklo_epi16(b01, b23), 32);
    store(_mm_unpackhi_epi16(b01, b23), 48);
  }
}

// Whole blocks of 16 packed bytes through store(indices, out + first element); the tail byte by byte.
template <int FMT, typename Store>
inline void unpack_with(const uint8_t* bytes, int64_t nbytes, float* out, Store&& store) {
  constexpr int PER = ByteLut<FMT>::PER;
  int64_t i = 0;
  for (; i + 16 <= nbytes; i += 16) {
    float* o = out + i * PER;
    code_indices16<PER>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i)),
                        [&](__m128i idx, int64_t e) { store(idx, o + e); });
  }
  if (i < nbytes) unpack_bytes<FMT>(bytes + i, nbytes - i, out + i * PER);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// AVX-512: the codes of 16 bytes become byte indices in element order, widen to 32 bits and index a
// register-held table of the (at most 16) code values with one permute per 16 elements: ~4x fewer
// instructions than a copy per byte. Same values (the table is the scalar decoder's). Indexed by a lane's
// low 4 bits: 2-bit codes repeat every 4 entries, so whatever sits in bits 2-3 of an index (a neighbouring
// code, in code_attention.h's shifted bytes) does not matter.
inline void permute_store(__m128i idx, __m512 tab, float* out) {
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), tab));
}

template <int FMT>
inline void unpack(const uint8_t* bytes, int64_t nbytes, float* out) {
  static const CodeTable<FMT> table;
  const __m512 tab = _mm512_load_ps(table.v);
  unpack_with<FMT>(bytes, nbytes, out, [&](__m128i idx, float* o) { permute_store(idx, tab, o); });
}
#elif defined(__AVX2__)
// AVX2: every format's code values are small integers after a power-of-two scaling (E2M1 x 2: 0..12 with
// signs; INT4 0..15; ternary -1..1), so one byte shuffle maps 16 codes to int8 values, which widen to
// floats and are scaled back by 1 / CODE_MULT (exact: a power of two). The same values as the table.
template <int FMT>
constexpr float CODE_MULT = (FMT == NVFP4 || FMT == NVFP4O) ? 2.0f : 1.0f;

template <int FMT>
struct ByteCodes {
  alignas(16) int8_t v[16];
  ByteCodes() {
    const CodeTable<FMT> t;
    for (int i = 0; i < 16; ++i) v[i] = (int8_t)(t.v[i] * CODE_MULT<FMT>);
  }
};

template <int FMT>
inline void shuffle_store16(__m128i idx16, __m128i tab, float* out) {  // elements of idx16's 16 bytes
  const __m128i vals = _mm_shuffle_epi8(tab, idx16);
  for (int half = 0; half < 2; ++half) {
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half ? _mm_srli_si128(vals, 8) : vals));
    if constexpr (CODE_MULT<FMT> != 1.0f) x = _mm256_mul_ps(x, _mm256_set1_ps(1.0f / CODE_MULT<FMT>));
    _mm256_storeu_ps(out + 8 * half, x);
  }
}

template <int FMT>
inline void unpack(const uint8_t* bytes, int64_t nbytes, float* out) {
  static const ByteCodes<FMT> codes;
  const __m128i tab = _mm_load_si128(reinterpret_cast<const __m128i*>(codes.v));
  unpack_with<FMT>(bytes, nbytes, out, [&](__m128i idx, float* o) { shuffle_store16<FMT>(idx, tab, o); });
}
#else
template <int FMT>
inline void unpack(const uint8_t* bytes, int64_t nbytes, float* out) { unpack_bytes<FMT>(bytes, nbytes, out); }
#endif

// Dequantized V row (fp32 [D]) of a 4-/2-bit format at slot row `row` = (page * B + slot) * H + head: the
// element values, then each block of 16 channels scaled as the formats' torch decoders do.
template <int FMT>
inline void load_v_row(const Pools& p, int64_t row, float* v) {
  constexpr int BITS = (FMT == NVFP4 || FMT == NVFP4O || FMT == INT4) ? 4 : 2;
  const int64_t D = p.D, rb = D * BITS / 8, vrow = row * (D / 16);  // value params [page, slot, h, d/16]
  unpack<FMT>(p.f[1] + row * rb, rb, v);
  if constexpr (FMT == INT4 || FMT == INT2) {
    const uint16_t* vs = reinterpret_cast<const uint16_t*>(p.f[2]) + vrow;
    const uint16_t* vz = reinterpret_cast<const uint16_t*>(p.f[3]) + vrow;
    for (int64_t c = 0; c < D / 16; ++c) {
      const float s = half_to_float(vs[c]), z = half_to_float(vz[c]);
#pragma omp simd
      for (int64_t d = c * 16; d < c * 16 + 16; ++d) v[d] = v[d] * s + z;
    }
  } else {
    const float* t = e4m3_table().v;
    const uint8_t* vs = p.f[2] + vrow;
    const float sv = p.sv;
    for (int64_t c = 0; c < D / 16; ++c) {
      const float s = t[vs[c]];
#pragma omp simd
      for (int64_t d = c * 16; d < c * 16 + 16; ++d) v[d] = (v[d] * s) * sv;
    }
  }
}

// One task = (sequence, split of its block table), every KV head: a page's slots hold their H heads side by
// side ([B, H, ...]), so the task streams each page once, front to back, instead of H tasks each reading a
// third of every slot. Live tokens gather into tiles of TILE across pages (a page holds only 8 slots at
// SmolLM2's block size) and each tile makes one online-softmax update per query head. A tile keeps K
// transposed ([D][TILE]) so the G scores of TILE tokens are TILE-wide vector FMAs rather than one
// horizontal sum per (token, head), and V as rows for the weighted sum.
constexpr int64_t TILE = 16;

// acc[D] = alpha * acc[D] + sum_i p[i] * v[i][D]. With the head size known at compile time (DC) the
// accumulator lives in registers across the tile's tokens, in two chains (even and odd tokens) so that
// consecutive FMAs on one register do not wait on each other's latency.
template <int64_t DC>
inline void tile_pv(float* ag, float alpha, const float* sp, const float* vh, int64_t n, int64_t D) {
  if constexpr (DC > 0) {
    float a[DC], b[DC];
#pragma omp simd
    for (int64_t d = 0; d < DC; ++d) {
      a[d] = ag[d] * alpha;
      b[d] = 0.0f;
    }
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      const float p0 = sp[i], p1 = sp[i + 1];
      const float* v0 = vh + i * DC;
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) {
        a[d] += p0 * v0[d];
        b[d] += p1 * v0[DC + d];
      }
    }
    if (i < n) {
      const float p0 = sp[i];
      const float* v0 = vh + i * DC;
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) a[d] += p0 * v0[d];
    }
#pragma omp simd
    for (int64_t d = 0; d < DC; ++d) ag[d] = a[d] + b[d];
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
    for (int64_t i = 0; i < n; ++i) {
      const float pr = sp[i];
      const float* vr = vh + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += pr * vr[d];
    }
  }
}

inline void prefetch_lines(const void* at, int64_t bytes) {
  const char* c = static_cast<const char*>(at);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Pages of a sequence sit wherever the pool had room: with a batch decoding in lockstep, each request's
// flush groups interleave with the others', so its pages are 2-page runs scattered over the pool, too
// short for the hardware prefetcher (measured: 11% slower per call than contiguous pages, fp16 unchanged
// — its runs are 4x longer). So a task asks for the data of the page PREFETCH_PAGES entries ahead in its
// block table (K and V rows, V scales, key-group ids) and for the key parameters of the groups of the
// page one entry ahead, whose ids were fetched on the previous page: of its first slot where a page holds
// one group (the code-domain task), of every slot where groups change slot by slot (`every_group`: ThinKV's
// annealed pages, whose group rows sit anywhere in the group pool and stalled the float-tile task).
constexpr int64_t PREFETCH_PAGES = 2;

template <int FMT>
inline void prefetch_page(const Pools& p, const int32_t* table, int64_t pi, int64_t p_hi, bool every_group) {
  constexpr bool quantized = FMT != FP32 && FMT != FP16 && FMT != BF16 && FMT != FP8;
  constexpr bool integer = FMT == INT4 || FMT == INT2;
  constexpr int64_t BITS = FMT == FP32 ? 32 : (FMT == FP16 || FMT == BF16) ? 16 : FMT == FP8 ? 8
                         : (FMT == NVFP4 || FMT == NVFP4O || FMT == INT4) ? 4 : 2;
  const int64_t B = p.B, H = p.H, D = p.D, RB = D * BITS / 8, NB = D / 16, PB = integer ? 2 : 1;
  if (pi + PREFETCH_PAGES < p_hi && table[pi + PREFETCH_PAGES] >= 0) {
    const int64_t page = table[pi + PREFETCH_PAGES];
    prefetch_lines(p.f[0] + page * B * H * RB, B * H * RB);
    prefetch_lines(p.f[1] + page * B * H * RB, B * H * RB);
    if constexpr (quantized) {
      prefetch_lines(p.f[2] + page * B * H * NB * PB, B * H * NB * PB);
      if (integer) prefetch_lines(p.f[3] + page * B * H * NB * PB, B * H * NB * PB);
      __builtin_prefetch(p.k_group + page * B, 0, 3);
    }
  }
  if constexpr (quantized) {
    if (pi + 1 < p_hi && table[pi + 1] >= 0) {
      const int64_t GB = integer ? 2 : 1;  // bytes per key parameter
      int64_t last = -1;
      for (int64_t j = 0; j < (every_group ? B : 1); ++j) {
        const int64_t gid = std::max<int32_t>(p.k_group[table[pi + 1] * B + j], 0);
        if (gid == last) continue;
        last = gid;
        prefetch_lines(p.g[0] + gid * H * D * GB, H * D * GB);
        if (p.g[1]) prefetch_lines(p.g[1] + gid * H * D * 2, H * D * 2);
      }
    }
  }
}

// fn(pi, page, slot) for every live slot of block-table entries [p_lo, p_hi), in table order: -1 entries
// and pages whose validity word is 0 are skipped whole, dead slots by their bit.
template <typename Fn>
inline void for_each_live_slot(const int32_t* table, const int32_t* valid, int64_t p_lo, int64_t p_hi, int64_t B,
                               Fn&& fn) {
  for (int64_t pi = p_lo; pi < p_hi; ++pi) {
    const int64_t page = table[pi];
    if (page < 0) continue;
    const uint32_t word = (uint32_t)valid[page];
    if (word == 0) continue;
    for (int64_t j = 0; j < B; ++j)
      if ((word >> j) & 1u) fn(pi, page, j);
  }
}

// for_each_live_slot, prefetching each block-table entry's look-ahead (prefetch_page) when the walk reaches it.
template <int FMT, typename Fn>
inline void for_each_live_slot_prefetched(const Pools& p, const int32_t* table, const int32_t* valid, int64_t p_lo,
                                          int64_t p_hi, bool every_group, Fn&& fn) {
  int64_t fetched = -1;  // the last block-table entry whose look-ahead was prefetched
  for_each_live_slot(table, valid, p_lo, p_hi, p.B, [&](int64_t pi, int64_t page, int64_t j) {
    if (pi != fetched) {
      prefetch_page<FMT>(p, table, pi, p_hi, every_group);
      fetched = pi;
    }
    fn(pi, page, j);
  });
}

// A tile's n scaled scores sp[TILE] -> their softmax weights exp(s - m') in place (0 past n), folded into
// one query head's running maximum m and sum l; returns alpha = exp(m - m'), the factor the head's
// accumulator must be scaled by. The scores are written to lg (a logits row) at where[i] when asked for.
// Lanes past n hold stale values and are ignored.
inline float softmax_tile(float* sp, int64_t n, float& m, float& l, float* lg, const int64_t* where) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // NaN lanes left out of the maximum, as the scalar loop's std::max leaves them: their exp stays NaN and
  // poisons l and the output as the reference's softmax does (vmaxps would return a NaN or drop it by order)
  const __m512 s = _mm512_loadu_ps(sp);
  const __mmask16 live = _mm512_cmp_ps_mask(s, s, _CMP_ORD_Q) & (__mmask16)((1u << n) - 1u);
  const float mx = std::max(m, _mm512_mask_reduce_max_ps(live, s));
#else
  float mx = m;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sp[i]);
#endif
  if (lg)
    for (int64_t i = 0; i < n; ++i) lg[where[i]] = sp[i];
  // m = -inf on the first tile: alpha = 0; an unchanged maximum (most tiles of a long row) needs no exp
  const float alpha = mx == m ? 1.0f : exp_neg(m - mx);
#pragma omp simd
  for (int64_t i = 0; i < TILE; ++i) {
    const float e = exp_neg(sp[i] - mx);
    sp[i] = i < n ? e : 0.0f;  // lanes past n hold stale tiles' values
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const float lsum = _mm512_reduce_add_ps(_mm512_loadu_ps(sp));  // a tree, not a chain of 16 dependent adds
#else
  float lsum = 0.0f;
  for (int64_t i = 0; i < TILE; ++i) lsum += sp[i];
#endif
  l = l * alpha + lsum;
  m = mx;
  return alpha;
}

// softmax_tile, then the accumulator ag[D] updated with V rows vh [TILE][D] (the float-tile task's P.V).
template <int64_t DC>
inline void fold_tile(float* sp, int64_t n, float& m, float& l, float* ag, const float* vh, int64_t D, float* lg,
                      const int64_t* where) {
  const float alpha = softmax_tile(sp, n, m, l, lg, where);
  tile_pv<DC>(ag, alpha, sp, vh, n, D);
}

}  // namespace trtkv
