// CPU paged decode attention over one format's packed pages (contract: plugins/paged_attention/reference.py).
//
// One task = (sequence, split of the block table). A task walks its pages, skips a page whose validity
// word is 0, dequantizes only the live slots into fp32 tiles (never a copy of the cache), scores each tile
// against the G query heads sharing each KV head, and folds it into an online softmax. Splits of one
// sequence are merged at the end by log-sum-exp. All pool offsets are int64 (a pool may exceed 2^31 bytes).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdlib>

#include "code_attention.h"
#include "paged_common.h"

namespace trtkv {
namespace {

// Dequantized K and V rows (fp32, [D]) of slot `slot` of page `page`, KV head `h`; same fp32 operations in
// the same order as the formats' torch decoders.
template <int FMT>
inline void load_kv(const Pools& p, int64_t page, int64_t slot, int64_t h, float* k, float* v, GroupRows& gr) {
  const int64_t D = p.D;
  const int64_t row = (page * p.B + slot) * p.H + h;  // slot-field row of [pages, B, H, ...]
  if constexpr (FMT == FP32) {
    std::memcpy(k, reinterpret_cast<const float*>(p.f[0]) + row * D, D * sizeof(float));
    std::memcpy(v, reinterpret_cast<const float*>(p.f[1]) + row * D, D * sizeof(float));
  } else if constexpr (FMT == FP16 || FMT == BF16) {
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(p.f[0]) + row * D;
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(p.f[1]) + row * D;
    if constexpr (FMT == FP16) {  // F16C where the CPU has it (codecs.h)
      half_row_to_float(kp, D, k);
      half_row_to_float(vp, D, v);
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        k[d] = bf16_to_float(kp[d]);
        v[d] = bf16_to_float(vp[d]);
      }
    }
  } else if constexpr (FMT == FP8) {
    const float* t = e4m3_table().v;
    const uint8_t* kp = p.f[0] + row * D;
    const uint8_t* vp = p.f[1] + row * D;
    for (int64_t d = 0; d < D; ++d) {
      k[d] = t[kp[d]] * p.sk;
      v[d] = t[vp[d]] * p.sv;
    }
  } else {
    constexpr bool four = FMT == NVFP4 || FMT == NVFP4O || FMT == INT4;
    constexpr int BITS = four ? 4 : 2;
    const int64_t rb = D * BITS / 8;  // packed bytes per (slot, head)
    const int64_t off = load_group<FMT>(p, std::max<int32_t>(p.k_group[page * p.B + slot], 0), h, gr);
    const float* ga = gr.a.data() + off;
    const float* gb = gr.b.data() + off;
    unpack<FMT>(p.f[0] + row * rb, rb, k);  // element values (codes as floats for INT), then scaled in place
    if constexpr (FMT == INT4 || FMT == INT2) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) k[d] = k[d] * ga[d] + gb[d];
    } else {
      const float sk = p.sk;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        k[d] = (k[d] * ga[d]) * sk;
        if constexpr (FMT == NVFP4O || FMT == TERNARYO) k[d] += gb[d];
      }
    }
    load_v_row<FMT>(p, row, v);
  }
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 rows of 16 floats (row stride rs) -> 16 columns (column c at dst + c * TILE): the K tile's transpose in
// 64 register shuffles per 16x16 block instead of a scalar store per element (the stores were the largest
// part of a quantized page's cost). Values are moved, never changed: scores stay bit-identical.
inline void transpose16(const float* src, int64_t rs, float* dst) {  // dst: column c at dst + c * TILE
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * rs);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * TILE, r[i]);  // register i holds column i
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
// AVX2: 8 rows of 8 floats (row stride rs) -> 8 columns (column c at dst + c * TILE), in 24 shuffles.
inline void transpose8(const float* src, int64_t rs, float* dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * rs);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * TILE, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * TILE, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// K rows [H][TILE][D] of a tile's n tokens -> [H][D][TILE] for the scores. Rows n.. hold earlier tiles'
// values (or zeros); transposing them too only fills lanes the update ignores.
inline void transpose_tile(const float* rows, float* cols, int64_t H, int64_t D, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (TILE == 16 && D % 16 == 0) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < D; c += 16) transpose16(rows + h * TILE * D + c, D, cols + (h * D + c) * TILE);
    return;
  }
