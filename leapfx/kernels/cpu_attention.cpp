// Causal attention for decode and verify calls on a CPU: leapfx_cpu::attention (see
// leapfx/kernels/cpu_attention.py).
//
// q [B, Hq, S, D] at positions [S] over k, v [B, Hkv, L, D] (slot j holds position j; L may be
// the filled prefix of a cache or its whole buffer) -> [B, S, Hq, D]. Query head h reads kv head
// h / (Hq / Hkv) in place (no repeated copies). Query s reads slots 0 .. positions[s] only, so
// slots past it (stale ones left by rejected drafts, unwritten ones) are never read and the cost
// follows the filled length, not the buffer's. Scores, softmax and the weighted sum of a query
// row run in one order fixed by its own position, whatever S and the other rows: a row's result
// does not depend on how many rows came with it.
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
inline vec reduce_keys(vec* a) {
  static const FoldMasks masks;
  int level = 0;
  for (int n = kLanes / 2; n >= 1; n /= 2, ++level)
    for (int i = 0; i < n; ++i)
      a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], masks.lo[level]) +
             __builtin_shuffle(a[2 * i], a[2 * i + 1], masks.hi[level]);
  return a[0];
}

// One query row: scores over keys 0..n-1 (kLanes at a time), softmax, weighted sum of the
// values into o[0..D). ND: whole vectors in D known when compiled (0: D at run time); the rest
// of D (D % kLanes) runs scalar.
template <int ND>
void attend_row(const float* qr, const float* kb, int64_t kl, const float* vb, int64_t vl,
                int64_t n, int64_t D, float sc, float* scores, float* o) {
  const int64_t nd = ND > 0 ? ND : D / kLanes, dv = nd * kLanes;
  const int64_t nv = (n + kLanes - 1) / kLanes * kLanes;
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
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, scores[j]);
  for (int64_t j = n; j < nv; ++j) scores[j] = -INFINITY;  // weight 0
  vec sums = vec{};
  for (int64_t j = 0; j < nv; j += kLanes) {
    const vec w = leapfx_vec::exp(*(vecu*)(scores + j) - m);
    *(vecu*)(scores + j) = w;
    sums += w;
  }
  const float inv = 1.0f / lanes_sum(sums);
  constexpr int kAcc = ND > 0 ? ND : 1;
  if (ND > 0) {  // the accumulators stay in registers
    vec acc[kAcc];
    for (int c = 0; c < kAcc; ++c) acc[c] = vec{};
    float tail[kLanes] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float w = scores[j];
      const float* vr = vb + j * vl;
      for (int c = 0; c < kAcc; ++c) acc[c] += w * *(const vecu*)(vr + c * kLanes);
      for (int64_t d = dv; d < D; ++d) tail[d - dv] += w * vr[d];
    }
    for (int c = 0; c < kAcc; ++c) *(vecu*)(o + c * kLanes) = acc[c] * inv;
    for (int64_t d = dv; d < D; ++d) o[d] = tail[d - dv] * inv;
    return;
  }
  for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = scores[j];
    const float* vr = vb + j * vl;
    for (int64_t d = 0; d < D; ++d) o[d] += w * vr[d];
  }
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
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
  // A decode step's few rows over a short prefix stay on one thread (handing them out costs
  // more than they do); a verify pass, or a long cache, splits its rows (measured on a 2-core
  // Xeon: 5 rows x 4 heads over 128 keys, 18.4 us on one thread, 11.4 on two).
  const int64_t grain = rows * n_max * D >= (1 << 14) ? 1 : rows;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(padded);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = r % S, h = (r / S) % Hq, b = r / (S * Hq), hk = h / group;
      const int64_t f = first ? first[b] : 0, kl = kc.stride(2), vl = vc.stride(2);
      const int64_t n = last[b * last_b + s] + 1 - f;
      const float* qr = qp + b * qc.stride(0) + h * qc.stride(1) + s * qc.stride(2);
      const float* kb = kp + b * kc.stride(0) + hk * kc.stride(1) + f * kl;
      const float* vb = vp + b * vc.stride(0) + hk * vc.stride(1) + f * vl;
      float* o = outp + ((b * S + s) * Hq + h) * D;
      if (n <= 0) {  // a padding query (its column before its row's first): read by nothing
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        continue;
      }
      float* sp = scores.data();
      switch (D / kLanes) {
        case 1: attend_row<1>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        case 2: attend_row<2>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        case 3: attend_row<3>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        case 4: attend_row<4>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        case 6: attend_row<6>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        case 8: attend_row<8>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
        default: attend_row<0>(qr, kb, kl, vb, vl, n, D, sc, sp, o); break;
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
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> Tensor");
  m.def(
      "attention_rows(Tensor q, Tensor k, Tensor v, Tensor first, Tensor last, float scale) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(leapfx_cpu, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_rows", &attention_rows);
}
