// CPU accumulation of a batch's per-position evidence into a score table (contract:
// plugins/scatter_add_rows/reference.py).
//
// The reference builds flat indices and a mask over [L, b, n] and scatters with index_add_ (five passes and two
// temporaries of the indices); here each (layer, request) row is one pass that adds its values at its positions.
// Positions are distinct within a row and rows are distinct, so rows run in parallel without conflicts, and
// each entry is the same single add, in the table's dtype (float32 or float64), as the reference's.
// fold_add_rows adds every layer's values into one layer: requests run in parallel, each one's layers in order, so
// a position several layers hold sums in the reference's order. finite_rows says which rows of each block are
// finite (the fold's rows left out of a step's average): one pass a block, no temporaries.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "score_table.h"

namespace trtkv {

namespace {

// One table row's adds: row[pr[j]] += value(j) for each of its n positions (-1: skip; one past the width is flagged).
template <typename T, typename F>
inline void add_row(T* row, const int64_t* pr, int64_t n, int64_t cap, std::atomic<bool>& bad, F&& value) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = pr[j];
    if (pos < 0) continue;
    if (pos >= cap) {
      bad.store(true, std::memory_order_relaxed);
      continue;
    }
    row[pos] += value(j);
  }
}

template <typename T>
void add_rows(T* d, const T* v, const TableBatch& t, int64_t layer0, std::atomic<bool>& bad) {
  const int64_t n = t.n, cap = t.cap;
  const int64_t* p = t.positions.data_ptr<int64_t>();
  for_each_table_row(t, layer0, [&](int64_t at, int64_t li) {
    const T* vr = v + li * n;
    add_row(d + at, p + li * n, n, cap, bad, [&](int64_t j) { return vr[j]; });
  });
}

template <typename T, typename V>
void fold_rows(T* d, const std::vector<const V*>& v, const T* div, const int64_t* r,
               const std::vector<const int64_t*>& p, const std::vector<int64_t>& n, int64_t b, int64_t row0,
               int64_t cap, std::atomic<bool>& bad) {
  int64_t entries = 0;
  for (const int64_t w : n) entries += w;
  constexpr int64_t SERIAL_WORK = 1 << 16;  // entries below which no thread is woken
  const int64_t grain = entries > 0 ? std::max<int64_t>(1, SERIAL_WORK / entries) : b;
  at::parallel_for(0, b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T* row = d + (row0 + r[i]) * cap;
      for (size_t l = 0; l < n.size(); ++l) {
        const V* vr = v[l] + i * n[l];
        add_row(row, p[l] + i * n[l], n[l], cap, bad, [&](int64_t j) { return static_cast<T>(vr[j]) / div[i]; });
      }
    }
  });
}

// Whether no value of v[0..n) has every exponent bit set (none is infinite or NaN).
template <typename U, typename F>
inline bool all_exponents_below(const F* v, int64_t n, U exponent) {
  static_assert(sizeof(U) == sizeof(F), "one unsigned word a value");
  U bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    U u;
    std::memcpy(&u, v + j, sizeof(U));
    bad |= static_cast<U>((u & exponent) == exponent);
  }
  return bad == 0;
}

}  // namespace