#elif defined(__AVX2__)
  if (TILE % 8 == 0 && D % 8 == 0) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < TILE; r += 8)
        for (int64_t c = 0; c < D; c += 8) transpose8(rows + (h * TILE + r) * D + c, D, cols + (h * D + c) * TILE + r);
    return;
  }
#endif
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) cols[(h * D + d) * TILE + i] = rows[(h * TILE + i) * D + d];
}

// Scores of the tile's TILE tokens for one query row: four independent FMA chains over d (one chain would
// wait on each FMA's latency), each TILE lanes wide.
inline void tile_scores(const float* qg, const float* kh /*[D][TILE]*/, int64_t D, float* sp) {
  float s0[TILE] = {}, s1[TILE] = {}, s2[TILE] = {}, s3[TILE] = {};
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) {
    const float q0 = qg[d], q1 = qg[d + 1], q2 = qg[d + 2], q3 = qg[d + 3];
    const float* k = kh + d * TILE;
#pragma omp simd
    for (int64_t i = 0; i < TILE; ++i) {
      s0[i] += q0 * k[i];
      s1[i] += q1 * k[TILE + i];
      s2[i] += q2 * k[2 * TILE + i];
      s3[i] += q3 * k[3 * TILE + i];
    }
  }
  for (; d < D; ++d)
#pragma omp simd
    for (int64_t i = 0; i < TILE; ++i) s0[i] += qg[d] * kh[d * TILE + i];
#pragma omp simd
  for (int64_t i = 0; i < TILE; ++i) sp[i] = (s0[i] + s1[i]) + (s2[i] + s3[i]);
}

template <int FMT, int64_t DC>
void attend_task(const Pools& p, const float* q /*[H*G, D]*/, const int32_t* table, const int32_t* valid,
                 int64_t p_lo, int64_t p_hi, int64_t G, float sm_scale, float* logits /*[H*G, P*B] or null*/,
                 int64_t logit_stride, float* m /*[H*G]*/, float* l /*[H*G]*/, float* acc /*[H*G, D]*/) {
  const int64_t D = DC > 0 ? DC : p.D, B = p.B, H = p.H;
  std::vector<float> kT(H * D * TILE), vt(H * TILE * D), kt(H * TILE * D);  // kt: the tile's K rows
  std::vector<GroupRows> gr(H, GroupRows(D));
  int64_t where[TILE];  // logit column (page index * B + slot) of each tile token
  alignas(64) float sp[TILE];
  int64_t n = 0;
  std::fill(m, m + H * G, NEG_INF);
  std::fill(l, l + H * G, 0.0f);
  std::fill(acc, acc + H * G * D, 0.0f);
  auto update = [&]() {  // fold the tile's n tokens into every query head's state
    transpose_tile(kt.data(), kT.data(), H, D, n);
    for (int64_t h = 0; h < H; ++h) {
      const float* kh = &kT[h * D * TILE];
      const float* vh = &vt[h * TILE * D];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        tile_scores(q + hg * D, kh, D, sp);
        for (int64_t i = 0; i < n; ++i) sp[i] *= sm_scale;
        fold_tile<DC>(sp, n, m[hg], l[hg], acc + hg * D, vh, D, logits ? logits + hg * logit_stride : nullptr, where);
      }
    }
    n = 0;
  };
  for_each_live_slot_prefetched<FMT>(p, table, valid, p_lo, p_hi, true, [&](int64_t pi, int64_t page, int64_t j) {
    for (int64_t h = 0; h < H; ++h) load_kv<FMT>(p, page, j, h, &kt[(h * TILE + n) * D], &vt[(h * TILE + n) * D], gr[h]);
    where[n++] = pi * B + j;
    if (n == TILE) update();
  });
  if (n) update();
}

