"""The decode slab's attention on the CPU in one pass over each row's keys and one over its values.

A decode step's attention over a slab reads every row's K and V once and does little arithmetic on
them (G query heads per KV head), so on the CPU its speed is the speed it streams them at. aten's
batched matmul streams [G, D] x [D, T] at about half to two thirds of what a plain sum of the same
buffers reaches; this kernel, per (row, KV head), computes q.K for 8 slots at once (AVX2 FMAs, one
horizontal-sum tree, prefetching 2 KB ahead), the softmax's exponentials in cache (aten's vectorized
exp), then p.V with the G outputs in registers (normalized once at the end), and writes the row's
attention mass for the policy (its G queries' probabilities summed). It is slab.py's one-pass formulation (scaled logits, max-subtracted softmax,
probabilities times V) in another order of operations: float32 rounding apart (tests: 1e-5).

The (row, KV head) pairs are split over torch's intra-op threads (at::parallel_for; the module is
built with OpenMP, without which ATen's parallel_for runs serially in an extension).
Built once with torch.utils.cpp_extension (a C++ compiler and ninja; tens of seconds, cached on
disk by the source's, flags' and torch's hash under ~/.cache/localheap/kernels, or
$LOCALHEAP_KERNEL_CACHE) on a background thread, so the first decode steps never wait for it:
until it is loaded, and where it cannot be (no compiler, no AVX2, another dtype or shape), slab.py's
torch code answers. The first call per shape is checked against that code (kernels/dispatch's
CheckedKernel). `LOCALHEAP_SLAB_KERNEL=0` turns it off.

The same module carries the eviction event's two passes over a heap layer on the CPU in float32
(`evicts`): `take_rotated`, the page-out's evicted slots un-rotated to pre-RoPE keys, and `compact`,
the repack's kept slots moved to the front in place and re-rotated. They replace torch's gathers,
the cos/sin table lookups and the rotation's five temporaries with one pass, and give the torch code's
bits (RopeSpec.shift_back's float32 ops in its order: the module is built with -ffp-contract=off,
so no product is fused into an FMA; tests/test_slab_cpu.py compares them bit for bit). And the
event's selection (`select_rows`): per row, std::nth_element under the specification's order (the
higher score first, NaN last, the older slot first in a tie), then the kept and the dropped slots in
one pass: select.select_keep's slots (tests/test_device_selection.py), in a quarter of the time of
torch's kthvalue and masks. And a recall's page bounds (`page_bounds`, heap/scoring's native scorer):
heap/scoring._scores_lanes' float32 sums in their order, 16 pages at a time (tests/test_slab_cpu.py
holds them to recall.score_pages bit for bit). And a page-out's page summaries (`page_summaries`,
heap/pages' native summaries): the min, max and mean of each page's keys in one pass over them, the
float16 widened in registers, where numpy widens the whole event's keys to a float32 copy first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

log = logging.getLogger("localheap.torch")

HEAD_DIMS = (16, 32, 64, 128)   # D: template instances (a multiple of 8: whole AVX2 vectors)
GROUPS = (1, 2, 4, 8)           # G: query heads per KV head

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>
using Vec = at::vec::Vectorized<float>;

// Floats ahead that the K and V loops prefetch (2 KB; within the row's slots): the hardware's own
// prefetch stops at each 4 KB page, and a row's K is thousands of pages. Measured on a Xeon: 2 KB
// streams 4K-slot rows ~1.2x faster than none; farther ahead did no better at 1K slots.
constexpr int64_t PREFETCH = 512;

// eight vectors -> one vector of their eight horizontal sums
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

template <int D>
static inline __m256 dot8(const float* k, const __m256* q) {   // lane sums of k . q over D
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(k), q[0]);
  for (int c = 1; c < D / 8; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * c), q[c], acc);
  return acc;
}

// P[g, t] = Q[g] . K[t] for t < n
template <int D, int G>
static void logits(const float* Q, const float* K, int64_t n, int64_t T, float* P) {
  __m256 q[G][D / 8];
  for (int g = 0; g < G; ++g) for (int c = 0; c < D / 8; ++c) q[g][c] = _mm256_loadu_ps(Q + g * D + 8 * c);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const float* k = K + t * D;
    if ((t + 8) * D + PREFETCH <= n * D)
      for (int c = 0; c < 8 * D; c += 16) _mm_prefetch((const char*)(k + PREFETCH + c), _MM_HINT_T0);
    for (int g = 0; g < G; ++g)
      _mm256_storeu_ps(P + g * T + t,
                       hsum8(dot8<D>(k, q[g]), dot8<D>(k + D, q[g]), dot8<D>(k + 2 * D, q[g]), dot8<D>(k + 3 * D, q[g]),
                             dot8<D>(k + 4 * D, q[g]), dot8<D>(k + 5 * D, q[g]), dot8<D>(k + 6 * D, q[g]),
                             dot8<D>(k + 7 * D, q[g])));
  }
  for (; t < n; ++t)
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += Q[g * D + d] * K[t * D + d];
      P[g * T + t] = s;
    }
}

// O[g] = sum over t < n of P[g, t] V[t]
template <int D, int G>
static void weighted(const float* P, const float* V, int64_t n, int64_t T, float* O) {
  __m256 acc[G][D / 8];
  for (int g = 0; g < G; ++g) for (int c = 0; c < D / 8; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m256 v[D / 8];
    if ((t & 1) == 0 && (t + 2) * D + PREFETCH <= n * D)
      for (int c = 0; c < 2 * D; c += 16) _mm_prefetch((const char*)(V + t * D + PREFETCH + c), _MM_HINT_T0);
    for (int c = 0; c < D / 8; ++c) v[c] = _mm256_loadu_ps(V + t * D + 8 * c);
    for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_set1_ps(P[g * T + t]);
      for (int c = 0; c < D / 8; ++c) acc[g][c] = _mm256_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(O + g * D + 8 * c, acc[g][c]);
}

template <int D, int G>
static void head(const float* Q, const float* K, const float* V, int64_t n, int64_t T, float* P, float* O, float* M) {
  logits<D, G>(Q, K, n, T, P);
  float inv[G];
  for (int g = 0; g < G; ++g) {   // softmax over the row's n slots, in cache: exp and sum in one pass
    float* p = P + g * T;
    const float m = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, p, n);
    Vec acc(0.f);
    int64_t t = 0;
    for (; t + Vec::size() <= n; t += Vec::size()) {
      const Vec e = (Vec::loadu(p + t) - Vec(m)).exp_u20();
      e.store(p + t);
      acc = acc + e;
    }
    float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
    for (; t < n; ++t) {
      p[t] = std::exp(p[t] - m);
      s += p[t];
    }
    inv[g] = 1.f / s;
  }
  weighted<D, G>(P, V, n, T, O);   // over the unnormalized weights: the output scaled once after
  for (int g = 0; g < G; ++g) for (int d = 0; d < D; ++d) O[g * D + d] *= inv[g];
  // the row's attention mass: its G queries' probabilities summed, zero past n
  at::vec::map([i0 = inv[0]](Vec x) { return x * Vec(i0); }, M, P, n);
  for (int g = 1; g < G; ++g)
    at::vec::map2([ig = inv[g]](Vec a, Vec b) { return a + b * Vec(ig); }, M, M, P + g * T, n);
  std::fill(M + n, M + T, 0.f);
}

using HeadFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float*, float*, float*);

template <int D>
static HeadFn pick_g(int64_t G) {
  switch (G) {
    case 1: return head<D, 1>; case 2: return head<D, 2>; case 4: return head<D, 4>; case 8: return head<D, 8>;
  }
  return nullptr;
}

static HeadFn pick(int64_t D, int64_t G) {
  switch (D) {
    case 16: return pick_g<16>(G); case 32: return pick_g<32>(G); case 64: return pick_g<64>(G); case 128: return pick_g<128>(G);
  }
  return nullptr;
}

// q: [B, H, G, D] scaled, contiguous; keys, values: [R >= B, H, capacity >= T, D] (slot rows contiguous);
// resident: int64 [B], row b's slots 0..resident[b]-1. Returns out [B, H, G, D] and mass [B, H, T]: the
// G queries' probabilities summed per slot (zero past a row's slots).
std::vector<torch::Tensor> attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                  torch::Tensor resident, int64_t T) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const HeadFn fn = pick(D, G);
  TORCH_CHECK(fn != nullptr, "no instance for head_dim ", D, ", group ", G);
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && resident.scalar_type() == at::kLong && resident.is_contiguous());
  TORCH_CHECK(keys.size(0) >= B && keys.size(1) == H && keys.size(2) >= T && keys.size(3) == D &&
              keys.stride(3) == 1 && keys.stride(2) == D && values.sizes() == keys.sizes() &&
              values.stride(3) == 1 && values.stride(2) == D && resident.size(0) == B);
  const int64_t* n = resident.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(n[b] >= 1 && n[b] <= T, "resident out of range");
  auto out = torch::empty({B, H, G, D}, q.options());
  auto mass = torch::empty({B, H, T}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float *op = out.data_ptr<float>(), *mp = mass.data_ptr<float>();
  const int64_t kR = keys.stride(0), kH = keys.stride(1), vR = values.stride(0), vH = values.stride(1);
  pybind11::gil_scoped_release no_gil;   // the server's threads run meanwhile, as around aten's ops
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> P(G * T);   // one (row, head)'s probabilities: L1/L2-resident scratch
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      fn(qp + bh * G * D, kp + b * kR + h * kH, vp + b * vR + h * vH, n[b], T, P.data(), op + bh * G * D, mp + bh * T);
    }
  });
  return {out, mass};
}

// -- eviction: the page-out's take and the repack's compaction, each one pass over a layer's slots --
// A key moved from RoPE position p to p - shift, from the cos/sin table row of `shift`: RopeSpec.shift_back's
// float32 ops in its order (lo*c - hi*s, hi*c + lo*s with s = -sin), each product rounded on its own (the
// module is built with -ffp-contract=off), so the same bits as the torch code.
static inline void shift_back_row(const float* src, float* dst, const float* cos, const float* sin, int64_t half) {
  float tmp[1024];   // the source row first: dst may be src (a slot that does not move)
  std::copy(src, src + 2 * half, tmp);
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos[i], s = -sin[i], lo = tmp[i], hi = tmp[half + i];
    dst[i] = lo * c - hi * s;
    dst[half + i] = hi * c + lo * s;
  }
}

static void check_layer(const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& idx,
                        const torch::Tensor& cos, const torch::Tensor& sin, bool rotate) {
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes() &&
              keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat);
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == keys.size(0) && idx.is_contiguous() && idx.scalar_type() == at::kLong);
  TORCH_CHECK(keys.size(2) % 2 == 0 && keys.size(2) <= 1024);
  TORCH_CHECK(!rotate || (cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                          sin.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.size(1) * 2 == keys.size(2)),
              "cos/sin: [shifts, D/2] float32 tables");
  const int64_t* ix = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) TORCH_CHECK(ix[i] >= 0 && ix[i] < keys.size(1), "slot out of range");
}

// keys, values: [H, capacity, D]; slots: [H, e] (ascending). Returns the slots' keys rotated back by their
// slot index (compact positions: a key sits rotated at its slot) and their values, both [H, e, D] float32 copies.
std::vector<torch::Tensor> take_rotated(torch::Tensor keys, torch::Tensor values, torch::Tensor slots,
                                        torch::Tensor cos, torch::Tensor sin) {
  check_layer(keys, values, slots, cos, sin, true);
  const int64_t H = keys.size(0), cap = keys.size(1), D = keys.size(2), e = slots.size(1), half = D / 2;
  TORCH_CHECK(cos.size(0) >= cap, "cos/sin table shorter than the capacity");
  auto k_out = torch::empty({H, e, D}, keys.options()), v_out = torch::empty({H, e, D}, keys.options());
  const float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *ko = k_out.data_ptr<float>(), *vo = v_out.data_ptr<float>();
  const int64_t* ix = slots.data_ptr<int64_t>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      for (int64_t j = 0; j < e; ++j) {
        const int64_t t = ix[h * e + j];
        const float* src = kp + (h * cap + t) * D;
        float* dst = ko + (h * e + j) * D;
        shift_back_row(src, dst, cp + t * half, sp + t * half, half);
        std::copy(vp + (h * cap + t) * D, vp + (h * cap + t + 1) * D, vo + (h * e + j) * D);
      }
  });
  return {k_out, v_out};
}

// In place: slot j of each head takes slot keep[h, j] (ascending, so keep[h, j] >= j: a slot is read before
// anything is written over it), its key rotated back by keep[h, j] - j where `rotate` (compact positions).
void compact(torch::Tensor keys, torch::Tensor values, torch::Tensor keep, torch::Tensor cos, torch::Tensor sin,
             bool rotate) {
  check_layer(keys, values, keep, cos, sin, rotate);
  const int64_t H = keys.size(0), cap = keys.size(1), D = keys.size(2), k = keep.size(1), half = D / 2;
  const int64_t* ix = keep.data_ptr<int64_t>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < k; ++j)
      TORCH_CHECK(ix[h * k + j] >= j && (j == 0 || ix[h * k + j] > ix[h * k + j - 1]), "keep slots not ascending");
  int64_t most = 0;   // the largest shift: keep[h, j] - j grows with j
  for (int64_t h = 0; h < H && k; ++h) most = std::max(most, ix[h * k + k - 1] - (k - 1));
  TORCH_CHECK(!rotate || cos.size(0) > most, "cos/sin table too short");
  float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t t = ix[h * k + j], shift = t - j;
        float* dst = kp + (h * cap + j) * D;
        if (rotate) shift_back_row(kp + (h * cap + t) * D, dst, cp + shift * half, sp + shift * half, half);
        else if (shift) std::copy(kp + (h * cap + t) * D, kp + (h * cap + t + 1) * D, dst);
        if (shift) std::copy(vp + (h * cap + t) * D, vp + (h * cap + t + 1) * D, vp + (h * cap + j) * D);
      }
  });
}

// -- eviction: the selection of each row's kept slots, the numpy specification's stable sort without a sort --
// A strict order on a row's candidate slots: the higher score first, NaN below everything (as the spec's
// stable sort of the negated scores ranks it), ties (and NaN among themselves) the older slot first.
template <typename T>
static inline bool better(const T* s, int64_t a, int64_t b) {
  const T x = s[a], y = s[b];
  const bool nx = std::isnan(x), ny = std::isnan(y);
  if (nx || ny) return nx != ny ? ny : a < b;
  return x != y ? x > y : a < b;
}

template <typename T>
static void select_row(const T* s, int64_t n, int64_t lo, int64_t hi, int64_t n_free, int64_t* keep, int64_t* drop,
                       std::vector<int64_t>& cand, std::vector<uint8_t>& kept) {
  // kept: slots outside the candidates [lo, hi), and the n_free best candidates in that order
  kept.assign(n, 1);
  const int64_t m = hi - lo;
  if (n_free < m) {
    std::fill(kept.begin() + lo, kept.begin() + hi, 0);
    if (n_free > 0) {
      cand.resize(m);
      for (int64_t i = 0; i < m; ++i) cand[i] = lo + i;
      auto cmp = [s](int64_t a, int64_t b) { return better<T>(s, a, b); };
      std::nth_element(cand.begin(), cand.begin() + (n_free - 1), cand.end(), cmp);
      const int64_t pivot = cand[n_free - 1];   // the n_free-th best: it and every better one stay
      for (int64_t t = lo; t < hi; ++t) kept[t] = (t == pivot || better<T>(s, t, pivot)) ? 1 : 0;
    }
  }
  int64_t k = 0, d = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (kept[t]) keep[k++] = t;
    else drop[d++] = t;
  }
}

// scores: [R, n] float32 or float64, contiguous; each row keeps `keep` slots: the first `lo`, those from `hi`
// on, and the best keep - (n - (hi - lo)) of [lo, hi). Returns keep [R, keep] and drop [R, n - keep], int64,
// ascending: the torch rule's (select.select_keep) slots.
std::vector<torch::Tensor> select_rows(torch::Tensor scores, int64_t keep, int64_t lo, int64_t hi) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() &&
              (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble));
  const int64_t R = scores.size(0), n = scores.size(1), n_free = keep - (n - (hi - lo));
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= n && keep <= n && n_free >= 0, "bad keep/lo/hi");
  auto opts = scores.options().dtype(at::kLong);
  auto keep_idx = torch::empty({R, keep}, opts), drop_idx = torch::empty({R, n - keep}, opts);
  int64_t *kp = keep_idx.data_ptr<int64_t>(), *dp = drop_idx.data_ptr<int64_t>();
  const bool f32 = scores.scalar_type() == at::kFloat;
  const float* sf = f32 ? scores.data_ptr<float>() : nullptr;
  const double* sd = f32 ? nullptr : scores.data_ptr<double>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    std::vector<uint8_t> kept;
    for (int64_t r = begin; r < end; ++r) {
      if (f32) select_row<float>(sf + r * n, n, lo, hi, n_free, kp + r * keep, dp + r * (n - keep), cand, kept);
      else select_row<double>(sd + r * n, n, lo, hi, n_free, kp + r * keep, dp + r * (n - keep), cand, kept);
    }
  });
  return {keep_idx, drop_idx};
}

// Page bounds in heap/scoring._scores_lanes' arithmetic. qs: P parts [H, Q, D] float32 (P = 2: q+ and q-,
// or 1: q), ks: P parts [H, D, N] (kmax and kmin, or kmean; below), dims in scoring.lane_order, cut: the 5
// lane offsets. Per output (h, q, n) and part: lane l accumulates 0 + q[d] * k[d, n] over its dims in order (a
// product rounded, then a sum rounded: no FMA), then (l0 + l1) + (l2 + l3); two parts are then added.
// 16 pages at a time in registers (two vectors per lane), the (head, block) pairs over the threads.
// kb: a block's summaries, dim d's 16 pages at kb + d * N
static inline void lane_step(__m256* a, const float* qv, const float* kb, int64_t N, int64_t d) {
  const __m256 w = _mm256_set1_ps(qv[d]);
  const float* kd = kb + d * N;
  a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(w, _mm256_loadu_ps(kd)));
  a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(w, _mm256_loadu_ps(kd + 8)));
}

static inline void lane_block(const float* qv, const float* kb, int64_t N, const int64_t* cut, float* o) {
  __m256 a[4][2];
  for (int l = 0; l < 4; ++l) a[l][0] = a[l][1] = _mm256_setzero_ps();
  const int64_t len = cut[1] - cut[0];
  int64_t j = 0;
  if (cut[2] - cut[1] == len && cut[3] - cut[2] == len && cut[4] - cut[3] == len) {
    // the four lanes' j-th dims together: eight independent sums in flight, each lane's in its order
    for (; j < len; ++j)
      for (int l = 0; l < 4; ++l) lane_step(a[l], qv, kb, N, cut[l] + j);
  }
  for (int l = 0; l < 4; ++l)
    for (int64_t d = cut[l] + j; d < cut[l + 1]; ++d) lane_step(a[l], qv, kb, N, d);
  for (int j = 0; j < 2; ++j)
    _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_add_ps(a[0][j], a[1][j]), _mm256_add_ps(a[2][j], a[3][j])));
}

static inline void lane_tail(const float* qv, const float* kb, int64_t N, const int64_t* cut, int64_t m, float* o) {
  for (int64_t n = 0; n < m; ++n) {
    float a[4];
    for (int l = 0; l < 4; ++l) {
      a[l] = 0.0f;
      for (int64_t d = cut[l]; d < cut[l + 1]; ++d) a[l] = a[l] + qv[d] * kb[d * N + n];
    }
    o[n] = (a[0] + a[1]) + (a[2] + a[3]);
  }
}

// ks: float32 or float16 (the store's own summaries, widened here exactly), each [H, D, N] with the
// pages contiguous (a slice of a longer buffer: any head and dim strides).
torch::Tensor page_bounds(std::vector<torch::Tensor> qs, std::vector<torch::Tensor> ks, std::vector<int64_t> cut) {
  const int64_t P = qs.size();
  TORCH_CHECK((P == 1 || P == 2) && ks.size() == qs.size() && cut.size() == 5);
  const int64_t H = qs[0].size(0), Q = qs[0].size(1), D = qs[0].size(2), N = ks[0].size(2);
  const bool half = ks[0].scalar_type() == at::kHalf;
  const float* q[2];
  const void* k[2];
  int64_t ksh[2], ksd[2];   // head and dim strides of ks, in elements
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(qs[p].dim() == 3 && ks[p].dim() == 3 && qs[p].is_contiguous() && ks[p].stride(2) == 1 &&
                qs[p].scalar_type() == at::kFloat &&
                ks[p].scalar_type() == (half ? at::kHalf : at::kFloat));
    TORCH_CHECK(qs[p].size(0) == H && qs[p].size(1) == Q && qs[p].size(2) == D && ks[p].size(0) == H &&
                ks[p].size(1) == D && ks[p].size(2) == N && cut[4] == D);
    q[p] = qs[p].data_ptr<float>();
    k[p] = ks[p].data_ptr();
    ksh[p] = ks[p].stride(0);
    ksd[p] = ks[p].stride(1);
  }
  auto out = torch::empty({H, Q, N}, qs[0].options());
  float* o = out.data_ptr<float>();
  const int64_t* c = cut.data();
  const int64_t blocks = (N + 15) / 16;
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    float part[16];
    std::vector<float> block(2 * D * 16);   // the block's summaries, [D][16] a part: in L1 for every query
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / blocks, n0 = (i % blocks) * 16, m = std::min<int64_t>(16, N - n0);
      for (int64_t p = 0; p < P; ++p) {
        float* dst = block.data() + p * D * 16;
        if (half) {
          const at::Half* src = static_cast<const at::Half*>(k[p]) + h * ksh[p] + n0;
          for (int64_t d = 0; d < D; ++d) {
            const at::Half* row = src + d * ksd[p];
            if (m == 16) {   // F16C: 8 halves to 8 floats, exactly
              _mm256_storeu_ps(dst + d * 16, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
              _mm256_storeu_ps(dst + d * 16 + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8))));
            } else {
              for (int64_t n = 0; n < m; ++n) dst[d * 16 + n] = static_cast<float>(row[n]);
            }
          }
        } else {
          const float* src = static_cast<const float*>(k[p]) + h * ksh[p] + n0;
          for (int64_t d = 0; d < D; ++d) std::copy(src + d * ksd[p], src + d * ksd[p] + m, dst + d * 16);
        }
      }
      for (int64_t qi = 0; qi < Q; ++qi) {
        float* dst = o + (h * Q + qi) * N + n0;
        for (int64_t p = 0; p < P; ++p) {
          const float* qv = q[p] + (h * Q + qi) * D;
          const float* kb = block.data() + p * D * 16;
          float* w = p == 0 ? dst : part;
          if (m == 16) lane_block(qv, kb, 16, c, w);
          else lane_tail(qv, kb, 16, c, m, w);
        }
        if (P == 2)
          for (int64_t n = 0; n < m; ++n) dst[n] = dst[n] + part[n];
      }
    }
  });
  return out;
}

// A page-out's page summaries: keys [H, M, P, D] (float16, widened exactly with F16C, or float32;
// contiguous) -> kmin, kmax, kmean float32 [M, H, D]: per page and dim the least, the greatest and the
// mean of its P tokens, as heap/pages' numpy reductions give them: numpy's minimum (a < x or a is NaN ?
// a : x, so of equal values the later one, +0 or -0, and a NaN stays), its maximum alike, and the sum
// from +0 in token order, then divided by P. One pass over the keys, no float32 copy of them; serial
// (a page builder's thread per layer, or the engine's between its steps), without the GIL.
static inline __m256 numpy_min(__m256 a, __m256 x) {
  const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(a, x, _CMP_LT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_ps(x, a, keep);
}

static inline __m256 numpy_max(__m256 a, __m256 x) {
  const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(a, x, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_ps(x, a, keep);
}

std::vector<torch::Tensor> page_summaries(torch::Tensor k) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && (k.scalar_type() == at::kHalf || k.scalar_type() == at::kFloat));
  const int64_t H = k.size(0), M = k.size(1), P = k.size(2), D = k.size(3);
  TORCH_CHECK(P >= 1 && D >= 1);
  const bool half = k.scalar_type() == at::kHalf;
  auto opts = k.options().dtype(at::kFloat);
  auto kmin = torch::empty({M, H, D}, opts), kmax = torch::empty({M, H, D}, opts), kmean = torch::empty({M, H, D}, opts);
  float* lo = kmin.data_ptr<float>();
  float* hi = kmax.data_ptr<float>();
  float* sum = kmean.data_ptr<float>();
  const void* keys = k.data_ptr();
  const float count = static_cast<float>(P);
  pybind11::gil_scoped_release no_gil;
  std::vector<float> wide(D);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t m = 0; m < M; ++m) {
      float* a = lo + (m * H + h) * D;
      float* b = hi + (m * H + h) * D;
      float* s = sum + (m * H + h) * D;
      std::fill(s, s + D, 0.0f);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t at = ((h * M + m) * P + p) * D;
        const float* x;
        if (half) {
          const at::Half* row = static_cast<const at::Half*>(keys) + at;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(wide.data() + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
          for (; d < D; ++d) wide[d] = static_cast<float>(row[d]);
          x = wide.data();
        } else {
          x = static_cast<const float*>(keys) + at;
        }
        if (p == 0) {
          std::copy(x, x + D, a);
          std::copy(x, x + D, b);
        }
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
          const __m256 v = _mm256_loadu_ps(x + d);
          if (p > 0) {
            _mm256_storeu_ps(a + d, numpy_min(_mm256_loadu_ps(a + d), v));
            _mm256_storeu_ps(b + d, numpy_max(_mm256_loadu_ps(b + d), v));
          }
          _mm256_storeu_ps(s + d, _mm256_add_ps(_mm256_loadu_ps(s + d), v));
        }
        for (; d < D; ++d) {
          if (p > 0) {
            a[d] = (a[d] < x[d] || std::isnan(a[d])) ? a[d] : x[d];
            b[d] = (b[d] > x[d] || std::isnan(b[d])) ? b[d] : x[d];
          }
          s[d] = s[d] + x[d];
        }
      }
      for (int64_t d = 0; d < D; ++d) s[d] = s[d] / count;
    }
  }
  return {kmin, kmax, kmean};
}
"""

