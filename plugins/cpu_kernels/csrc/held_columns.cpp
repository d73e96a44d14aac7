// CPU held columns of a batch's position-map rows in every layer (contract: plugins/held_columns/reference.py).
//
// The reference copies the batch's [L, k, width] rows out of the map and scans the copy; here each (layer, row)
// is one scan of the map in place, writing its held columns in order. Reads only: exact.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace trtkv {

at::Tensor held_columns_cpu(const at::Tensor& where, const at::Tensor& rows_in, int64_t n) {
  TORCH_CHECK(where.dim() == 3 && where.scalar_type() == at::kInt && where.is_contiguous(),
              "held_columns: where must be a contiguous int32 [layers, rows, width]");
  TORCH_CHECK(rows_in.dim() == 1, "held_columns: rows must be [k]");
  TORCH_CHECK(n >= 0, "held_columns: n must be >= 0");
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const int64_t L = where.size(0), R = where.size(1), W = where.size(2), k = rows.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < R, "held_columns: a row out of the map");
  at::Tensor out = at::empty({L, k, n}, rows.options());
  const int32_t* w = where.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  constexpr int64_t SERIAL_WORK = 1 << 18;  // map entries below which no thread is woken
  const int64_t grain = W > 0 ? std::max<int64_t>(1, SERIAL_WORK / W) : L * k;
  at::parallel_for(0, L * k, grain, [&](int64_t lo, int64_t hi) {
    // every column is written at the slot after the last held one and kept only if held: no branch to
    // mispredict on maps about a third held (a budget inside a generation's positions)
    std::vector<int64_t> buf(W + 1);
    for (int64_t li = lo; li < hi; ++li) {
      const int64_t l = li / k, i = li % k;
      const int32_t* row = w + (l * R + r[i]) * W;
      int64_t got = 0;
      for (int64_t j = 0; j < W; ++j) {
        buf[got] = j;
        got += row[j] >= 0;
      }
      if (got != n) {
        bad.store(true, std::memory_order_relaxed);
        continue;
      }
      std::memcpy(o + li * n, buf.data(), n * sizeof(int64_t));
    }
  });
  TORCH_CHECK(!bad.load(), "held_columns: a row holds other than ", n, " columns");
  return out;
}

}  // namespace trtkv
