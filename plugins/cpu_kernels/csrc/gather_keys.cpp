// CPU read of paged keys, dequantized (contract: plugins/gather_keys/reference.py): each asked slot's key codes
// and its flush group's statistics decoded in one pass, in the formats' fp32 order, instead of a gather, a table
// lookup and a product per field over the whole selection (a ThinKV anneal reads every request's members at once).
// Products and sums stay separate roundings, as in the torch decoders: no a*b+c may become an FMA here.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>

#include "codecs.h"

namespace trtkv {

namespace {

constexpr int64_t SERIAL_ELEMENTS = 1 << 16;  // a selection this small decodes faster than threads wake up

struct Keys {
  const uint8_t* codes;      // slot field "k": [P * B, H, row_bytes]
  const int32_t* k_group;    // [P * B]
  int64_t slots, groups, H, D, row_bytes;
};

inline bool bad_slot(const Keys& k, int64_t s) { return s < 0 || s >= k.slots; }

// Packed element codes of one (slot, head) row: element e of a byte sits at bits [BITS*e, BITS*e + BITS).
template <int BITS, typename Decode>
inline void unpack_row(const uint8_t* src, int64_t D, Decode decode, float* dst) {
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  for (int64_t j = 0; j < D / per; ++j) {
    const int byte = src[j];
    for (int e = 0; e < per; ++e) dst[j * per + e] = decode((byte >> (BITS * e)) & mask);
  }
}

template <typename Row>
void each_row(const Keys& k, const int64_t* flat, int64_t m, float* out, std::atomic<bool>& bad, Row row) {
  const int64_t grain = m * k.H * k.D < SERIAL_ELEMENTS ? m + 1 : 1;
  at::parallel_for(0, m, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = flat[i];
      if (bad_slot(k, s)) { bad.store(true, std::memory_order_relaxed); continue; }
      for (int64_t h = 0; h < k.H; ++h) row(s, h, out + (i * k.H + h) * k.D);
    }
  });
}

// Group g's statistics row of head h, or null (and ``bad``) when g is not a group of the arena.
inline int64_t group_row(const Keys& k, int64_t s, int64_t h, std::atomic<bool>& bad) {
  const int64_t g = k.k_group[s];
  if (g < 0 || g >= k.groups) { bad.store(true, std::memory_order_relaxed); return -1; }
  return (g * k.H + h) * k.D;
}

}  // namespace

