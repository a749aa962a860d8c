// SpecEE's exit check in one call (see leapfx/kernels/cpu_specee.py and passes/predictor.py).
//
// The check of layer l runs at every active layer of every decoded token, on the critical path
// between two layers: the final RMSNorm of the last row, the logits of the k speculative tokens
// (k gathered LM-head rows, never the [V, H] product), their softmax, the 12 features
// cat([z, p, p - p_prev]) and the 12 -> W -> 1 MLP with its sigmoid. That is ~12k multiply-adds;
// as a chain of torch ops it is ~15 dispatches (~70 us on a 2-core CPU), here one.
//
// The MLP comes packed in one float32 tensor (see pack_mlp in cpu_specee.py):
//   [w1^T (F x W, row f holding the W weights of feature f) | b1 (W) | w2 (W) | b2 (1)]
// with F = 3k features, so that the hidden layer accumulates as W-wide vector updates.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kMaxK = 64;  // speculative tokens at most (k = 4 in the paper)

using leapfx_vec::dot;
using leapfx_vec::rms_norm;

// hidden [B, H] or [B, S, H] (the last position), head_w [V, H] contiguous, cands [k],
// p_prev [B, k] or null, mlp packed (not read when with_mlp is false) -> prob [B] ([0] without
// the MLP), p [B, k], and the full logits N(h) head_w^T [B, V] when some row's prob is above
// `threshold` (the global check, sec. 4.3.3, needs them then; [0, V] otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor> exit_check(
    const at::Tensor& hidden, const at::Tensor& norm_w, const at::Tensor& head_w,
    const at::Tensor& cands, const std::optional<at::Tensor>& p_prev, const at::Tensor& mlp,
    double eps, double offset, bool with_mlp, double threshold) {
  const char* op = "leapfx_cpu::exit_check";
  TORCH_CHECK(hidden.dim() == 2 || hidden.dim() == 3, op,
              ": hidden must be [B, H] or [B, S, H] (its last position is checked), got ",
              hidden.sizes());
  const int64_t B = hidden.size(0), H = hidden.size(-1);
  // The row checked: the last position of each batch row.
  const int64_t last = hidden.dim() == 3 ? (hidden.size(1) - 1) * hidden.stride(1) : 0;
  for (const at::Tensor* t : {&hidden, &norm_w, &head_w, &mlp}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, op,
                ": float32 CPU tensors only, got ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(hidden.stride(-1) == 1, op, ": hidden rows must be contiguous");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == H && norm_w.is_contiguous(), op,
              ": norm weight must be a contiguous [H=", H, "]");
  TORCH_CHECK(head_w.dim() == 2 && head_w.size(1) == H && head_w.is_contiguous(), op,
              ": head weight must be a contiguous [V, H=", H, "]");
  TORCH_CHECK(cands.dim() == 1 && cands.scalar_type() == at::kLong && cands.device().is_cpu(),
              op, ": candidates must be int64 [k] on the CPU");
  const int64_t K = cands.size(0), V = head_w.size(0), F = 3 * K;
  TORCH_CHECK(K >= 1 && K <= kMaxK, op, ": k=", K, " speculative tokens; allowed 1..", kMaxK);
  const int64_t* ids = cands.data_ptr<int64_t>();
  for (int64_t j = 0; j < K; ++j) {
    TORCH_CHECK(ids[j] >= 0 && ids[j] < V, op, ": candidate ", ids[j], " is outside [0, ", V,
                ")");
  }
  const float* prev = nullptr;
  at::Tensor prev_c;
  if (p_prev.has_value() && p_prev->defined()) {
    prev_c = p_prev->contiguous();
    TORCH_CHECK(prev_c.scalar_type() == at::kFloat && prev_c.numel() == B * K, op,
                ": p_prev must be float32 [B=", B, ", k=", K, "]");
    prev = prev_c.data_ptr<float>();
  }
  int64_t W = 0;
  if (with_mlp) {
    TORCH_CHECK(mlp.dim() == 1 && mlp.is_contiguous() && (mlp.numel() - 1) % (F + 2) == 0, op,
                ": the MLP must be packed as [F*W + W + W + 1] for F=", F, " features");
    W = (mlp.numel() - 1) / (F + 2);
  }
  at::Tensor p = at::empty({B, K}, hidden.options());
  at::Tensor prob = at::empty({with_mlp ? B : 0}, hidden.options());
  std::vector<float> normed(B * H), a(W);
  bool fired = false;
  const float* wn = norm_w.data_ptr<float>();
  const float* wh = head_w.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = hidden.data_ptr<float>() + b * hidden.stride(0) + last;
    float* nb = normed.data() + b * H;
    rms_norm(row, wn, H, eps, offset, nb);
    float x[3 * kMaxK];  // [z, p, d]
    float* z = x;
    float* pb = x + K;
    float* d = x + 2 * K;
    float zmax = -INFINITY;
    for (int64_t j = 0; j < K; ++j) {
      z[j] = dot(nb, wh + ids[j] * H, H);
      zmax = std::max(zmax, z[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < K; ++j) total += (pb[j] = std::exp(z[j] - zmax));
    float* pout = p.data_ptr<float>() + b * K;
    for (int64_t j = 0; j < K; ++j) {
      pb[j] /= total;
      pout[j] = pb[j];
      d[j] = prev != nullptr ? pb[j] - prev[b * K + j] : pb[j];
    }
    if (!with_mlp) continue;
    const float* w1t = mlp.data_ptr<float>();
    const float* b1 = w1t + F * W;
    const float* w2 = b1 + W;
    const float b2 = w2[W];
    for (int64_t i = 0; i < W; ++i) a[i] = b1[i];
    for (int64_t f = 0; f < F; ++f) {
      const float xf = x[f];
      const float* wf = w1t + f * W;
      for (int64_t i = 0; i < W; ++i) a[i] += xf * wf[i];
    }
    float out = b2;
    for (int64_t i = 0; i < W; ++i) out += w2[i] * std::max(a[i], 0.0f);
    const float pr = 1.0f / (1.0f + std::exp(-out));
    prob.data_ptr<float>()[b] = pr;
    fired = fired || pr > threshold;
  }
  if (!fired) return {prob, p, at::empty({0, V}, hidden.options())};
  at::Tensor logits = at::empty({B, V}, hidden.options());
  float* lg = logits.data_ptr<float>();
  // Grain: at least ~64k multiply-adds per task, so that a small head stays on one thread
  // (waking a second costs more than its share of a 259 x 192 product).
  const int64_t grain = std::max<int64_t>(256, 65536 / std::max<int64_t>(H, 1));
  at::parallel_for(0, V, grain, [&](int64_t v0, int64_t v1) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t v = v0; v < v1; ++v) lg[b * V + v] = dot(normed.data() + b * H, wh + v * H, H);
    }
  });
  return {prob, p, logits};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  LEAPFX_CPU_OP(m, exit_check, "(Tensor hidden, Tensor norm_w, Tensor head_w, Tensor candidates, "
      "Tensor? p_prev, Tensor mlp, float eps, float offset, bool with_mlp, float threshold) -> "
      "(Tensor, Tensor, Tensor)");
}
