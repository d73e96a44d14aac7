// A batch's entries of a per-position score table [layers, rows, cap] (scatter_add_rows.cpp, gather_rows.cpp):
// the argument checks both ops share, and their rows and positions as contiguous int64.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace trtkv {

struct TableBatch {
  at::Tensor rows, positions;  // [b], [L, b, n] int64, contiguous
  int64_t L, b, n, R, cap;
};

inline TableBatch table_batch(const char* op, const at::Tensor& data, const at::Tensor& rows_in,
                              const at::Tensor& positions_in, int64_t layer0) {
  TORCH_CHECK(positions_in.dim() == 3, op, ": positions must be [L, b, n]");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == positions_in.size(1), op,
              ": rows must be [b], one per request of positions");
  TableBatch t{rows_in.to(at::kLong).contiguous(), positions_in.to(at::kLong).contiguous(), positions_in.size(0),
               positions_in.size(1), positions_in.size(2), data.size(1), data.size(2)};
  TORCH_CHECK(layer0 >= 0 && layer0 + t.L <= data.size(0), op, ": layers out of the table");
  const int64_t* r = t.rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.b; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < t.R, op, ": a row out of the table");
  return t;
}

// fn(table row offset, li) for every (layer, request) row li of the batch (row offset: where that request's row of
// that layer starts in the table's data), rows in parallel above a work size: rows are distinct, so are the
// table rows they touch.
template <typename F>
inline void for_each_table_row(const TableBatch& t, int64_t layer0, F&& fn) {
  constexpr int64_t SERIAL_WORK = 1 << 16;  // entries below which no thread is woken
  const int64_t grain = t.n > 0 ? std::max<int64_t>(1, SERIAL_WORK / t.n) : t.L * t.b;
  const int64_t* r = t.rows.data_ptr<int64_t>();
  at::parallel_for(0, t.L * t.b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t li = lo; li < hi; ++li) fn(((layer0 + li / t.b) * t.R + r[li % t.b]) * t.cap, li);
  });
}

}  // namespace trtkv