// TRTKV_PLAIN_TILES=1 keeps every format on the float-tile task (to measure the code-domain task against it).
inline bool plain_tiles() {
  static const bool plain = [] {
    const char* e = std::getenv("TRTKV_PLAIN_TILES");
    return e && e[0] == '1';
  }();
  return plain;
}

template <int FMT, int64_t DC>
void run(const Pools& p, const float* q, const int32_t* table, const int32_t* valid, int64_t b, int64_t P, int64_t G,
         int64_t S, float sm_scale, float* out, float* lse, float* logits) {
  const int64_t H = p.H, D = p.D, B = p.B, Hq = H * G;
  const int64_t per_split = (P + S - 1) / S;
  // partial states [b, S, Hq] and [b, S, Hq, D]
  std::vector<float> pm(b * S * Hq), pl(b * S * Hq), pacc(b * S * Hq * D);
  // Small calls run on the calling thread: waking the pool costs more than a few thousand slots of work.
  const int64_t grain = b * H * P * B < SERIAL_SLOT_HEADS ? b * S + 1 : 1;  // > range: serial
  at::parallel_for(0, b * S, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bi = t / S, sp = t % S;
      const int64_t lo = sp * per_split, hi = std::min(P, lo + per_split);
      float* lg = logits ? logits + bi * Hq * (P * B) : nullptr;
#ifdef TRTKV_CODE_ATTENTION
      if constexpr (DC > 0 && code_format<FMT>) {
        if (!plain_tiles() && long_group_runs(p, table + bi * P, valid, lo, hi)) {
          attend_task_codes<FMT, DC>(p, q + bi * Hq * D, table + bi * P, valid, lo, hi, G, sm_scale, lg, P * B,
                                     &pm[t * Hq], &pl[t * Hq], &pacc[t * Hq * D]);
          continue;
        }
      }
#endif
      attend_task<FMT, DC>(p, q + bi * Hq * D, table + bi * P, valid, lo, hi, G, sm_scale, lg, P * B, &pm[t * Hq],
                       &pl[t * Hq], &pacc[t * Hq * D]);
    }
  });
  at::parallel_for(0, b * Hq, grain == 1 ? 1 : b * Hq + 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // r = bi * Hq + hg: row of out [b, Hq, D]
      const int64_t bi = r / Hq, hg = r % Hq;
      float M = NEG_INF;
      bool nan_scores = false;  // a split whose scores were all NaN ends with m = -inf and l = NaN
      for (int64_t sp = 0; sp < S; ++sp) {
        M = std::max(M, pm[(bi * S + sp) * Hq + hg]);
        nan_scores |= std::isnan(pl[(bi * S + sp) * Hq + hg]);
      }
      float* o = out + r * D;
      if (nan_scores) {  // the reference's softmax over a row with a NaN score: NaN everywhere
        std::fill(o, o + D, NAN);
        lse[r] = NAN;
        continue;
      }
      std::fill(o, o + D, 0.0f);
      if (M == NEG_INF) { lse[r] = NEG_INF; continue; }
      float L = 0.0f;
      for (int64_t sp = 0; sp < S; ++sp) {
        const int64_t t = (bi * S + sp) * Hq + hg;
        if (pm[t] == NEG_INF) continue;
        const float w = std::exp(pm[t] - M);
        L += pl[t] * w;
        const float* a = &pacc[t * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.0f / L;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      lse[r] = M + std::log(L);
    }
  });
}

}  // namespace

static constexpr int64_t MIN_PAGES_PER_SPLIT = 8;  // below this a split's fixed cost (partial state, merge) outweighs it

// Splits of each sequence's block table (num_splits <= 0): only when the sequences alone cannot fill the threads
static int64_t auto_splits(int64_t b, int64_t P) {
  const int64_t threads = at::get_num_threads();
  if (b >= 2 * threads || P < 2 * MIN_PAGES_PER_SPLIT) return 1;
  const int64_t per_seq = (2 * threads + std::max<int64_t>(b, 1) - 1) / std::max<int64_t>(b, 1);
  return std::max<int64_t>(1, std::min(per_seq, P / MIN_PAGES_PER_SPLIT));
}

