// CPU attention over the residual buffers, merged into the pages' partial in place (contract:
// plugins/buffer_attention/reference.py). The torch path gathers the batch's arena rows, runs two einsums,
// a log-sum-exp and a merge — a dozen small ops per layer whose fixed costs dominate at batch 1; here
// each (sequence, KV head) converts its arena rows once, and each of its query heads scores its < g live
// tokens and merges the result with the pages' (out, lse) by log-sum-exp.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "codecs.h"

namespace trtkv {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, c10::Half>) return half_to_float(x.x);
  else return bf16_to_float(x.x);
}

// One buffered K or V row (n values) to fp32; fp16 rows through the shared F16C conversion, once per KV head
// (per query head, the portable conversion took ~400 us a layer at batch 16 x 8 buffered tokens, one thread).
template <typename T>
inline void row_to_float(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    half_row_to_float(reinterpret_cast<const uint16_t*>(src), n, dst);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
  }
}

// One task = (sequence, KV head): its buffered K and V rows are converted once for the G query heads that
// share them, then each query head scores the < g live tokens and merges with the pages' (out, lse).
template <typename T>
void run(const float* q, const T* ak, const T* av, const int64_t* rows, const int64_t* counts, int64_t layer,
         int64_t L, int64_t g, int64_t H, int64_t D, int64_t b, int64_t G, float sm_scale, float* out, float* lse) {
  const int64_t Hq = H * G;
  at::parallel_for(0, b * H, b * Hq * g * D < (1 << 16) ? b * H + 1 : 1, [&](int64_t lo, int64_t hi) {
    float s[64];
    float o2[512];
    std::vector<float> kv(2 * g * D);
    for (int64_t t = lo; t < hi; ++t) {  // t = bi * H + h
      const int64_t bi = t / H, h = t % H;
      const int64_t n = std::min(counts[bi], g);
      if (n <= 0) continue;
      const int64_t base = ((rows[bi] * L + layer) * g) * H * D;  // arena [rows, L, g, H, D]
      float* kf = kv.data();
      float* vf = kf + g * D;
      for (int64_t i = 0; i < n; ++i) {
        row_to_float(ak + base + (i * H + h) * D, D, kf + i * D);
        row_to_float(av + base + (i * H + h) * D, D, vf + i * D);
      }
      for (int64_t r = bi * Hq + h * G; r < bi * Hq + (h + 1) * G; ++r) {  // the G query heads of KV head h
        const float* qr = q + r * D;
        float m2 = NEG_INF;
        for (int64_t i = 0; i < n; ++i) {
          const float* k = kf + i * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * k[d];
          s[i] = dot * sm_scale;
          m2 = std::max(m2, s[i]);
        }
        float l2 = 0.0f;
        std::fill(o2, o2 + D, 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const float p = exp_neg(s[i] - m2);
          l2 += p;
          const float* v = vf + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o2[d] += p * v[d];
        }
        const float lse2 = m2 + std::log(l2);
        const float lse1 = lse[r];
        const float M = std::max(lse1, lse2);
        const float w1 = lse1 == NEG_INF ? 0.0f : std::exp(lse1 - M), w2 = std::exp(lse2 - M);
        const float total = M + std::log(w1 + w2);
        const float a1 = w1 / (w1 + w2), a2 = w2 / ((w1 + w2) * l2);  // o2 is unnormalized: divide by l2
        float* o = out + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = a1 * o[d] + a2 * o2[d];
        lse[r] = total;
      }
    }
  });
}

}  // namespace

void buffer_attention_merge_cpu(const at::Tensor& q_in, const at::Tensor& arena_k, const at::Tensor& arena_v,
                                const at::Tensor& rows_in, int64_t layer, const at::Tensor& counts_in, double sm_scale,
                                at::Tensor& out, at::Tensor& lse) {
  TORCH_CHECK(arena_k.dim() == 5 && arena_k.is_contiguous() && arena_v.is_contiguous() &&
                  arena_k.sizes() == arena_v.sizes() && arena_k.scalar_type() == arena_v.scalar_type(),
              "arena k/v must be contiguous [rows, L, g, H, D] of one dtype");
  TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat && out.is_contiguous() &&
                  lse.is_contiguous(), "out and lse must be contiguous fp32");
  const auto q = q_in.to(at::kFloat).contiguous();
  const auto rows = rows_in.to(at::kLong).contiguous();
  const auto counts = counts_in.to(at::kLong).contiguous();
  const int64_t L = arena_k.size(1), g = arena_k.size(2), H = arena_k.size(3), D = arena_k.size(4);
  const int64_t b = q.size(0), Hq = q.size(1);
  TORCH_CHECK(q.size(2) == D && Hq % H == 0 && g <= 64 && D <= 512, "buffer attention: unsupported shapes");
  TORCH_CHECK(layer >= 0 && layer < L, "layer out of range");
  TORCH_CHECK(rows.numel() == b && counts.numel() == b, "rows and counts need one entry per sequence");
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(rows.data_ptr<int64_t>()[i] >= 0 && rows.data_ptr<int64_t>()[i] < arena_k.size(0), "arena row out of range");
  const float sm = (float)sm_scale;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    run<T>(q.data_ptr<float>(), arena_k.data_ptr<T>(), arena_v.data_ptr<T>(), rows.data_ptr<int64_t>(),
           counts.data_ptr<int64_t>(), layer, L, g, H, D, b, Hq / H, sm, out.data_ptr<float>(), lse.data_ptr<float>());
  };
  switch (arena_k.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kHalf: go(c10::Half{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "arena dtype must be fp32, fp16 or bf16");
  }
}

}  // namespace trtkv
