// CPU accumulation of a batch's per-position evidence into a score table (contract:
// plugins/scatter_add_rows/reference.py).
//
// The reference builds flat indices and a mask over [L, b, n] and scatters with index_add_ (five passes and two
// temporaries of the indices); here each (layer, request) row is one pass that adds its values at its positions.
// Positions are distinct within a row and rows are distinct, so rows run in parallel without conflicts, and
// each entry is the same single add, in the table's dtype (float32 or float64), as the reference's.
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

#include "score_table.h"

namespace trtkv {

namespace {

template <typename T>
void add_rows(T* d, const T* v, const TableBatch& t, int64_t layer0, std::atomic<bool>& bad) {
  const int64_t n = t.n, cap = t.cap;
  const int64_t* p = t.positions.data_ptr<int64_t>();
  for_each_table_row(t, layer0, [&](int64_t at, int64_t li) {
    T* row = d + at;
    const int64_t* pr = p + li * n;
    const T* vr = v + li * n;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = pr[j];
      if (pos < 0) continue;
      if (pos >= cap) {
        bad.store(true, std::memory_order_relaxed);
        continue;
      }
      row[pos] += vr[j];
    }
  });
}

}  // namespace

void scatter_add_rows_cpu(at::Tensor& data, const at::Tensor& rows_in, const at::Tensor& positions_in,
                          const at::Tensor& values_in, int64_t layer0) {
  TORCH_CHECK(data.dim() == 3 && (data.scalar_type() == at::kFloat || data.scalar_type() == at::kDouble) &&
                  data.is_contiguous(),
              "scatter_add_rows: data must be a contiguous float32 or float64 [layers, rows, cap]");
  TORCH_CHECK(values_in.sizes() == positions_in.sizes(),
              "scatter_add_rows: positions and values must be [L, b, n] of one shape");
  const TableBatch t = table_batch("scatter_add_rows", data, rows_in, positions_in, layer0);
  const at::Tensor values = values_in.to(data.scalar_type()).contiguous();
  std::atomic<bool> bad{false};
  if (data.scalar_type() == at::kFloat)
    add_rows(data.data_ptr<float>(), values.data_ptr<float>(), t, layer0, bad);
  else
    add_rows(data.data_ptr<double>(), values.data_ptr<double>(), t, layer0, bad);
  TORCH_CHECK(!bad.load(), "scatter_add_rows: a position past the table's width");
}

}  // namespace trtkv
