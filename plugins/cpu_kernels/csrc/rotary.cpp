// Rotary position embedding of the decoder's query and key heads on CPU, fp32 (contract:
// plugins/rotary/reference.py).
//
// Why here and not in torch: torch runs the reference as six dispatched ops (chunk, neg, cat, two muls, an
// add), ~50-80 us a layer at decode batch 1-16 on the 2-core VM, i.e. 1.5-2.5 ms of every decode step over
// SmolLM2's 30 layers; one pass over the rows on the calling thread takes ~10 us. Long prefills fan out over
// rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

namespace trtkv {
namespace {

constexpr int64_t SERIAL_ELEMENTS = 1 << 16;  // below this one thread beats waking the pool

template <typename Fn>
inline void for_rows(int64_t rows, int64_t row_elems, Fn&& fn) {
  if (rows * row_elems < SERIAL_ELEMENTS) {
    fn(0, rows);
    return;
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, SERIAL_ELEMENTS / 4 / std::max<int64_t>(row_elems, 1)), fn);
}

}  // namespace

// x [T, heads, D] (rows of any stride, heads and channels contiguous), cos/sin [T, D] -> contiguous
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]); the reference's three roundings
// (contraction into a fused multiply-add is off for this function), so the result is bit-identical.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.size(2) % 2 == 0,
              "rotary: x [T, heads, D] fp32 with contiguous heads and an even D");
  const int64_t T = x.size(0), Hn = x.size(1), D = x.size(2), half = D / 2, rs = x.stride(0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rotary: cos/sin [T, D] fp32 contiguous");
  auto y = at::empty({T, Hn, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_rows(T, Hn * D, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < Hn; ++h) {
        const float* xr = xp + t * rs + h * D;
        float* yr = yp + (t * Hn + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = xr[d] * c[d];
          const float b = -xr[d + half] * s[d];
          yr[d] = a + b;
        }
#pragma omp simd
        for (int64_t d = half; d < D; ++d) {
          const float a = xr[d] * c[d];
          const float b = xr[d - half] * s[d];
          yr[d] = a + b;
        }
      }
    }
  });
  return y;
}
#pragma GCC pop_options

}  // namespace trtkv
