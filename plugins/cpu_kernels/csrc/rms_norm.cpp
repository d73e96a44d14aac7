// RMS normalization of fp32 rows on CPU (contract: plugins/rms_norm/reference.py), bit-identical.
//
// Why here and not in torch: torch's CPU rms_norm is composite (pow, mean as sum and div, add, rsqrt, two muls,
// dtype checks: ~10 dispatched ops, 13-45 us a call at decode), twice a layer, so 2-5 ms of every SmolLM2 decode
// step at batch 1 on the 2-core VM. The sum of squares stays torch's (its vectorized reduction order is per
// CPU; any other order changes 2-bit caches' greedy tokens within ~10 tokens); the rest is one pass over a
// row with the reference's roundings. Long prefills fan out over rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

namespace trtkv {

// x [T, C] (rows of any stride, channels contiguous), weight [C] -> contiguous (x * rsqrt(mean(x^2) + eps)) * w:
// mean = sum / C, rsqrt = 1 / sqrt (both correctly rounded, as torch's vectorized rsqrt), then the two products
// in the reference's order
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "rms_norm: x [T, C] fp32 with contiguous channels");
  const int64_t T = x.size(0), C = x.size(1), rs = x.stride(0);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == C,
              "rms_norm: weight [C] fp32 contiguous");
  const auto ssq = at::pow(x, 2).sum(-1);  // [T], in torch's order
  auto y = at::empty({T, C}, x.options());
  const float* sp = ssq.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  auto rows = [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* xr = xp + t * rs;
      float* yr = yp + t * C;
      const float r = 1.0f / std::sqrt(sp[t] / static_cast<float>(C) + e);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] * r) * wp[c];
    }
  };
  constexpr int64_t SERIAL_ELEMENTS = 1 << 16;  // below this one thread beats waking the pool
  if (T * C < SERIAL_ELEMENTS)
    rows(0, T);
  else
    at::parallel_for(0, T, std::max<int64_t>(1, SERIAL_ELEMENTS / 4 / std::max<int64_t>(C, 1)), rows);
  return y;
}

}  // namespace trtkv