_module = None
_why_not: Optional[str] = None
_building: Optional[threading.Thread] = None
_lock = threading.Lock()


_CAPABILITY = torch.backends.cpu.get_cpu_capability()   # "AVX2", "AVX512"; "DEFAULT" on ARM


def unavailable() -> Optional[str]:
    """None where the kernel can be built here, else why not."""
    if os.environ.get("LOCALHEAP_SLAB_KERNEL", "1") == "0":
        return "LOCALHEAP_SLAB_KERNEL=0"
    if _CAPABILITY not in ("AVX2", "AVX512"):
        return f"CPU capability {_CAPABILITY}, not AVX2"
    return _why_not


NAME = "localheap_slab_cpu"
FUNCTIONS = ["attend", "take_rotated", "compact", "select_rows", "page_bounds", "page_summaries"]
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 600.0   # load(wait=True) gives up (the torch code answers) after this


def build_dir() -> Path:
    """One directory per source, flags and torch: a build never rewrites another's, and a finished
    one is imported without running the build tool (or taking any lock) again."""
    key = hashlib.sha256(repr((_SOURCE, CFLAGS, LDFLAGS, torch.__version__)).encode()).hexdigest()[:16]
    root = os.environ.get("LOCALHEAP_KERNEL_CACHE") or Path.home() / ".cache" / "localheap" / "kernels"
    return Path(root) / f"slab_cpu-{key}"


