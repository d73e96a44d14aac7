// CPU read of a batch's per-position values from a score table (contract: plugins/gather_rows/reference.py).
//
// The reference builds [L, b, n] flat indices, gathers and masks (four passes and two temporaries); here each
// (layer, request) row is one pass reading its positions from its table row. Reads only: exact.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

namespace trtkv {

namespace {

template <typename T>
void read_rows(const T* d, T* o, const int64_t* p, const int64_t* r, int64_t L, int64_t b, int64_t n, int64_t R,
               int64_t cap, int64_t layer0, std::atomic<bool>& bad) {
  constexpr int64_t SERIAL_WORK = 1 << 16;  // entries below which no thread is woken
  const int64_t grain = n > 0 ? std::max<int64_t>(1, SERIAL_WORK / n) : L * b;
  at::parallel_for(0, L * b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t li = lo; li < hi; ++li) {
      const int64_t l = li / b, i = li % b;
      const T* row = d + ((layer0 + l) * R + r[i]) * cap;
      const int64_t* pr = p + li * n;
      T* orow = o + li * n;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = pr[j];
        if (pos >= cap) bad.store(true, std::memory_order_relaxed);
        orow[j] = (pos >= 0 && pos < cap) ? row[pos] : T(0);
      }
    }
  });
}

}  // namespace

at::Tensor gather_rows_cpu(const at::Tensor& data, const at::Tensor& rows_in, const at::Tensor& positions_in,
                           int64_t layer0) {
  const auto dt = data.scalar_type();
  TORCH_CHECK(data.dim() == 3 && (dt == at::kFloat || dt == at::kDouble || dt == at::kInt) && data.is_contiguous(),
              "gather_rows: data must be a contiguous float32, float64 or int32 [layers, rows, cap]");
  TORCH_CHECK(positions_in.dim() == 3, "gather_rows: positions must be [L, b, n]");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == positions_in.size(1),
              "gather_rows: rows must be [b], one per request of positions");
  const int64_t L = positions_in.size(0), b = positions_in.size(1), n = positions_in.size(2);
  const int64_t R = data.size(1), cap = data.size(2);
  TORCH_CHECK(layer0 >= 0 && layer0 + L <= data.size(0), "gather_rows: layers out of the table");
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < R, "gather_rows: a row out of the table");
  at::Tensor out = at::empty({L, b, n}, data.options());
  const int64_t* p = positions.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  if (dt == at::kFloat)
    read_rows(data.data_ptr<float>(), out.data_ptr<float>(), p, r, L, b, n, R, cap, layer0, bad);
  else if (dt == at::kDouble)
    read_rows(data.data_ptr<double>(), out.data_ptr<double>(), p, r, L, b, n, R, cap, layer0, bad);
  else
    read_rows(data.data_ptr<int32_t>(), out.data_ptr<int32_t>(), p, r, L, b, n, R, cap, layer0, bad);
  TORCH_CHECK(!bad.load(), "gather_rows: a position past the table's width");
  return out;
}

}  // namespace trtkv
