// CPU kv_write: quantize, pack and scatter n tokens into (pages[i], slots[i]) — bit-exact with
// plugins/kv_write/reference.py (the formats' torch encoders define the bits). Every step below is
// the reference's fp32 operation in the reference's order; there is no a*b+c that the compiler could
// contract into an FMA. Parallel over KV heads: a flush group's statistics are per (head, channel).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "codecs.h"

namespace trtkv {
namespace {

constexpr float FP16_MAX = 65504.0f;
constexpr int64_t SERIAL_ELEMENTS = 1 << 16;  // a flush group or a decode step's tokens: no thread wake-up
constexpr int64_t GROUPS_PARALLEL_ELEMENTS = 1 << 13;  // several groups' encoding outweighs a thread wake-up

// at::parallel_for grain for `tasks` tasks of `per_task` elements: serial (grain > range) when small.
inline int64_t grain_for(int64_t tasks, int64_t per_task) { return tasks * per_task < SERIAL_ELEMENTS ? tasks + 1 : 1; }

struct Io {
  const float* k;
  const float* v;
  const int64_t* pages;
  const int64_t* slots;
  int64_t n, H, D, B;
};

inline int64_t slot_row(const Io& io, int64_t i, int64_t h) { return (io.pages[i] * io.B + io.slots[i]) * io.H + h; }

template <int BITS>
inline void pack_row(const int* codes, int64_t D, uint8_t* dst) {
  constexpr int per = 8 / BITS;
  for (int64_t j = 0; j < D / per; ++j) {
    int byte = 0;
    for (int e = 0; e < per; ++e) byte |= codes[j * per + e] << (BITS * e);
    dst[j] = (uint8_t)byte;
  }
}

// A decode step's rows land in scattered pages, so each store misses the cache: a row of whole, aligned 64-byte
// lines is stored around the cache (non-temporal), which needs no read of the line first (a layer's call at 32
// layers x 256 requests on Zen 4: 60 -> 25 us).
constexpr int64_t STREAM_MAX_D = 512;  // fp16/bf16 rows are converted in a stack buffer of this many values

inline bool whole_lines(const at::Tensor& t, int64_t row_bytes) {
  return row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0;
}

inline void stream_bytes(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* x = static_cast<const char*>(src);
#if defined(__AVX512F__)
  for (int64_t o = 0; o < bytes; o += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + o), _mm512_loadu_si512(x + o));
#elif defined(__AVX__)
  for (int64_t o = 0; o < bytes; o += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + o), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o)));
#else
  std::memcpy(d, x, bytes);
#endif
}

void write_float(const Io& io, int fmt, const std::vector<at::Tensor>& sf) {
  const int64_t row_bytes = io.D * (fmt == FP32 ? 4 : 2);
  const bool stream = whole_lines(sf[0], row_bytes) && whole_lines(sf[1], row_bytes) && io.D <= STREAM_MAX_D;
  at::parallel_for(0, io.n * io.H, grain_for(io.n * io.H, io.D), [&](int64_t lo, int64_t hi) {
    alignas(64) uint16_t half[STREAM_MAX_D];
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t i = t / io.H, h = t % io.H, row = slot_row(io, i, h);
      for (int kv = 0; kv < 2; ++kv) {
        const float* x = (kv ? io.v : io.k) + t * io.D;
        char* dst = static_cast<char*>(sf[kv].data_ptr()) + row * row_bytes;
        if (fmt == FP32) {
          if (stream)
            stream_bytes(dst, x, row_bytes);
          else
            std::memcpy(dst, x, row_bytes);
          continue;
        }
        uint16_t* out = stream ? half : reinterpret_cast<uint16_t*>(dst);
        for (int64_t d = 0; d < io.D; ++d) out[d] = fmt == FP16 ? float_to_half_bits(x[d]) : float_to_bf16_bits(x[d]);
        if (stream) stream_bytes(dst, half, row_bytes);
      }
    }
    if (stream) _mm_sfence();  // (the streamed rows visible before the kernel returns)
  });
}

void write_fp8(const Io& io, const std::vector<at::Tensor>& sf, float sk, float sv) {
  at::parallel_for(0, io.n * io.H, grain_for(io.n * io.H, io.D), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t i = t / io.H, h = t % io.H, row = slot_row(io, i, h);
      for (int kv = 0; kv < 2; ++kv) {  // locals: a uint8_t store may alias io's fields, which stops vectorizing
        const int64_t D = io.D;
        const float* x = (kv ? io.v : io.k) + t * D;
        const float s = kv ? sv : sk;
        uint8_t* dst = sf[kv].data_ptr<uint8_t>() + row * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = e4m3_encode(x[d] / s, false);
      }
    }
  });
}

