// CPU lowest-scored free position per row, scores read from a score table (contract:
// plugins/table_victims/reference.py). gather_rows + a protection mask + lowest_victim in one pass a row: each
// column's score is read from the table where it lies and compared at once (lowest_victim's rules: a NaN beats any
// number, an older position wins a tie), with no [L, k, c] scores or mask in between. Comparisons only: exact.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lowest_pick.h"
#include "score_table.h"

namespace trtkv {

namespace {

template <typename T>
void lowest_rows(const T* d, const int64_t* bound, int64_t* o, const TableBatch& t, int64_t layer0) {
  const int64_t n = t.n, cap = t.cap;
  const int64_t* p = t.positions.data_ptr<int64_t>();
  for_each_table_row(t, layer0, [&](int64_t at, int64_t li) {
    const T* row = d + at;
    const int64_t* pr = p + li * n;
    const int64_t below = bound[li % t.b];
    LowestPick pick;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = pr[j];
      if (pos < 0 || pos >= below) continue;
      pick.offer(pos < cap ? static_cast<float>(row[pos]) : 0.0f, pos);
    }
    o[li] = pick.victim();
  });
}

}  // namespace

at::Tensor table_victims_cpu(const at::Tensor& data, const at::Tensor& rows_in, const at::Tensor& positions_in,
                             const at::Tensor& bound_in, int64_t layer0) {
  const auto dt = data.scalar_type();
  TORCH_CHECK(data.dim() == 3 && (dt == at::kFloat || dt == at::kDouble) && data.is_contiguous(),
              "table_victims: data must be a contiguous float32 or float64 [layers, rows, cap]");
  const TableBatch t = table_batch("table_victims", data, rows_in, positions_in, layer0);
  TORCH_CHECK(bound_in.dim() == 1 && bound_in.size(0) == t.b, "table_victims: bound must be [k], one per row");
  const at::Tensor bound = bound_in.to(at::kLong).contiguous();
  at::Tensor out = at::empty({t.L, t.b}, t.positions.options());
  if (dt == at::kFloat)
    lowest_rows(data.data_ptr<float>(), bound.data_ptr<int64_t>(), out.data_ptr<int64_t>(), t, layer0);
  else
    lowest_rows(data.data_ptr<double>(), bound.data_ptr<int64_t>(), out.data_ptr<int64_t>(), t, layer0);
  return out;
}

}  // namespace trtkv
