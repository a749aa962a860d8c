// Causal attention for decode and verify calls on a CPU: leapfx_cpu::attention (see
// leapfx/kernels/cpu_attention.py).
//
// q [B, Hq, S, D] at positions [S] over k, v [B, Hkv, L, D] (slot j holds position j; L may be
// the filled prefix of a cache or its whole buffer) -> [B, S, Hq, D]. Query head h reads kv head
// h / (Hq / Hkv) in place (no repeated copies). Query s reads slots 0 .. positions[s] only, so
// slots past it (stale ones left by rejected drafts, unwritten ones) are never read and the cost
// follows the filled length, not the buffer's. Scores, softmax and the weighted sum of a query
// row run in one order fixed by its own position, whatever S and the other rows: a row's result
// does not depend on how many rows came with it. A kv head's query rows (its group's heads, a
// verify's rows) go up to four at a time through attend_tile, which loads each key and value
// once for them: as fast as SDPA or faster at every size measured (docs/benchmarks.md).
//
// leapfx_cpu::attention_rows is the same for a batch of ragged rows (left padding, rows at
// their own lengths): query (b, s) reads slots first[b] .. last[b, s]. A row's keys are read
// from its first slot on, in the order an unpadded row's are, so a padded row's result equals
// the same row's alone. A query before its row's first slot (a padding column) reads nothing
// and gets zeros.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

using leapfx_vec::kLanes;
using leapfx_vec::vec;
using leapfx_vec::vecu;
using leapfx_vec::veci;

// Sum of a vector's lanes, halving: the same order for every call.
inline float lanes_sum(vec v) {
  float out[kLanes];
  __builtin_memcpy(out, &v, sizeof(vec));
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) out[i] += out[i + w];
  return out[0];
}

// Key j's lane in reduce_keys' input: j with its log2(kLanes) bits reversed.
constexpr int bit_reversed(int j) {
  int out = 0;
  for (int w = kLanes / 2, b = 1; w >= 1; w /= 2, b *= 2)
    if (j & b) out += w;
  return out;
}

struct BitReversed {
  int at[kLanes];
  constexpr BitReversed() : at() {
    for (int i = 0; i < kLanes; ++i) at[i] = bit_reversed(i);
  }
};
constexpr BitReversed kRevTable;
constexpr const int* kRev = kRevTable.at;

// The shuffles of one halving level (w lanes per half-block): lo takes the first halves of
// each 2w-lane block of two vectors, hi the second halves.
inline veci fold_mask(int w, bool high) {
  veci m;
  for (int i = 0; i < kLanes; ++i) {
    const int t = i / (2 * w), r = i % (2 * w);
    m[i] = (r < w ? 2 * w * t + r : kLanes + 2 * w * t + r - w) + (high ? w : 0);
  }
  return m;
}

struct FoldMasks {
  veci lo[8], hi[8];
  FoldMasks() {
    int level = 0;
    for (int w = kLanes / 2; w >= 1; w /= 2, ++level) {
      lo[level] = fold_mask(w, false);
      hi[level] = fold_mask(w, true);
    }
  }
};

// a[bit_reversed(j)] holds the per-lane partial sums of key j's dot product; returns one vector
// whose lane j is key j's sum. Each level folds every vector in two and packs two vectors'
// halves into one (log2(kLanes) levels of shuffles, no horizontal sums).
__attribute__((always_inline)) inline vec reduce_keys(vec* a) {
  static const FoldMasks masks;
  int level = 0;
  for (int n = kLanes / 2; n >= 1; n /= 2, ++level)
    for (int i = 0; i < n; ++i)
      a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], masks.lo[level]) +
             __builtin_shuffle(a[2 * i], a[2 * i + 1], masks.hi[level]);
  return a[0];
}

// Row scores[0 .. n) -> their softmax's numerators exp(s - max) in place (the padding up to a
// whole vector set to weight 0); returns 1 / their sum.
inline float softmax(float* scores, int64_t n) {
  const int64_t nv = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = n; j < nv; ++j) scores[j] = -INFINITY;  // weight 0
  vec mv = vec{} - INFINITY;  // the max, a vector at a time (any order gives the same max)
  for (int64_t j = 0; j < nv; j += kLanes) {
    const vec x = *(vecu*)(scores + j);
    mv = mv > x ? mv : x;
  }
  float m = mv[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, mv[i]);
  vec sums = vec{};
  for (int64_t j = 0; j < nv; j += kLanes) {
    const vec w = leapfx_vec::exp(*(vecu*)(scores + j) - m);
    *(vecu*)(scores + j) = w;
    sums += w;
  }
  return 1.0f / lanes_sum(sums);
}

