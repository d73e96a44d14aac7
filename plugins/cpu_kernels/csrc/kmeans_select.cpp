// CPU k-means token selection (contract: plugins/kmeans_select/reference.py, kmeans_core).
//
// One task = one job (a segment of one request in one layer). The reference materializes a
// [J, M, K, F] difference tensor per Lloyd step, which is memory-bound and slow on CPU; here a job's
// rows and centroids stay in cache and each distance is a vectorized sum of squared differences (the
// reference's formula, not the |x|^2 - 2xc + |c|^2 expansion). Same algorithm step for step: evenly
// spaced init, Lloyd iterations that stop when assignments repeat, empty clusters keep their centroid,
// one representative per cluster (the member nearest its centroid, first on ties), top-up with the
// rows farthest from their centroid (stable), ascending output padded with -1. Summation order
// differs from the reference's GEMM, so an assignment may differ only on an fp32 near-tie; the ranking
// of members by distance to their centroid is in fp64, as in the reference.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

namespace trtkv {
namespace {

constexpr float INF = std::numeric_limits<float>::infinity();
constexpr int64_t SERIAL_WORK = 1 << 18;  // m*K*F of all jobs below which no thread is woken

inline float sqdist(const float* x, const float* c, int64_t F) {
  float d = 0.0f;
#pragma omp simd reduction(+ : d)
  for (int64_t f = 0; f < F; ++f) {
    const float t = x[f] - c[f];
    d += t * t;
  }
  return d;
}

inline double sqdist64(const float* x, const float* c, int64_t F) {
  double d = 0.0;
#pragma omp simd reduction(+ : d)
  for (int64_t f = 0; f < F; ++f) {
    const double t = (double)x[f] - (double)c[f];
    d += t * t;
  }
  return d;
}

// Four centroids per pass over a row: the row is loaded once for four distances.
inline void sqdist4(const float* x, const float* c, int64_t F, float* d) {
  const float *c0 = c, *c1 = c + F, *c2 = c + 2 * F, *c3 = c + 3 * F;
  float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
  for (int64_t f = 0; f < F; ++f) {
    const float xf = x[f];
    const float t0 = xf - c0[f], t1 = xf - c1[f], t2 = xf - c2[f], t3 = xf - c3[f];
    d0 += t0 * t0;
    d1 += t1 * t1;
    d2 += t2 * t2;
    d3 += t3 * t3;
  }
  d[0] = d0, d[1] = d1, d[2] = d2, d[3] = d3;
}

// Nearest of the K centroids per row (strict <: the lowest index wins ties). True if any row moved.
bool assign(const float* x, const float* c, int64_t m, int64_t K, int64_t F, int64_t* a) {
  bool changed = false;
  float d[4];
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x + i * F;
    float best = INF;
    int64_t arg = 0;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      sqdist4(xi, c + k * F, F, d);
      for (int e = 0; e < 4; ++e)
        if (d[e] < best) best = d[e], arg = k + e;
    }
    for (; k < K; ++k) {
      const float dk = sqdist(xi, c + k * F, F);
      if (dk < best) best = dk, arg = k;
    }
    changed |= a[i] != arg;
    a[i] = arg;
  }
  return changed;
}

void select_job(const float* x, int64_t m, int64_t K, int64_t F, int64_t iters, int64_t* out) {
  if (m <= K) {  // keep every row
    for (int64_t i = 0; i < m; ++i) out[i] = i;
    return;
  }
  if (K == 0) return;
  std::vector<float> c(K * F), sums(K * F);
  std::vector<int64_t> a(m, -1), n(K);
  for (int64_t k = 0; k < K; ++k) std::copy_n(x + (k * m / K) * F, F, c.begin() + k * F);
  assign(x, c.data(), m, K, F, a.data());
  for (int64_t it = 0; it < iters; ++it) {
    std::fill(sums.begin(), sums.end(), 0.0f);
    std::fill(n.begin(), n.end(), 0);
    for (int64_t i = 0; i < m; ++i) {
      float* s = sums.data() + a[i] * F;
      const float* xi = x + i * F;
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) s[f] += xi[f];
      ++n[a[i]];
    }
    for (int64_t k = 0; k < K; ++k) {
      if (n[k] == 0) continue;  // an empty cluster keeps its centroid
      const float nk = (float)n[k];
      for (int64_t f = 0; f < F; ++f) c[k * F + f] = sums[k * F + f] / nk;
    }
    if (!assign(x, c.data(), m, K, F, a.data())) break;
  }

  std::vector<double> dmin(m);  // fp64, as the reference: see its note on 2-member clusters
  for (int64_t i = 0; i < m; ++i) dmin[i] = sqdist64(x + i * F, c.data() + a[i] * F, F);
  std::vector<int64_t> rep(K, -1);
  for (int64_t i = 0; i < m; ++i) {
    int64_t& r = rep[a[i]];
    if (r < 0 || dmin[i] < dmin[r]) r = i;
  }
  std::vector<char> keep(m, 0);
  int64_t kept = 0;
  for (int64_t k = 0; k < K; ++k)
    if (rep[k] >= 0) keep[rep[k]] = 1, ++kept;
  if (kept < K) {  // top up with the farthest unselected rows, lower index first on ties
    std::vector<int64_t> rest;
    for (int64_t i = 0; i < m; ++i)
      if (!keep[i]) rest.push_back(i);
    std::stable_sort(rest.begin(), rest.end(), [&](int64_t p, int64_t q) { return dmin[p] > dmin[q]; });
    for (int64_t r = 0; r < K - kept && r < (int64_t)rest.size(); ++r) keep[rest[r]] = 1;
  }
  int64_t w = 0;
  for (int64_t i = 0; i < m; ++i)
    if (keep[i]) out[w++] = i;
}

}  // namespace

at::Tensor kmeans_select_cpu(const at::Tensor& keys_in, const at::Tensor& counts_in, const at::Tensor& k_keep_in,
                             int64_t iters) {
  TORCH_CHECK(keys_in.dim() == 3, "kmeans_select: keys must be [J, M, F]");
  const at::Tensor keys = keys_in.to(at::kFloat).contiguous();
  const int64_t J = keys.size(0), M = keys.size(1), F = keys.size(2);
  const at::Tensor counts = counts_in.to(at::kLong).clamp(0, M).contiguous();
  const at::Tensor k_keep = k_keep_in.to(at::kLong).clamp_min(0).contiguous();
  const int64_t Kmax = J ? k_keep.max().item<int64_t>() : 0;
  at::Tensor out = at::full({J, Kmax}, -1, keys.options().dtype(at::kLong));
  const float* x = keys.data_ptr<float>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  const int64_t* kk = k_keep.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t j = 0; j < J; ++j) work += cnt[j] * std::min(cnt[j], kk[j]) * F;
  const int64_t grain = work < SERIAL_WORK ? J + 1 : 1;
  at::parallel_for(0, J, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) select_job(x + j * M * F, cnt[j], kk[j], F, std::max<int64_t>(iters, 0), o + j * Kmax);
  });
  return out;
}

}  // namespace trtkv