at::Tensor gather_keys_cpu(const std::vector<at::Tensor>& slot_fields, const std::vector<at::Tensor>& group_fields,
                           const at::Tensor& k_group, const at::Tensor& flat_in, int64_t fmt_code, double scale_k) {
  TORCH_CHECK(!slot_fields.empty() && slot_fields[0].dim() == 4 && slot_fields[0].is_contiguous(),
              "gather_keys: the key field must be a contiguous [P, B, H, X] tensor");
  for (const auto& t : group_fields) TORCH_CHECK(t.is_contiguous() && t.dim() == 3, "group fields must be [G, H, D]");
  const at::Tensor flat = flat_in.to(at::kLong).contiguous();
  const at::Tensor& kf = slot_fields[0];
  const int64_t P = kf.size(0), B = kf.size(1), H = kf.size(2), X = kf.size(3), m = flat.numel();
  const bool packed = fmt_code == NVFP4 || fmt_code == NVFP4O || fmt_code == INT4 || fmt_code == TERNARY ||
                      fmt_code == TERNARYO || fmt_code == INT2;
  const int bits = (fmt_code == TERNARY || fmt_code == TERNARYO || fmt_code == INT2) ? 2 : 4;
  const int64_t D = packed ? X * 8 / bits : X;
  at::Tensor out = at::empty({m, H, D}, kf.options().dtype(at::kFloat));
  Keys k{static_cast<const uint8_t*>(kf.data_ptr()), nullptr, P * B, 0, H, D, X * (int64_t)kf.element_size()};
  if (!group_fields.empty()) {
    TORCH_CHECK(k_group.is_contiguous() && k_group.scalar_type() == at::kInt && k_group.numel() == P * B,
                "k_group must be a contiguous int32 [P, B]");
    k.k_group = k_group.data_ptr<int32_t>();
    k.groups = group_fields[0].size(0);
  }
  const int64_t* fl = flat.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float sk = (float)scale_k;
  const float* e4 = e4m3_table().v;
  std::atomic<bool> bad{false};
  auto at_row = [&](int64_t s, int64_t h) { return k.codes + (s * H + h) * k.row_bytes; };
  switch (fmt_code) {
    case FP32:
      each_row(k, fl, m, o, bad, [&](int64_t s, int64_t h, float* dst) {
        std::memcpy(dst, at_row(s, h), D * sizeof(float));
      });
      break;
    case FP16: case BF16:
      each_row(k, fl, m, o, bad, [&](int64_t s, int64_t h, float* dst) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(at_row(s, h));
        for (int64_t d = 0; d < D; ++d) dst[d] = fmt_code == FP16 ? half_to_float(src[d]) : bf16_to_float(src[d]);
      });
      break;
    case FP8:
      each_row(k, fl, m, o, bad, [&](int64_t s, int64_t h, float* dst) {
        const uint8_t* src = at_row(s, h);
        for (int64_t d = 0; d < D; ++d) dst[d] = e4[src[d]] * sk;
      });
      break;
    case NVFP4: case NVFP4O: case TERNARY: case TERNARYO: {
      TORCH_CHECK(!group_fields.empty(), "gather_keys: a block-scaled format needs its key scales");
      const bool four = fmt_code == NVFP4 || fmt_code == NVFP4O;
      const bool offset = fmt_code == NVFP4O || fmt_code == TERNARYO;
      TORCH_CHECK(!offset || group_fields.size() > 1, "gather_keys: a key-offset format needs its offsets");
      const uint8_t* scale = group_fields[0].data_ptr<uint8_t>();
      const uint16_t* off = offset ? static_cast<const uint16_t*>(group_fields[1].data_ptr()) : nullptr;
      each_row(k, fl, m, o, bad, [&](int64_t s, int64_t h, float* dst) {
        const int64_t g = group_row(k, s, h, bad);
        if (g < 0) return;
        if (four) unpack_row<4>(at_row(s, h), D, e2m1_decode, dst);
        else unpack_row<2>(at_row(s, h), D, ternary_decode, dst);
        for (int64_t d = 0; d < D; ++d) {
          const float x = dst[d] * e4[scale[g + d]];
          dst[d] = x * sk;
        }
        if (off)
          for (int64_t d = 0; d < D; ++d) dst[d] = dst[d] + half_to_float(off[g + d]);
      });
      break;
    }
    case INT4: case INT2: {
      TORCH_CHECK(group_fields.size() > 1, "gather_keys: an integer format needs its key scales and zeros");
      const uint16_t* scale = static_cast<const uint16_t*>(group_fields[0].data_ptr());
      const uint16_t* zero = static_cast<const uint16_t*>(group_fields[1].data_ptr());
      const auto ident = [](int c) { return (float)c; };
      each_row(k, fl, m, o, bad, [&](int64_t s, int64_t h, float* dst) {
        const int64_t g = group_row(k, s, h, bad);
        if (g < 0) return;
        if (fmt_code == INT4) unpack_row<4>(at_row(s, h), D, ident, dst);
        else unpack_row<2>(at_row(s, h), D, ident, dst);
        for (int64_t d = 0; d < D; ++d) {
          const float x = dst[d] * half_to_float(scale[g + d]);
          dst[d] = x + half_to_float(zero[g + d]);
        }
      });
      break;
    }
    default: TORCH_CHECK(false, "gather_keys: unknown KV format code ", fmt_code);
  }
  TORCH_CHECK(!bad.load(), "gather_keys: a slot id outside the pool, or a slot whose key-scale group is not in the arena");
  return out;
}

}  // namespace trtkv