// E4M3 scale codes of ``a[d] / q`` rounded up (restrict: the byte stores cannot alias the inputs, so it vectorizes).
inline void encode_scales(const float* __restrict a, float q, uint8_t* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = e4m3_encode(a[d] / q, true);
}

// NVFP4 / ternary (+ key-offset twins): plugins/formats/blockscaled.py::BlockScaledFormat.encode.
template <bool FOUR, bool OFFSET>
void write_blockscaled(const Io& io, const std::vector<at::Tensor>& sf, const std::vector<at::Tensor>& gf, int64_t gid,
                       float gk, float gv) {
  constexpr int BITS = FOUR ? 4 : 2;
  const float qmax = FOUR ? 6.0f : 1.0f;
  const float* e4 = e4m3_table().v;
  const int64_t n = io.n, H = io.H, D = io.D, rb = D * BITS / 8, VG = D / 16;
  const float qk = qmax * gk, qv = qmax * gv;
  at::parallel_for(0, H, grain_for(H, n * D), [&](int64_t h_lo, int64_t h_hi) {
    std::vector<float> kr(n * D), amax(D), s_eff(D), mx(D), mn(D);
    std::vector<int> codes(D);
    for (int64_t h = h_lo; h < h_hi; ++h) {
      const int64_t grow = (gid * H + h) * D;
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(&kr[i * D], io.k + (i * H + h) * D, D * sizeof(float));
      // per-channel statistics token by token: the loops over channels are contiguous and vectorize
      if constexpr (OFFSET) {
        uint16_t* off = static_cast<uint16_t*>(gf[1].data_ptr()) + grow;
        std::memcpy(mx.data(), kr.data(), D * sizeof(float));
        std::memcpy(mn.data(), kr.data(), D * sizeof(float));
        for (int64_t i = 1; i < n; ++i)
          for (int64_t d = 0; d < D; ++d) { mx[d] = std::max(mx[d], kr[i * D + d]); mn[d] = std::min(mn[d], kr[i * D + d]); }
        for (int64_t d = 0; d < D; ++d) {
          const uint16_t hb = float_to_half_bits((mx[d] + mn[d]) / 2.0f);
          off[d] = hb;
          mx[d] = half_to_float(hb);  // now the offset
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < D; ++d) kr[i * D + d] = kr[i * D + d] - mx[d];
      }
      // keys: one E4M3 scale per channel over the group's tokens
      uint8_t* ksc = gf[0].data_ptr<uint8_t>() + grow;
      std::fill(amax.begin(), amax.end(), 0.0f);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) amax[d] = std::max(amax[d], std::fabs(kr[i * D + d]));
      encode_scales(amax.data(), qk, ksc, D);
      for (int64_t d = 0; d < D; ++d) s_eff[d] = e4[ksc[d]] * gk;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = slot_row(io, i, h);
        for (int64_t d = 0; d < D; ++d) {
          const float r = s_eff[d] > 0.0f ? kr[i * D + d] / s_eff[d] : 0.0f;
          codes[d] = FOUR ? e2m1_encode(r) : ternary_encode(r);
        }
        pack_row<BITS>(codes.data(), D, sf[0].data_ptr<uint8_t>() + row * rb);
        // values: one E4M3 scale per 16 channels of this token
        const float* x = io.v + (i * H + h) * D;
        uint8_t* vsc = sf[2].data_ptr<uint8_t>() + row * VG;
        for (int64_t c = 0; c < VG; ++c) {
          float a = 0.0f;
          for (int64_t d = c * 16; d < c * 16 + 16; ++d) a = std::max(a, std::fabs(x[d]));
          vsc[c] = e4m3_encode(a / qv, true);
          const float se = e4[vsc[c]] * gv;
          for (int64_t d = c * 16; d < c * 16 + 16; ++d) {
            const float r = se > 0.0f ? x[d] / se : 0.0f;
            codes[d] = FOUR ? e2m1_encode(r) : ternary_encode(r);
          }
        }
        pack_row<BITS>(codes.data(), D, sf[1].data_ptr<uint8_t>() + row * rb);
      }
    }
  });
}