// One query row where D is not a whole number of vectors attend_tile is compiled for (D / kLanes
// of 5, 7 or over 8): scores over keys 0..n-1 (kLanes at a time), softmax, weighted sum of the
// values into o[0..D), the vectors of D counted at run time and the rest of D scalar.
void attend_row(const float* qr, const float* kb, int64_t kl, const float* vb, int64_t vl,
                int64_t n, int64_t D, float sc, float* scores, float* o) {
  const int64_t nd = D / kLanes, dv = nd * kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {  // kLanes keys' scores at a time
    vec a[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const int64_t j = j0 + kRev[i];
      vec acc = vec{};
      if (j < n) {
        const float* kr = kb + j * kl;
        for (int64_t c = 0; c < nd; ++c)
          acc += *(const vecu*)(qr + c * kLanes) * *(const vecu*)(kr + c * kLanes);
        if (dv < D) {  // a lane insert per key: only where D has a tail
          float tail = 0.0f;
          for (int64_t d = dv; d < D; ++d) tail += qr[d] * kr[d];
          acc[0] += tail;
        }
      }
      a[i] = acc;
    }
    *(vecu*)(scores + j0) = reduce_keys(a) * sc;
  }
  const float inv = softmax(scores, n);
  for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = scores[j];
    const float* vr = vb + j * vl;
    for (int64_t d = 0; d < D; ++d) o[d] += w * vr[d];
  }
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

// Up to T query rows of one kv head (a GQA group's heads, a verify's rows), D of ND whole
// vectors and a scalar rest: scores over keys 0..n[t]-1 (kLanes at a time), softmax, weighted
// sum of the values, each key and value vector loaded once for the T rows. Each row's scores,
// softmax and sum run in one order fixed by its own keys, so its numbers are the same whatever
// rows share its tile (T = 1 included): a verify's row is the step's, bitwise.
// q[t], n[t], o[t]: row t's query, its key count and its output; scores: T rows of `stride`.
template <int ND, int T>
void attend_tile(const float* const* q, const float* kb, int64_t kl, const float* vb, int64_t vl,
                 const int64_t* n, int64_t D, float sc, float* scores, int64_t stride,
                 float* const* o) {
  constexpr int64_t dv = ND * kLanes;
  int64_t n_max = 0, n_min = n[0];
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t) n_max = std::max(n_max, n[t]), n_min = std::min(n_min, n[t]);
  vec qv[T][ND];
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
    #pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) qv[t][c] = *(const vecu*)(q[t] + c * kLanes);
  for (int64_t j0 = 0; j0 < n_max; j0 += kLanes) {  // kLanes keys' scores at a time
    vec a[T][kLanes];
    #pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      const int64_t j = j0 + kRev[i];
      if (j < n_max) {
        const float* kr = kb + j * kl;
        vec kv[ND];
        #pragma GCC unroll 8
        for (int c = 0; c < ND; ++c) kv[c] = *(const vecu*)(kr + c * kLanes);
        #pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          vec acc = vec{};
          #pragma GCC unroll 8
          for (int c = 0; c < ND; ++c) acc += qv[t][c] * kv[c];
          if (dv < D) {
            float tail = 0.0f;
            for (int64_t d = dv; d < D; ++d) tail += q[t][d] * kr[d];
            acc[0] += tail;
          }
          a[t][i] = acc;
        }
      } else {
        #pragma GCC unroll 8
        for (int t = 0; t < T; ++t) a[t][i] = vec{};
      }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < T; ++t) *(vecu*)(scores + t * stride + j0) = reduce_keys(a[t]) * sc;
  }
  float inv[T];
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t) inv[t] = softmax(scores + t * stride, n[t]);
  vec acc[T][ND];
  float tail[T][kLanes] = {};
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
    #pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) acc[t][c] = vec{};
  for (int64_t j = 0; j < n_min; ++j) {  // every row's keys: one load of each value
    const float* vr = vb + j * vl;
    vec vv[ND];
    #pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) vv[c] = *(const vecu*)(vr + c * kLanes);
    #pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const float w = scores[t * stride + j];
      #pragma GCC unroll 8
      for (int c = 0; c < ND; ++c) acc[t][c] += w * vv[c];
      for (int64_t d = dv; d < D; ++d) tail[t][d - dv] += w * vr[d];
    }
  }
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    for (int64_t j = n_min; j < n[t]; ++j) {  // the keys of the rows that read further
      const float w = scores[t * stride + j];
      const float* vr = vb + j * vl;
      #pragma GCC unroll 8
      for (int c = 0; c < ND; ++c) acc[t][c] += w * *(const vecu*)(vr + c * kLanes);
      for (int64_t d = dv; d < D; ++d) tail[t][d - dv] += w * vr[d];
    }
    #pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) *(vecu*)(o[t] + c * kLanes) = acc[t][c] * inv[t];
    for (int64_t d = dv; d < D; ++d) o[t][d] = tail[t][d - dv] * inv[t];
  }
}