def _build() -> None:
    global _module, _why_not
    try:
        _module = _built_module(build_dir())
        log.info("slab attention kernel loaded")
    except Exception as e:   # no compiler, a failed build: the torch code answers
        _why_not = f"slab attention kernel not built ({type(e).__name__}: {str(e)[:200]})"
        log.warning(_why_not)


def _built_module(where: Path):
    """Build (once per machine) and import the module. Processes building at once wait on an
    flock, which the kernel releases when its holder dies: a server killed while it builds leaves
    nothing that blocks the next one (torch's own build lock, a file, would stay behind and make
    every later build wait for ever, so it is cleared while this lock is held)."""
    import fcntl

    where.mkdir(parents=True, exist_ok=True)
    done = where / "built"   # written once a build imported cleanly: a half-written library never counts
    with open(where / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            from torch.utils.cpp_extension import load_inline

            (where / "lock").unlink(missing_ok=True)   # torch's baton, left by a build that died
            _ninja_on_path()
            module = load_inline(NAME, cpp_sources=[_SOURCE], functions=FUNCTIONS, build_directory=str(where),
                                 extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS))
            done.write_text(module.__file__)
            return module
    spec = importlib.util.spec_from_file_location(NAME, Path(done.read_text()))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the `ninja` package (the torch extra)
    installs it beside the interpreter, which is not on PATH when the venv is not activated."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load(wait: bool = False):
    """The built module, or None while it builds (on a background thread; `wait`: block until it
    is built) or where it cannot be."""
    global _building
    if unavailable():
        return None
    if _module is not None:
        return _module
    with _lock:
        if _building is None:
            _building = threading.Thread(target=_build, name="localheap-slab-kernel", daemon=True)
            _building.start()
    if wait:
        _building.join(BUILD_TIMEOUT_S)
    return _module


