// The running choice of lowest_victim's rule (plugins/lowest_victim/reference.py), shared by the kernels that pick
// one victim a row: a NaN beats any number, an older (smaller) position wins a tie, and the row has no victim
// (-1) when nothing was offered or the lowest score is infinite.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace trtkv {

struct LowestPick {
  float best = std::numeric_limits<float>::infinity();
  int64_t at = std::numeric_limits<int64_t>::max();
  bool nan = false;

  inline void offer(float v, int64_t pos) {
    if (std::isnan(v)) {
      if (!nan || pos < at) at = pos;
      nan = true;
    } else if (!nan && (v < best || (v == best && pos < at))) {
      best = v;
      at = pos;
    }
  }

  inline int64_t victim() const {
    return (nan || (at != std::numeric_limits<int64_t>::max() && !std::isinf(best))) ? at : -1;
  }
};

}  // namespace trtkv
