// CPU gather compaction of page lists (contract: plugins/compact_slots/reference.py).
//
// The reference finds the live slots, ranks them and moves their rows with an index_select and an index_copy_ a
// field, then rewrites the slot state in a dozen array passes. Here each list is one pass in page-then-slot order
// that copies each moved token's rows in place: the k-th live token goes to slot k % B of the list's (k / B)-th
// page, which no later token of the list is read from (a later token's source is that page at a higher slot, or a
// later page), so no staging copy is needed. Lists hold distinct pages and run in parallel. Bytes are copied as
// they are: exact.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace trtkv {

namespace {

// One slot's row of a field: whole 8-byte words where the row is a multiple of them (the usual codes and scales:
// an inlined loop, not a library call a token), else memcpy.
inline void copy_row(char* dst, const char* src, int64_t bytes) {
  if (bytes % 8 == 0) {
    uint64_t* d = reinterpret_cast<uint64_t*>(dst);
    const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
    for (int64_t w = 0; w < bytes / 8; ++w) d[w] = s[w];
  } else {
    std::memcpy(dst, src, bytes);
  }
}

}  // namespace

void compact_slots_cpu(const std::vector<at::Tensor>& slot_fields, at::Tensor& k_group, at::Tensor& valid,
                       at::Tensor& live, at::Tensor& hwm, at::Tensor& slot_pos, at::Tensor& slot_seg,
                       const at::Tensor& pages_in, const at::Tensor& lens_in, at::Tensor& out_tokens,
                       at::Tensor& out_lists) {
  TORCH_CHECK(slot_pos.dim() == 2 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous(),
              "compact_slots: slot_pos must be a contiguous int64 [pages, B]");
  const int64_t P = slot_pos.size(0), B = slot_pos.size(1);
  TORCH_CHECK(B >= 1 && B <= 31, "compact_slots: validity words hold at most 31 slots a page");
  for (const at::Tensor* t : {&valid, &live, &hwm})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == P && t->scalar_type() == at::kInt && t->is_contiguous(),
                "compact_slots: valid, live and hwm must be contiguous int32 [pages]");
  TORCH_CHECK(slot_seg.sizes() == slot_pos.sizes() && slot_seg.scalar_type() == at::kInt && slot_seg.is_contiguous(),
              "compact_slots: slot_seg must be a contiguous int32 [pages, B]");
  std::vector<at::Tensor> rows_of(slot_fields.begin(), slot_fields.end());
  rows_of.push_back(k_group);
  std::vector<char*> base;
  std::vector<int64_t> row_bytes;
  for (const auto& t : rows_of) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() >= 2 && t.size(0) == P && t.size(1) == B,
                "compact_slots: slot fields and k_group must be contiguous CPU [pages, B, ...] tensors");
    base.push_back(static_cast<char*>(t.data_ptr()));
    row_bytes.push_back(P * B ? t.numel() / (P * B) * t.element_size() : 0);
  }
  const at::Tensor pages = pages_in.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(pages.dim() == 1 && lens.dim() == 1, "compact_slots: pages and lens must be 1-D");
  const int64_t J = lens.size(0);
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  int32_t* vb = valid.data_ptr<int32_t>();
  int32_t* lv = live.data_ptr<int32_t>();
  int32_t* hw = hwm.data_ptr<int32_t>();
  int64_t* sp = slot_pos.data_ptr<int64_t>();
  int32_t* sg = slot_seg.data_ptr<int32_t>();
  const uint32_t mask = (1u << B) - 1;
  // each list's first page and first token (live tokens of the lists before it)
  std::vector<int64_t> page0(J + 1, 0), tok0(J + 1, 0);
  for (int64_t j = 0; j < J; ++j) {
    TORCH_CHECK(ln[j] >= 0, "compact_slots: a negative list length");
    page0[j + 1] = page0[j] + ln[j];
  }
  TORCH_CHECK(page0[J] == pages.size(0), "compact_slots: the lists' lengths must add up to the pages given");
  for (int64_t j = 0; j < J; ++j) {
    int64_t n = 0;
    for (int64_t q = page0[j]; q < page0[j + 1]; ++q) {
      TORCH_CHECK(pg[q] >= 0 && pg[q] < P, "compact_slots: a page out of the pool");
      n += __builtin_popcount(static_cast<uint32_t>(vb[pg[q]]) & mask);
    }
    tok0[j + 1] = tok0[j] + n;
  }
  TORCH_CHECK(out_tokens.dim() == 2 && out_tokens.size(0) == 3 && out_tokens.size(1) == tok0[J] &&
                  out_tokens.scalar_type() == at::kLong && out_tokens.is_contiguous(),
              "compact_slots: out_tokens must be a contiguous int64 [3, live tokens of the lists]");
  TORCH_CHECK(out_lists.dim() == 1 && out_lists.size(0) == J + 1 && out_lists.scalar_type() == at::kLong &&
                  out_lists.is_contiguous(),
              "compact_slots: out_lists must be a contiguous int64 [lists + 1]");
  int64_t* o_pos = out_tokens.data_ptr<int64_t>();
  int64_t* o_page = o_pos + tok0[J];
  int64_t* o_slot = o_page + tok0[J];
  int64_t* o_list = out_lists.data_ptr<int64_t>();
  std::atomic<int64_t> moved{0};
  constexpr int64_t SERIAL_WORK = 1 << 12;  // tokens below which no thread is woken
  const int64_t grain = J ? std::max<int64_t>(1, SERIAL_WORK * J / std::max<int64_t>(1, tok0[J])) : 1;
  at::parallel_for(0, J, grain, [&](int64_t lo, int64_t hi) {
    int64_t mine = 0;
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t* list = pg + page0[j];
      int64_t k = 0;  // rank of the next live token in this list
      for (int64_t q = 0; q < ln[j]; ++q) {
        const int64_t src = list[q];
        const uint32_t bits = static_cast<uint32_t>(vb[src]) & mask;
        for (int64_t s = 0; s < B; ++s) {
          if (!((bits >> s) & 1u)) continue;
          const int64_t dst = list[k / B], ds = k % B;
          const int64_t from = src * B + s, to = dst * B + ds;
          const int64_t pos = sp[from];
          const int32_t seg = sg[from];
          if (from != to) {
            for (size_t f = 0; f < base.size(); ++f)
              copy_row(base[f] + to * row_bytes[f], base[f] + from * row_bytes[f], row_bytes[f]);
            ++mine;
          }
          sp[to] = pos;
          sg[to] = seg;
          const int64_t at = tok0[j] + k;
          o_pos[at] = pos;
          o_page[at] = dst;
          o_slot[at] = ds;
          ++k;
        }
      }
      // the list's pages: the first k / B full, the next holding k % B, the rest empty
      for (int64_t q = 0; q < ln[j]; ++q) {
        const int64_t p = list[q];
        const int64_t n = std::min<int64_t>(B, std::max<int64_t>(0, k - q * B));
        vb[p] = static_cast<int32_t>((1u << n) - 1u);
        lv[p] = static_cast<int32_t>(n);
        hw[p] = static_cast<int32_t>(n);
        for (int64_t s = n; s < B; ++s) {
          sp[p * B + s] = -1;
          sg[p * B + s] = -1;
        }
      }
      o_list[j] = k;
    }
    moved.fetch_add(mine, std::memory_order_relaxed);
  });
  o_list[J] = moved.load();
}

}  // namespace trtkv