// attend_tile for `count` (1 .. kTile) rows.
constexpr int kTile = 4;  // rows of a kv head that share its key and value loads

template <int ND>
void tile_of(int count, const float* const* q, const float* kb, int64_t kl, const float* vb,
             int64_t vl, const int64_t* n, int64_t D, float sc, float* scores, int64_t stride,
             float* const* o) {
  if constexpr (ND <= 4) {  // four rows' queries and sums fit the registers
    if (count == 4) return attend_tile<ND, 4>(q, kb, kl, vb, vl, n, D, sc, scores, stride, o);
    if (count == 3) return attend_tile<ND, 3>(q, kb, kl, vb, vl, n, D, sc, scores, stride, o);
  }
  if (count == 2) return attend_tile<ND, 2>(q, kb, kl, vb, vl, n, D, sc, scores, stride, o);
  attend_tile<ND, 1>(q, kb, kl, vb, vl, n, D, sc, scores, stride, o);
}

// Checks shared by both ops; returns q, k, v with unit stride in D.
struct Inputs {
  at::Tensor q, k, v;
  int64_t B, Hq, S, D, Hkv, L;
};

Inputs checked(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op,
              ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, op, ": float32 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": q, k, v must be [B, heads, S or L, D]");
  Inputs in;
  in.B = q.size(0), in.Hq = q.size(1), in.S = q.size(2), in.D = q.size(3);
  in.Hkv = k.size(1), in.L = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == in.B && k.size(3) == in.D && in.Hkv > 0 &&
                  in.Hq % in.Hkv == 0, op, ": k/v ", k.sizes(), " do not match q ", q.sizes());
  in.q = q.stride(3) == 1 ? q : q.contiguous();
  in.k = k.stride(3) == 1 ? k : k.contiguous();
  in.v = v.stride(3) == 1 ? v : v.contiguous();
  return in;
}