std::vector<at::Tensor> paged_attention_cpu(const at::Tensor& q_in, const std::vector<at::Tensor>& slot_fields,
                                            const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group,
                                            const at::Tensor& valid_bits, const at::Tensor& block_table_in,
                                            int64_t fmt_code, double sm_scale, double scale_k, double scale_v,
                                            bool return_logits, int64_t num_splits) {
  TORCH_CHECK(q_in.dim() == 3, "q must be [b, Hq, D]");
  TORCH_CHECK(valid_bits.scalar_type() == at::kInt && block_table_in.scalar_type() == at::kInt,
              "valid_bits and block_table must be int32");
  const auto q = q_in.to(at::kFloat).contiguous();
  const auto table = block_table_in.contiguous();
  const int64_t b = q.size(0), Hq = q.size(1), D = q.size(2);
  const auto& f0 = slot_fields.at(0);
  Pools p;
  p.B = f0.size(1);
  p.H = f0.size(2);
  p.D = D;
  p.sk = (float)scale_k;
  p.sv = (float)scale_v;
  TORCH_CHECK(p.B <= 32, "block_size must be <= 32 (one int32 validity word per page)");
  TORCH_CHECK(Hq % p.H == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(fmt_code <= 2 || D % 16 == 0, "quantized formats need head_dim % 16 == 0");
  for (size_t i = 0; i < slot_fields.size() && i < 4; ++i) {
    TORCH_CHECK(slot_fields[i].is_contiguous(), "slot fields must be contiguous");
    p.f[i] = static_cast<const uint8_t*>(slot_fields[i].data_ptr());
  }
  for (size_t i = 0; i < group_fields.size() && i < 2; ++i) {
    TORCH_CHECK(group_fields[i].is_contiguous(), "group fields must be contiguous");
    p.g[i] = static_cast<const uint8_t*>(group_fields[i].data_ptr());
  }
  TORCH_CHECK(k_group.is_contiguous() && valid_bits.is_contiguous(), "k_group and valid_bits must be contiguous");
  p.k_group = k_group.numel() ? k_group.data_ptr<int32_t>() : nullptr;
  const int64_t G = Hq / p.H, P = table.size(1);
  const auto fopt = q.options().dtype(at::kFloat);
  auto out = at::empty({b, Hq, D}, fopt);
  auto lse = at::empty({b, Hq}, fopt);
  auto logits = return_logits ? at::full({b, Hq, P * p.B}, NEG_INF, fopt) : at::empty({0}, fopt);
  int64_t S = std::max<int64_t>(1, std::min<int64_t>(num_splits > 0 ? num_splits : auto_splits(b, P), std::max<int64_t>(P, 1)));
  const float* qp = q.data_ptr<float>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* vp = valid_bits.data_ptr<int32_t>();
  float* lg = return_logits ? logits.data_ptr<float>() : nullptr;
  const float sm = (float)sm_scale;
#define TRTKV_CASE(F)                                                                          \
  case F:                                                                                      \
    if (D == 64) run<F, 64>(p, qp, tp, vp, b, P, G, S, sm, out.data_ptr<float>(), lse.data_ptr<float>(), lg);   \
    else if (D == 128) run<F, 128>(p, qp, tp, vp, b, P, G, S, sm, out.data_ptr<float>(), lse.data_ptr<float>(), lg); \
    else run<F, 0>(p, qp, tp, vp, b, P, G, S, sm, out.data_ptr<float>(), lse.data_ptr<float>(), lg);          \
    break;
  switch (fmt_code) {
    TRTKV_CASE(FP32) TRTKV_CASE(FP16) TRTKV_CASE(BF16) TRTKV_CASE(FP8) TRTKV_CASE(NVFP4) TRTKV_CASE(TERNARY)
    TRTKV_CASE(INT4) TRTKV_CASE(INT2) TRTKV_CASE(NVFP4O) TRTKV_CASE(TERNARYO)
    default: TORCH_CHECK(false, "unknown KV format code ", fmt_code);
  }
#undef TRTKV_CASE
  return {out, lse, logits};
}

}  // namespace trtkv
