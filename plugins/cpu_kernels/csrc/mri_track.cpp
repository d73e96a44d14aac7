// CPU tracking update of LazyEviction for a batch in one layer or several (contract: plugins/mri_track/reference.py).
//
// The reference masks, gathers, updates and scatters [b, n] entries in a dozen tensor passes; here each request's
// row is one pass over its columns. Rows are distinct and positions distinct within a row, so rows run in parallel
// without conflicts, and each entry gets the reference's int32 arithmetic.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace trtkv {

void mri_track_cpu(at::Tensor& ts, at::Tensor& mri, int64_t layer, const at::Tensor& rows_in,
                   const at::Tensor& positions_in, const std::vector<at::Tensor>& values, double divisor, double alpha,
                   const at::Tensor& prompt_in,
                   const at::Tensor& step_in) {
  TORCH_CHECK(ts.dim() == 3 && ts.scalar_type() == at::kInt && ts.is_contiguous() && mri.sizes() == ts.sizes() &&
                  mri.scalar_type() == at::kInt && mri.is_contiguous(),
              "mri_track: ts and mri must be contiguous int32 [layers, rows, cap] of one shape");
  // positions [b, n] update `layer`; [L, b, n] update layers layer..layer+L-1 (a step's layers in one call)
  TORCH_CHECK(positions_in.dim() == 2 || positions_in.dim() == 3, "mri_track: positions must be [b, n] or [L, b, n]");
  const bool stacked = positions_in.dim() == 3;
  const int64_t L = stacked ? positions_in.size(0) : 1;
  const int64_t b = positions_in.size(stacked ? 1 : 0), n = positions_in.size(stacked ? 2 : 1);
  TORCH_CHECK(static_cast<int64_t>(values.size()) == L, "mri_track: one values tensor per layer of positions");
  std::vector<at::Tensor> vals;  // fp32 [b, n] each: a token is activated where value / divisor >= alpha
  std::vector<const float*> v;
  for (const at::Tensor& t : values) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == b && t.size(1) == n && t.scalar_type() == at::kFloat,
                "mri_track: values must be fp32 [b, n], the shape of a layer's positions");
    vals.push_back(t.contiguous());
    v.push_back(vals.back().data_ptr<float>());
  }
  // torch's (values / divisor) >= alpha on fp32 tensors: an fp32 quotient against alpha rounded to fp32
  const float div = static_cast<float>(divisor), thr = static_cast<float>(alpha);
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == b && prompt_in.numel() == b && step_in.numel() == b,
              "mri_track: rows, prompt and step must be [b], one per request of positions");
  const int64_t R = ts.size(1), cap = ts.size(2);
  TORCH_CHECK(layer >= 0 && layer + L <= ts.size(0), "mri_track: a layer out of the table");
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor prompt = prompt_in.to(at::kLong).contiguous();
  const at::Tensor step = step_in.to(at::kLong).contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < R, "mri_track: a row out of the table");
  const int64_t* p = positions.data_ptr<int64_t>();
  const int64_t* pl = prompt.data_ptr<int64_t>();
  const int64_t* st = step.data_ptr<int64_t>();
  int32_t* ts_0 = ts.data_ptr<int32_t>() + layer * R * cap;
  int32_t* mri_0 = mri.data_ptr<int32_t>() + layer * R * cap;
  constexpr int64_t SERIAL_WORK = 1 << 14;  // entries below which no thread is woken (a batch of 256 x 80 splits)
  const int64_t grain = n > 0 ? std::max<int64_t>(1, SERIAL_WORK / n) : L * b;
  std::atomic<bool> bad{false};
  at::parallel_for(0, L * b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t li = lo; li < hi; ++li) {  // (layer, request) pairs: distinct table rows, no conflicts
      const int64_t l = li / b, i = li % b;
      int32_t* ts_row = ts_0 + (l * R + r[i]) * cap;
      int32_t* mri_row = mri_0 + (l * R + r[i]) * cap;
      const int64_t* pr = p + li * n;
      const float* vr = v[l] + i * n;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = pr[j];
        if (pos < 0 || !(vr[j] / div >= thr)) continue;
        if (pos >= cap) {
          bad.store(true, std::memory_order_relaxed);
          continue;
        }
        const int32_t now = static_cast<int32_t>(st[i] - std::max<int64_t>(pos - pl[i] + 1, 0));
        mri_row[pos] = std::max(mri_row[pos], now - ts_row[pos]);
        ts_row[pos] = now;
      }
    }
  });
  TORCH_CHECK(!bad.load(), "mri_track: a position past the table's width");
}

}  // namespace trtkv