// Query (b, s) reads slots first[b] .. last[b * last_b + s] (first null: from slot 0; last_b 0:
// one set of query positions for every b).
at::Tensor attend(const Inputs& in, const int64_t* first, const int64_t* last, int64_t last_b,
                  double scale) {
  const int64_t B = in.B, Hq = in.Hq, S = in.S, D = in.D;
  int64_t n_max = 0;
  for (int64_t b = 0; b < (last_b ? B : 1); ++b)
    for (int64_t s = 0; s < S; ++s)
      n_max = std::max(n_max, last[b * last_b + s] + 1 - (first ? first[b] : 0));
  n_max = std::max<int64_t>(n_max, 1);
  at::Tensor out = at::empty({B, S, Hq, D}, in.q.options());
  const at::Tensor &qc = in.q, &kc = in.k, &vc = in.v;
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int64_t group = Hq / in.Hkv, rows = B * Hq * S;
  const int64_t padded = (n_max + kLanes - 1) / kLanes * kLanes;
  const float sc = static_cast<float>(scale);
  const int64_t kl = kc.stride(2), vl = vc.stride(2);
  // The rows of one kv head (its group's query heads, each query's position: group * S, in
  // query-major order so that a tile's rows read about as many keys) go kTile at a time
  // through attend_tile, which loads each key and value once for them.
  const int64_t nd = D / kLanes;
  const bool tiled = nd >= 1 && nd <= 8 && nd != 5 && nd != 7;  // (else attend_row)
  const int64_t tile = !tiled ? 1 : nd <= 4 ? kTile : 2, per_head = group * S;
  const int64_t tiles = (per_head + tile - 1) / tile, tasks = B * in.Hkv * tiles;
  // A decode step's few rows over a short prefix stay on one thread (handing them out costs
  // more than they do); a verify pass, or a long cache, splits its tiles (measured on a 2-core
  // Xeon: 5 rows x 4 heads over 128 keys, 18.4 us on one thread, 11.4 on two).
  const int64_t grain = rows * n_max * D >= (1 << 14) ? 1 : tasks;
  at::parallel_for(0, tasks, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(padded * tile);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (in.Hkv * tiles), hk = (r / tiles) % in.Hkv, u0 = (r % tiles) * tile;
      const int64_t f = first ? first[b] : 0;
      const float* kb = kp + b * kc.stride(0) + hk * kc.stride(1) + f * kl;
      const float* vb = vp + b * vc.stride(0) + hk * vc.stride(1) + f * vl;
      const float* qs[kTile];
      float* os[kTile];
      int64_t ns[kTile];
      int count = 0;
      for (int64_t u = u0; u < std::min(per_head, u0 + tile); ++u) {
        const int64_t s = u / group, h = hk * group + u % group;
        const int64_t n = last[b * last_b + s] + 1 - f;
        float* o = outp + ((b * S + s) * Hq + h) * D;
        if (n <= 0) {  // a padding query (its column before its row's first): read by nothing
          for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
          continue;
        }
        qs[count] = qp + b * qc.stride(0) + h * qc.stride(1) + s * qc.stride(2);
        os[count] = o;
        ns[count++] = n;
      }
      if (count == 0) continue;
      float* sp = scores.data();
      if (!tiled) {
        attend_row(qs[0], kb, kl, vb, vl, ns[0], D, sc, sp, os[0]);
        continue;
      }
      switch (nd) {
        case 1: tile_of<1>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
        case 2: tile_of<2>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
        case 3: tile_of<3>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
        case 4: tile_of<4>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
        case 6: tile_of<6>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
        default: tile_of<8>(count, qs, kb, kl, vb, vl, ns, D, sc, sp, padded, os); break;
      }
    }
  });
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& positions, double scale) {
  const char* op = "leapfx_cpu::attention";
  const Inputs in = checked(op, q, k, v);
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                  positions.numel() == in.S, op, ": positions must be ", in.S,
              " int64 values on the CPU, got ", positions.sizes());
  const at::Tensor pc = positions.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t s = 0; s < in.S; ++s)
    TORCH_CHECK(pos[s] >= 0 && pos[s] < in.L, op, ": position ", pos[s], " outside the ", in.L,
                " key slots");
  return attend(in, nullptr, pos, 0, scale);
}

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& first, const at::Tensor& last, double scale) {
  const char* op = "leapfx_cpu::attention_rows";
  const Inputs in = checked(op, q, k, v);
  TORCH_CHECK(first.device().is_cpu() && first.scalar_type() == at::kLong &&
                  first.dim() == 1 && first.size(0) == in.B, op,
              ": first must be [B] int64 on the CPU, got ", first.sizes());
  TORCH_CHECK(last.device().is_cpu() && last.scalar_type() == at::kLong && last.dim() == 2 &&
                  last.size(0) == in.B && last.size(1) == in.S, op,
              ": last must be [B, S] int64 on the CPU, got ", last.sizes());
  const at::Tensor fc = first.contiguous(), lc = last.contiguous();
  const int64_t *f = fc.data_ptr<int64_t>(), *l = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t s = 0; s < in.S; ++s)
      TORCH_CHECK(f[b] >= 0 && f[b] <= in.L && l[b * in.S + s] < in.L, op, ": row ", b,
                  " query ", s, " reads slots ", f[b], "..", l[b * in.S + s], ", outside 0..",
                  in.L - 1);
  return attend(in, f, l, in.S, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  LEAPFX_CPU_OP(m, attention, "(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> "
      "Tensor");
  LEAPFX_CPU_OP(m, attention_rows, "(Tensor q, Tensor k, Tensor v, Tensor first, Tensor last, "
      "float scale) -> Tensor");
}
