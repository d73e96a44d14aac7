// CPU append of a decode step's K/V rows to the residual arena (contract: plugins/residual_append/reference.py).
//
// Why a kernel: the torch path is two index_copy_ calls over converted copies of K and V; at decode batch 16
// the conversions, copies and dispatches took ~130 us a layer on the 2-core VM (~4 ms of a ThinKV step at
// SmolLM2's 30 layers). Here each token's [H, D] K and V rows are converted (fp16 through F16C, RNE as
// Tensor.to) straight into their arena rows, on the calling thread.
#include <torch/extension.h>

#include <cstring>

#include "codecs.h"

namespace trtkv {
namespace {

template <typename T>
inline void store_row(const float* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, float>) std::memcpy(dst, src, n * sizeof(float));
  else if constexpr (std::is_same_v<T, c10::Half>) float_row_to_half(src, n, reinterpret_cast<uint16_t*>(dst));
  else
    for (int64_t d = 0; d < n; ++d) dst[d] = T(src[d]);
}

}  // namespace

// arena_k/v [rows, L, g, H, D] (any float dtype, contiguous); at [b] int64: flat index of token i's [H, D] row
// in the arena viewed as [-1, H, D]; k, v [b, H, D] fp32 with contiguous heads (the batch stride is free: the
// step's K and V are column slices of the fused projection).
void residual_append_cpu(at::Tensor& arena_k, at::Tensor& arena_v, const at::Tensor& at_in, const at::Tensor& k,
                         const at::Tensor& v) {
  TORCH_CHECK(arena_k.is_contiguous() && arena_v.is_contiguous() && arena_k.sizes() == arena_v.sizes() &&
                  arena_k.scalar_type() == arena_v.scalar_type() && arena_k.dim() == 5,
              "residual_append: arena k/v must be contiguous [rows, L, g, H, D] of one dtype");
  const int64_t H = arena_k.size(3), D = arena_k.size(4), rows = arena_k.numel() / (H * D);
  const auto at = at_in.to(at::kLong).contiguous();
  const int64_t b = at.numel();
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == b && t->size(1) == H &&
                    t->size(2) == D && t->stride(2) == 1 && t->stride(1) == D,
                "residual_append: k, v must be fp32 [b, H, D] with contiguous heads");
  const int64_t* ap = at.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(ap[i] >= 0 && ap[i] < rows, "residual_append: arena row out of range");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0), n = H * D;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    T* ak = arena_k.data_ptr<T>();
    T* av = arena_v.data_ptr<T>();
    for (int64_t i = 0; i < b; ++i) {
      store_row(kp + i * ks, n, ak + ap[i] * n);
      store_row(vp + i * vs, n, av + ap[i] * n);
    }
  };
  switch (arena_k.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kHalf: go(c10::Half{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "residual_append: arena dtype must be fp32, fp16 or bf16");
  }
}

}  // namespace trtkv