void fold_add_rows_cpu(at::Tensor& data, const at::Tensor& rows_in, const std::vector<at::Tensor>& positions_in,
                       const std::vector<at::Tensor>& values_in, const at::Tensor& divisor_in, int64_t layer) {
  TORCH_CHECK(data.dim() == 3 && (data.scalar_type() == at::kFloat || data.scalar_type() == at::kDouble) &&
                  data.is_contiguous(),
              "fold_add_rows: data must be a contiguous float32 or float64 [layers, rows, cap]");
  const int64_t b = rows_in.size(0);
  TORCH_CHECK(rows_in.dim() == 1 && divisor_in.dim() == 1 && divisor_in.size(0) == b,
              "fold_add_rows: rows and divisor must be [b], one per request");
  TORCH_CHECK(positions_in.size() == values_in.size(), "fold_add_rows: one positions and one values a layer");
  TORCH_CHECK(layer >= 0 && layer < data.size(0), "fold_add_rows: layer out of the table");
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < data.size(1), "fold_add_rows: a row out of the table");
  const at::Tensor divisor = divisor_in.to(data.scalar_type()).contiguous();
  // float32 values are read as they are (the quotient is taken in the table's dtype, as the reference's); others
  // become the table's dtype first
  bool all_float = true;
  for (const auto& v : values_in) all_float = all_float && v.scalar_type() == at::kFloat;
  std::vector<at::Tensor> positions, values;
  std::vector<const int64_t*> p;
  std::vector<int64_t> n;
  for (size_t l = 0; l < positions_in.size(); ++l) {
    TORCH_CHECK(positions_in[l].dim() == 2 && positions_in[l].size(0) == b &&
                    values_in[l].sizes() == positions_in[l].sizes(),
                "fold_add_rows: each layer's positions and values must be [b, n] of one shape");
    positions.push_back(positions_in[l].to(at::kLong).contiguous());
    values.push_back(values_in[l].to(all_float ? at::kFloat : data.scalar_type()).contiguous());
    p.push_back(positions.back().data_ptr<int64_t>());
    n.push_back(positions_in[l].size(1));
  }
  std::atomic<bool> bad{false};
  const int64_t row0 = layer * data.size(1), cap = data.size(2);
  AT_DISPATCH_FLOATING_TYPES(data.scalar_type(), "fold_add_rows", [&] {
    using T = scalar_t;
    if (all_float) {
      std::vector<const float*> v;
      for (const auto& t : values) v.push_back(t.data_ptr<float>());
      fold_rows(data.data_ptr<T>(), v, divisor.data_ptr<T>(), r, p, n, b, row0, cap, bad);
    } else {
      std::vector<const T*> v;
      for (const auto& t : values) v.push_back(t.data_ptr<T>());
      fold_rows(data.data_ptr<T>(), v, divisor.data_ptr<T>(), r, p, n, b, row0, cap, bad);
    }
  });
  TORCH_CHECK(!bad.load(), "fold_add_rows: a position past the table's width");
}

at::Tensor finite_rows_cpu(const std::vector<at::Tensor>& values_in) {
  const int64_t L = static_cast<int64_t>(values_in.size());
  const int64_t b = L ? values_in[0].size(0) : 0;
  std::vector<at::Tensor> values;
  std::vector<int64_t> n;
  for (const auto& v : values_in) {
    TORCH_CHECK(v.dim() == 2 && v.size(0) == b, "finite_rows: each block must be [b, n], one row a request");
    TORCH_CHECK(v.is_floating_point(), "finite_rows: blocks must be floating point");
    values.push_back(v.to(v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous());
    n.push_back(v.size(1));
  }
  at::Tensor out = at::empty({L, b}, at::kBool);
  bool* o = out.data_ptr<bool>();
  int64_t entries = 0;
  for (const int64_t w : n) entries += w * b;
  constexpr int64_t SERIAL_WORK = 1 << 18;  // entries below which no thread is woken
  const int64_t grain = entries > 0 ? std::max<int64_t>(1, SERIAL_WORK * L * b / entries) : L * b + 1;
  at::parallel_for(0, L * b, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t at = lo; at < hi; ++at) {
      const int64_t l = at / b, i = at % b, w = n[l];
      // a value is not finite when its exponent bits are all ones: an integer test, so the loop vectorizes
      if (values[l].scalar_type() == at::kDouble) {
        o[at] = all_exponents_below<uint64_t>(values[l].data_ptr<double>() + i * w, w, 0x7ff0000000000000ULL);
      } else {
        o[at] = all_exponents_below<uint32_t>(values[l].data_ptr<float>() + i * w, w, 0x7f800000U);
      }
    }
  });
  return out;
}

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
