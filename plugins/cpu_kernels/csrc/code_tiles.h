// What the code-domain attention tasks share whatever the instruction set (code_attention.h: AVX-512 VBMI,
// code_attention_avx2.h: AVX2): which formats they take, when a (sequence, split) suits them, the page
// look-ahead, and the loop that gathers one key group's tiles.
#pragma once
#include "paged_common.h"

namespace trtkv {

template <int FMT>
constexpr bool code_format = FMT == NVFP4 || FMT == NVFP4O || FMT == TERNARY || FMT == TERNARYO || FMT == INT4 ||
                             FMT == INT2;
template <int FMT>
constexpr int code_bits = (FMT == NVFP4 || FMT == NVFP4O || FMT == INT4) ? 4 : 2;

// Does the code-domain task suit this (sequence, split)? It pays per tile (the queries scaled for the
// tile's key group, the byte transposes, one softmax update per head) and a tile ends where the key group
// changes, so a cache whose evictions refilled freed slots with newer groups (ThinKV, H2O at a budget)
// gives it tiles of a few tokens, and the float-tile task, which gathers 16 tokens across groups, is
// faster there (ThinKV at budget 256: 3.5% per step). Long runs of one group (a full cache, a sliding
// window) go to the code-domain task.
constexpr int64_t MIN_GROUP_RUN = 8;  // live tokens per run of one key group, on average

inline bool long_group_runs(const Pools& p, const int32_t* table, const int32_t* valid, int64_t lo, int64_t hi) {
  int64_t live = 0, runs = 0, last = -2;
  for_each_live_slot(table, valid, lo, hi, p.B, [&](int64_t, int64_t page, int64_t j) {
    const int64_t g = std::max<int32_t>(p.k_group[page * p.B + j], 0);
    ++live;
    if (g != last) {
      ++runs;
      last = g;
    }
  });
  return live >= MIN_GROUP_RUN * runs;
}

// The live slots of block-table entries [p_lo, p_hi) in tiles of up to TILE tokens of one key group (a tile
// shares one group's scales): slot_row[i] = page * B + slot and where[i] = its logit column for i < n, gid
// the tile's group; update() folds the tile and sets n = 0. Pages are prefetched PREFETCH_PAGES ahead.
template <int FMT, int64_t D, typename Fn>
inline void for_each_group_tile(const Pools& p, const int32_t* table, const int32_t* valid, int64_t p_lo,
                                int64_t p_hi, int64_t* slot_row, int64_t* where, int64_t& n, int64_t& gid,
                                Fn&& update) {
  const int64_t B = p.B;
  for_each_live_slot_prefetched<FMT>(p, table, valid, p_lo, p_hi, false, [&](int64_t pi, int64_t page, int64_t j) {
    const int64_t s = page * B + j, g = std::max<int32_t>(p.k_group[s], 0);
    if (n && g != gid) update();
    gid = g;
    slot_row[n] = s;
    where[n++] = pi * B + j;
    if (n == TILE) update();
  });
  if (n) update();
}

}  // namespace trtkv
