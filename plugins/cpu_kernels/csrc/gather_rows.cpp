// CPU read of a batch's per-position values from a score table (contract: plugins/gather_rows/reference.py).
//
// The reference builds [L, b, n] flat indices, gathers and masks (four passes and two temporaries); here each
// (layer, request) row is one pass reading its positions from its table row. Reads only: exact.
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

#include "score_table.h"

namespace trtkv {

namespace {

template <typename T>
void read_rows(const T* d, T* o, const TableBatch& t, int64_t layer0, std::atomic<bool>& bad) {
  const int64_t n = t.n, cap = t.cap;
  const int64_t* p = t.positions.data_ptr<int64_t>();
  for_each_table_row(t, layer0, [&](int64_t at, int64_t li) {
    const T* row = d + at;
    const int64_t* pr = p + li * n;
    T* orow = o + li * n;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = pr[j];
      if (pos >= cap) bad.store(true, std::memory_order_relaxed);
      orow[j] = (pos >= 0 && pos < cap) ? row[pos] : T(0);
    }
  });
}

}  // namespace

at::Tensor gather_rows_cpu(const at::Tensor& data, const at::Tensor& rows_in, const at::Tensor& positions_in,
                           int64_t layer0) {
  const auto dt = data.scalar_type();
  TORCH_CHECK(data.dim() == 3 && (dt == at::kFloat || dt == at::kDouble || dt == at::kInt) && data.is_contiguous(),
              "gather_rows: data must be a contiguous float32, float64 or int32 [layers, rows, cap]");
  const TableBatch t = table_batch("gather_rows", data, rows_in, positions_in, layer0);
  at::Tensor out = at::empty({t.L, t.b, t.n}, data.options());
  std::atomic<bool> bad{false};
  if (dt == at::kFloat)
    read_rows(data.data_ptr<float>(), out.data_ptr<float>(), t, layer0, bad);
  else if (dt == at::kDouble)
    read_rows(data.data_ptr<double>(), out.data_ptr<double>(), t, layer0, bad);
  else
    read_rows(data.data_ptr<int32_t>(), out.data_ptr<int32_t>(), t, layer0, bad);
  TORCH_CHECK(!bad.load(), "gather_rows: a position past the table's width");
  return out;
}

}  // namespace trtkv