// INT4 / INT2 KIVI: plugins/formats/intq.py::IntFormat.encode.
template <int BITS>
void write_int(const Io& io, const std::vector<at::Tensor>& sf, const std::vector<at::Tensor>& gf, int64_t gid) {
  const float levels = (float)((1 << BITS) - 1);
  const int64_t n = io.n, H = io.H, D = io.D, rb = D * BITS / 8, VG = D / 16;
  auto params = [&](float lo, float hi, uint16_t* scale, uint16_t* zero) {
    *scale = float_to_half_bits(std::min((hi - lo) / levels, FP16_MAX));
    *zero = float_to_half_bits(std::min(std::max(lo, -FP16_MAX), FP16_MAX));
  };
  auto code = [&](float x, float s, float z) -> int {
    float q = s > 0.0f ? std::nearbyint((x - z) / s) : 0.0f;
    q = std::min(std::max(q, 0.0f), levels);
    return (int)q;
  };
  at::parallel_for(0, H, grain_for(H, n * D), [&](int64_t h_lo, int64_t h_hi) {
    std::vector<int> codes(D);
    std::vector<float> ks(D), kz(D);
    for (int64_t h = h_lo; h < h_hi; ++h) {
      const int64_t grow = (gid * H + h) * D;
      uint16_t* gs = static_cast<uint16_t*>(gf[0].data_ptr()) + grow;
      uint16_t* gz = static_cast<uint16_t*>(gf[1].data_ptr()) + grow;
      for (int64_t d = 0; d < D; ++d) {
        float mx = io.k[h * D + d], mn = mx;
        for (int64_t i = 1; i < n; ++i) {
          const float x = io.k[(i * H + h) * D + d];
          mx = std::max(mx, x);
          mn = std::min(mn, x);
        }
        params(mn, mx, &gs[d], &gz[d]);
        ks[d] = half_to_float(gs[d]);
        kz[d] = half_to_float(gz[d]);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = slot_row(io, i, h);
        const float* x = io.k + (i * H + h) * D;
        for (int64_t d = 0; d < D; ++d) codes[d] = code(x[d], ks[d], kz[d]);
        pack_row<BITS>(codes.data(), D, sf[0].data_ptr<uint8_t>() + row * rb);
        const float* y = io.v + (i * H + h) * D;
        uint16_t* vs = static_cast<uint16_t*>(sf[2].data_ptr()) + row * VG;
        uint16_t* vz = static_cast<uint16_t*>(sf[3].data_ptr()) + row * VG;
        for (int64_t c = 0; c < VG; ++c) {
          float mx = y[c * 16], mn = mx;
          for (int64_t d = c * 16 + 1; d < c * 16 + 16; ++d) { mx = std::max(mx, y[d]); mn = std::min(mn, y[d]); }
          params(mn, mx, &vs[c], &vz[c]);
          const float s = half_to_float(vs[c]), z = half_to_float(vz[c]);
          for (int64_t d = c * 16; d < c * 16 + 16; ++d) codes[d] = code(y[d], s, z);
        }
        pack_row<BITS>(codes.data(), D, sf[1].data_ptr<uint8_t>() + row * rb);
      }
    }
  });
}

// One flush group (or a write-through batch) through its format's writer, then its slots' key-group index.
void write_group(const Io& io, int64_t fmt_code, const std::vector<at::Tensor>& slot_fields,
                 const std::vector<at::Tensor>& group_fields, int32_t* kg, int64_t gid, float sk, float sv) {
  if (io.n == 0) return;
  switch (fmt_code) {
    case FP32: case FP16: case BF16: write_float(io, (int)fmt_code, slot_fields); break;
    case FP8: write_fp8(io, slot_fields, sk, sv); break;
    case NVFP4: write_blockscaled<true, false>(io, slot_fields, group_fields, gid, sk, sv); break;
    case NVFP4O: write_blockscaled<true, true>(io, slot_fields, group_fields, gid, sk, sv); break;
    case TERNARY: write_blockscaled<false, false>(io, slot_fields, group_fields, gid, sk, sv); break;
    case TERNARYO: write_blockscaled<false, true>(io, slot_fields, group_fields, gid, sk, sv); break;
    case INT4: write_int<4>(io, slot_fields, group_fields, gid); break;
    case INT2: write_int<2>(io, slot_fields, group_fields, gid); break;
    default: TORCH_CHECK(false, "unknown KV format code ", fmt_code);
  }
  if (kg != nullptr)
    for (int64_t i = 0; i < io.n; ++i) kg[io.pages[i] * io.B + io.slots[i]] = (int32_t)gid;
}

