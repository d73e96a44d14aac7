// CPU read of the token positions behind a layer's paged-attention columns (contract:
// plugins/table_positions/reference.py). The reference clamps, gathers and masks in three passes with two
// temporaries; here each table entry copies its page's row of slot positions once. Reads only: exact.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace trtkv {

namespace {

template <typename I>
void read_pages(const int64_t* sp, const I* bt, int64_t* out, int64_t* counts, int64_t b, int64_t P, int64_t cap,
                int64_t B, std::atomic<bool>& bad) {
  for (int64_t i = 0; i < b; ++i) {
    int64_t held = 0;
    for (int64_t e = i * P; e < (i + 1) * P; ++e) {
      const int64_t page = static_cast<int64_t>(bt[e]);
      int64_t* o = out + e * B;
      if (page >= 0 && page < cap) {
        std::memcpy(o, sp + page * B, B * sizeof(int64_t));
        for (int64_t s = 0; s < B; ++s) held += o[s] >= 0;
        continue;
      }
      if (page >= cap) bad.store(true, std::memory_order_relaxed);
      for (int64_t s = 0; s < B; ++s) o[s] = -1;
    }
    counts[i] = held;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> table_positions_cpu(const at::Tensor& slot_pos, const at::Tensor& block_table) {
  TORCH_CHECK(slot_pos.dim() == 2 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous(),
              "table_positions: slot_pos must be a contiguous int64 [cap, B]");
  const auto it = block_table.scalar_type();
  TORCH_CHECK(block_table.dim() == 2 && (it == at::kInt || it == at::kLong),
              "table_positions: block_table must be an int32 or int64 [b, P]");
  const at::Tensor bt = block_table.contiguous();
  const int64_t b = bt.size(0), P = bt.size(1), cap = slot_pos.size(0), B = slot_pos.size(1);
  at::Tensor out = at::empty({b, P * B}, slot_pos.options());
  at::Tensor counts = at::empty({b}, slot_pos.options());
  std::atomic<bool> bad{false};
  const int64_t* sp = slot_pos.data_ptr<int64_t>();
  if (it == at::kInt)
    read_pages(sp, bt.data_ptr<int32_t>(), out.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), b, P, cap, B, bad);
  else
    read_pages(sp, bt.data_ptr<int64_t>(), out.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), b, P, cap, B, bad);
  TORCH_CHECK(!bad.load(), "table_positions: a page past the pool");
  return {out, counts};
}

std::tuple<at::Tensor, at::Tensor> table_positions_layers_cpu(const at::Tensor& slot_pos,
                                                              const std::vector<at::Tensor>& block_tables) {
  TORCH_CHECK(slot_pos.dim() == 3 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous(),
              "table_positions_layers: slot_pos must be a contiguous int64 [L, cap, B]");
  const int64_t L = slot_pos.size(0), cap = slot_pos.size(1), B = slot_pos.size(2);
  TORCH_CHECK(static_cast<int64_t>(block_tables.size()) == L, "table_positions_layers: one block table a layer");
  std::vector<at::Tensor> tables;
  for (const auto& t : block_tables) {
    const auto it = t.scalar_type();
    TORCH_CHECK(t.dim() == 2 && (it == at::kInt || it == at::kLong) && it == block_tables[0].scalar_type() &&
                    t.sizes() == block_tables[0].sizes(),
                "table_positions_layers: block tables must be int32 or int64 [b, P], all of one shape and type");
    tables.push_back(t.contiguous());
  }
  const int64_t b = L ? tables[0].size(0) : 0, P = L ? tables[0].size(1) : 0;
  at::Tensor out = at::empty({L, b, P * B}, slot_pos.options());
  at::Tensor counts = at::empty({L, b}, slot_pos.options());
  std::atomic<bool> bad{false};
  const int64_t* sp = slot_pos.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  // layers write disjoint outputs: two or more threads share the step's ~5 MB of positions (memory-bound)
  at::parallel_for(0, L, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t l = lo; l < hi; ++l) {
      if (tables[l].scalar_type() == at::kInt)
        read_pages(sp + l * cap * B, tables[l].data_ptr<int32_t>(), o + l * b * P * B, c + l * b, b, P, cap, B, bad);
      else
        read_pages(sp + l * cap * B, tables[l].data_ptr<int64_t>(), o + l * b * P * B, c + l * b, b, P, cap, B, bad);
    }
  });
  TORCH_CHECK(!bad.load(), "table_positions_layers: a page past the pool");
  return {out, counts};
}

}  // namespace trtkv
