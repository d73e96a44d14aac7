// CPU lowest-scored free column per row (contract: plugins/lowest_victim/reference.py).
//
// The reference takes ten tensor passes over [M, c] (mask, NaN test, row minimum, ties, argmin, gathers);
// here each row is one pass that keeps the best (score, position) so far: a NaN beats any number, an older
// position wins a tie. Comparisons only, so the result is the reference's exactly.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "lowest_pick.h"

namespace trtkv {

at::Tensor lowest_victim_cpu(const at::Tensor& scores_in, const at::Tensor& positions_in, const at::Tensor& blocked_in) {
  TORCH_CHECK(scores_in.dim() == 2, "lowest_victim: scores must be [M, c]");
  TORCH_CHECK(positions_in.sizes() == scores_in.sizes() && blocked_in.sizes() == scores_in.sizes(),
              "lowest_victim: scores, positions and blocked must have one shape");
  const at::Tensor scores = scores_in.to(at::kFloat).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor blocked = blocked_in.to(at::kBool).contiguous();
  const int64_t M = scores.size(0), C = scores.size(1);
  at::Tensor out = at::empty({M}, positions.options());
  const float* s = scores.data_ptr<float>();
  const int64_t* p = positions.data_ptr<int64_t>();
  const bool* b = blocked.data_ptr<bool>();
  int64_t* o = out.data_ptr<int64_t>();
  constexpr int64_t SERIAL_WORK = 1 << 18;  // columns of all rows below which no thread is woken
  const int64_t grain = C > 0 ? std::max<int64_t>(1, SERIAL_WORK / C) : M;
  at::parallel_for(0, M, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* sr = s + r * C;
      const int64_t* pr = p + r * C;
      const bool* br = b + r * C;
      LowestPick pick;
      for (int64_t j = 0; j < C; ++j) {
        const int64_t pos = pr[j];
        if (pos < 0 || br[j]) continue;
        pick.offer(sr[j], pos);
      }
      o[r] = pick.victim();
    }
  });
  return out;
}

}  // namespace trtkv