// The checks both entry points share; returns k_group's data (nullptr: the format has no key-scale arena).
int32_t* check_fields(const std::vector<at::Tensor>& slot_fields, const std::vector<at::Tensor>& group_fields,
                      const at::Tensor& k_group) {
  for (const auto& t : slot_fields) TORCH_CHECK(t.is_contiguous(), "slot fields must be contiguous");
  for (const auto& t : group_fields) TORCH_CHECK(t.is_contiguous(), "group fields must be contiguous");
  if (group_fields.empty()) return nullptr;
  TORCH_CHECK(k_group.is_contiguous() && k_group.scalar_type() == at::kInt, "k_group must be contiguous int32");
  return k_group.data_ptr<int32_t>();
}

}  // namespace

void kv_write_cpu(const at::Tensor& k_in, const at::Tensor& v_in, const std::vector<at::Tensor>& slot_fields,
                  const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group, const at::Tensor& pages_in,
                  const at::Tensor& slots_in, int64_t gid, int64_t fmt_code, double scale_k, double scale_v) {
  TORCH_CHECK(k_in.dim() == 3 && v_in.sizes() == k_in.sizes(), "k, v must be [n, H, D] of equal shape");
  const auto k = k_in.to(at::kFloat).contiguous();
  const auto v = v_in.to(at::kFloat).contiguous();
  const auto pages = pages_in.reshape({-1}).to(at::kLong).contiguous();
  const auto slots = slots_in.reshape({-1}).to(at::kLong).contiguous();
  Io io{k.data_ptr<float>(), v.data_ptr<float>(), pages.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
        k.size(0), k.size(1), k.size(2), slot_fields.at(0).size(1)};
  TORCH_CHECK(pages.numel() == io.n && slots.numel() == io.n, "pages/slots must have one entry per token");
  int32_t* kg = check_fields(slot_fields, group_fields, k_group);
  write_group(io, fmt_code, slot_fields, group_fields, kg, gid, (float)scale_k, (float)scale_v);
}

void kv_write_groups_cpu(const at::Tensor& k_in, const at::Tensor& v_in, const std::vector<at::Tensor>& slot_fields,
                         const std::vector<at::Tensor>& group_fields, const at::Tensor& k_group,
                         const at::Tensor& pages_in, const at::Tensor& slots_in, const at::Tensor& gids_in,
                         int64_t fmt_code, double scale_k, double scale_v) {
  TORCH_CHECK(k_in.dim() == 4 && v_in.sizes() == k_in.sizes(), "k, v must be [G, n, H, D] of equal shape");
  const auto k = k_in.to(at::kFloat).contiguous();
  const auto v = v_in.to(at::kFloat).contiguous();
  const auto pages = pages_in.reshape({-1}).to(at::kLong).contiguous();
  const auto slots = slots_in.reshape({-1}).to(at::kLong).contiguous();
  const auto gids = gids_in.reshape({-1}).to(at::kLong).contiguous();
  const int64_t G = k.size(0), n = k.size(1), H = k.size(2), D = k.size(3);
  TORCH_CHECK(gids.numel() == G, "gids must have one entry per group");
  TORCH_CHECK(pages.numel() == G * n && slots.numel() == G * n, "pages/slots must be [G, n]: one entry per token");
  int32_t* kg = check_fields(slot_fields, group_fields, k_group);
  const int64_t B = slot_fields.at(0).size(1);
  // groups write distinct slots and arena entries: parallel over groups (each group's own loop then runs
  // inline), from a batch's worth of work — a decode step's 16 NVFP4 groups take ~0.4 ms on one thread
  const int64_t grain = G * n * H * D < GROUPS_PARALLEL_ELEMENTS ? G + 1 : 1;
  at::parallel_for(0, G, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      Io io{k.data_ptr<float>() + j * n * H * D, v.data_ptr<float>() + j * n * H * D,
            pages.data_ptr<int64_t>() + j * n, slots.data_ptr<int64_t>() + j * n, n, H, D, B};
      write_group(io, fmt_code, slot_fields, group_fields, kg, gids.data_ptr<int64_t>()[j], (float)scale_k,
                  (float)scale_v);
    }
  });
}

}  // namespace trtkv
