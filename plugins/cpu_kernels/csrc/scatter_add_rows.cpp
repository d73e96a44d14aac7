// CPU accumulation of a batch's per-position evidence into a score table (contract:
// plugins/scatter_add_rows/reference.py).
//
// The reference builds flat indices and a mask over [L, b, n] and scatters with index_add_ (five passes and two
// temporaries of the indices); here each (layer, request) row is one pass that adds its values at its positions.
// Positions are distinct within a row and rows are distinct, so rows run in parallel without conflicts, and
// each entry is the same single add, in the table's dtype (float32 or float64), as the reference's.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

namespace trtkv {

namespace {

template <typename T>
void add_rows(T* d, const T* v, const int64_t* p, const int64_t* r, int64_t L, int64_t b, int64_t n, int64_t R,
              int64_t cap, int64_t layer0, std::atomic<bool>& bad) {
  constexpr int64_t SERIAL_WORK = 1 << 16;  // entries below which no thread is woken
  const int64_t grain = n > 0 ? std::max<int64_t>(1, SERIAL_WORK / n) : L * b;
  at::parallel_for(0, L * b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t li = lo; li < hi; ++li) {
      const int64_t l = li / b, i = li % b;
      T* row = d + ((layer0 + l) * R + r[i]) * cap;
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
    }
  });
}

}  // namespace

void scatter_add_rows_cpu(at::Tensor& data, const at::Tensor& rows_in, const at::Tensor& positions_in,
                          const at::Tensor& values_in, int64_t layer0) {
  TORCH_CHECK(data.dim() == 3 && (data.scalar_type() == at::kFloat || data.scalar_type() == at::kDouble) &&
                  data.is_contiguous(),
              "scatter_add_rows: data must be a contiguous float32 or float64 [layers, rows, cap]");
  TORCH_CHECK(positions_in.dim() == 3 && values_in.sizes() == positions_in.sizes(),
              "scatter_add_rows: positions and values must be [L, b, n] of one shape");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == positions_in.size(1),
              "scatter_add_rows: rows must be [b], one per request of positions");
  const int64_t L = positions_in.size(0), b = positions_in.size(1), n = positions_in.size(2);
  const int64_t R = data.size(1), cap = data.size(2);
  TORCH_CHECK(layer0 >= 0 && layer0 + L <= data.size(0), "scatter_add_rows: layers out of the table");
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor values = values_in.to(data.scalar_type()).contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < R, "scatter_add_rows: a row out of the table");
  const int64_t* p = positions.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  if (data.scalar_type() == at::kFloat)
    add_rows(data.data_ptr<float>(), values.data_ptr<float>(), p, r, L, b, n, R, cap, layer0, bad);
  else
    add_rows(data.data_ptr<double>(), values.data_ptr<double>(), p, r, L, b, n, R, cap, layer0, bad);
  TORCH_CHECK(!bad.load(), "scatter_add_rows: a position past the table's width");
}

}  // namespace trtkv