def fits(query_dtype: torch.dtype, keys: torch.Tensor, G: int) -> bool:
    """Whether the kernel has an instance for this slab: float32 on the CPU, D and G instantiated."""
    return (keys.device.type == "cpu" and keys.dtype == torch.float32 == query_dtype
            and keys.shape[-1] in HEAD_DIMS and G in GROUPS)


def evicts(keys: torch.Tensor):
    """The built module where its eviction kernels (take_rotated, compact) take this heap layer's
    buffers ([1, H_kv, capacity, D] float32 on the CPU, whole rows), else None (the torch code)."""
    if not (keys.device.type == "cpu" and keys.dtype == torch.float32 and keys.shape[-1] % 2 == 0
            and keys.shape[-1] <= 1024 and keys[0].is_contiguous()):
        return None
    return load()


def bounds_pages(qs: list, ks: list, cut: tuple):
    """heap/scoring's native page bounds (scoring.use_native): qs numpy float32 [H, Q, D], ks float32
    or float16 [H, D, N] (a slice of the store's buffer will do), one or two parts -> [H, Q, N], or
    None while the module is not built here."""
    module = load()
    if module is None:
        return None
    return module.page_bounds([torch.from_numpy(np.ascontiguousarray(x)) for x in qs],
                              [torch.from_numpy(x if x.strides[2] == x.itemsize else np.ascontiguousarray(x)) for x in ks],
                              list(cut)).numpy()


def summarize_pages(keys: np.ndarray):
    """heap/pages' native page summaries (pages.use_summaries): keys numpy float16 or float32
    [H, M, P, D] -> (kmin, kmax, kmean) float32 [M, H, D], or None while the module is not built here."""
    module = load()
    if module is None:
        return None
    return tuple(t.numpy() for t in module.page_summaries(torch.from_numpy(np.ascontiguousarray(keys))))


def bounds_ready() -> Optional[bool]:
    """For scoring.use_native: the module built (True), building (None; starts the build), or
    not to be had here (False)."""
    if unavailable():
        return False
    return True if load() is not None else None


def selects(scores: torch.Tensor):
    """The built module where its selection (select_rows) takes these scores (float32 or float64 on
    the CPU), else None (the torch code)."""
    if not (scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64)):
        return None
    return load()
