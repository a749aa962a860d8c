// M2R2's ARLA exit gate in one call (see leapfx/kernels/cpu_m2r2.py and passes/kernel_gate.py).
//
// A gate of m2r2_exit runs once per decoded token per gate, between two slow segments: the fast
// stream of one row through the interval's accelerated layers (eq. 2), the ARLA router over the
// interval's states (sec. 2.3.1) and the final norm + LM head on the gate's state. On the
// reference model (hidden 192, 4 fast layers a gate) that is ~0.5M multiply-adds but ~90 torch
// dispatches: ~0.5 ms on a 2-core CPU, about what the four slow layers it lets a token skip
// cost. Here it is one call.
//
// Per accelerated layer l (weights merged: LoRA and the attention gate folded in), with p the
// fast state of the row at position t:
//   x = rms(p) * (off + ln_in);  [q | k | v] = W_qkv x + b_qkv;  rotary on q and k (HF's
//   rotate_half form, cos/sin of t from inv_freq);  per query head h: softmax over the slow
//   cache's keys 0..n_l - 1 of its KV head and the row's own key, times the values;
//   p += W_o o + b_o;  p += up(silu(down(rms(p) * (off + ln_post)))).
// Router: s_i = rms(state_i) * (off + final) for the reset and each layer's output; one-head
// attention in the latent space with the query from the last state; sigmoid(out(.)).
// Logits: head(s_last) (+ bias).
//
// m2r2_predict (the expert-offload runtime's m2r2 prefetch, passes/offload.py) runs the same
// fast stream from a decode step's embedding before any slow layer (q/k norms and clip_qkv
// included: OLMoE), and ranks the experts of the MoE layers it predicts with their routers.

#include <torch/library.h>
#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using leapfx_vec::dot;
using leapfx_vec::rms_norm;
using leapfx_vec::v8;
using leapfx_vec::v8u;

// y[N] = W [N, K] x [K] + b [N]. Four rows at a time: four independent accumulators hide the
// latency of the multiply-adds (one row's chain of K/8 dependent updates would stall on each);
// each row's sum is formed exactly as dot() forms it.
void matvec(const float* w, int64_t N, int64_t K, const float* x, const float* b, float* y) {
  int64_t n = 0;
  if (K % 8 == 0) {
    for (; n + 4 <= N; n += 4) {
      const float* r0 = w + n * K;
      const float* r1 = r0 + K;
      const float* r2 = r1 + K;
      const float* r3 = r2 + K;
      v8 a0 = {0, 0, 0, 0, 0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < K; i += 8) {
        const v8 xv = *(const v8u*)(x + i);
        a0 += *(const v8u*)(r0 + i) * xv;
        a1 += *(const v8u*)(r1 + i) * xv;
        a2 += *(const v8u*)(r2 + i) * xv;
        a3 += *(const v8u*)(r3 + i) * xv;
      }
      const v8* acc[4] = {&a0, &a1, &a2, &a3};
      for (int j = 0; j < 4; ++j) {
        const v8& a = *acc[j];
        const float sum = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        y[n + j] = sum + b[n + j];
      }
    }
  }
  for (; n < N; ++n) y[n] = dot(w + n * K, x, K) + b[n];
}

// In place: softmax of s[0..n) (max subtracted).
void softmax(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - mx));
  for (int64_t i = 0; i < n; ++i) s[i] /= total;
}

// Sizes of the packed weights (pack_gate in cpu_m2r2.py), read from `dims`.
struct Dims {
  int64_t L, H, D, hq, hk, r, dl, V;
  int64_t qkv() const { return (hq + 2 * hk) * D; }
  int64_t layer() const {  // w_qkv, b_qkv, w_o, b_o, down, up, ln_in, ln_post
    return qkv() * H + qkv() + H * hq * D + H + r * H + H * r + 2 * H;
  }
  int64_t router() const {  // q/k/v weights and biases, out weight and bias; none when dl = 0
    return dl > 0 ? 3 * (dl * H + dl) + dl + 1 : 0;
  }
  int64_t total() const {  // layers, final norm, router, head (weight, bias), rope's inv_freq
    return L * layer() + H + router() + V * H + V + D / 2;
  }
};

// The q/k RMSNorms of the fast layers and clip_qkv, applied to the projections before rotary
// (m2r2_predict only; the other ops leave such models to the torch path). Each norm scales
// groups of gq (gk) consecutive channels of q (k): OLMoE's full width (gq = h_q D, all of the
// layer's kept query channels at once, before the head split), or per head (gq = D, Qwen3).
struct QkNorm {
  const float* weights;  // per layer: q's [h_q D], k's [h_kv D] (offsets folded in)
  int64_t gq, gk;        // group widths; 0: no norms
  const double* eps;     // per layer: q's, k's
  float clip;            // then q, k and v clamped to [-clip, clip]; inf: none
};

// In place on qkv [(h_q + 2 h_kv) D] of layer l: OLMoE's order (norms, then the clamp).
void qk_norm(const QkNorm& z, int64_t l, int64_t hq, int64_t hk, int64_t D, float* qkv) {
  if (z.gq > 0) {
    const float* wq = z.weights + l * (hq + hk) * D;
    const float* wk = wq + hq * D;
    for (int64_t i = 0; i < hq * D; i += z.gq) {  // rms_norm reads a group before writing it
      leapfx_vec::rms_norm(qkv + i, wq + i, z.gq, z.eps[2 * l], 0.0, qkv + i);
    }
    for (int64_t i = 0; i < hk * D; i += z.gk) {
      leapfx_vec::rms_norm(qkv + hq * D + i, wk + i, z.gk, z.eps[2 * l + 1], 0.0,
                           qkv + hq * D + i);
    }
  }
  if (std::isfinite(z.clip)) {
    for (int64_t i = 0; i < (hq + 2 * hk) * D; ++i) qkv[i] = std::clamp(qkv[i], -z.clip, z.clip);
  }
}

// The fast stream of one row (the part the ops share). hidden [1, 1, H] (the reset state, or a
// draft's embedding) at position t (position_ids' last element), weights (pack_gate), dims
// [L, H, D, h_q, h_kv, r, d_latent, V, kv_heads..., q_to_kv...], params [rope_scale, scaling,
// eps (2 per layer + the final norm's), offsets (same)], cache (per layer the slow cache's keys
// and values [B, h_kv_all, max_len, D]), lengths (per layer the slow keys the row reads),
// earlier: m fast keys/values of a drafting round's earlier drafts per layer ([L, 2, m, h_kv,
// D], read after the slow keys), kv_out (when not null): the row's own keys/values [L, 2,
// h_kv, D], qk (when not null): q/k norms and clip_qkv, extra: floats `weights` holds after
// pack_gate's part (m2r2_predict's). Fills states [(L + 1) H]: the reset, then every layer's
// output.
Dims fast_stream(const char* op, const at::Tensor& hidden, const at::Tensor& position_ids,
                 const at::Tensor& weights, at::IntArrayRef dims, at::ArrayRef<double> params,
                 at::TensorList cache, at::IntArrayRef lengths, const float* earlier, int64_t m,
                 float* kv_out, std::vector<float>& states, const QkNorm* qk = nullptr,
                 int64_t extra = 0) {
  TORCH_CHECK(dims.size() >= 8, op, ": dims must start [L, H, D, h_q, h_kv, r, d, V]");
  const Dims z{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7]};
  const int64_t L = z.L, H = z.H, D = z.D, hq = z.hq, hk = z.hk, half = D / 2;
  TORCH_CHECK(L >= 1 && D % 2 == 0 && static_cast<int64_t>(dims.size()) == 8 + hk + hq, op,
              ": dims must hold h_kv cache heads and h_q query-head groups");
  const int64_t* kv_heads = dims.data() + 8;
  const int64_t* q_to_kv = kv_heads + hk;
  for (const at::Tensor* t : {&hidden, &weights}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                op, ": float32 contiguous CPU tensors only, got ", t->scalar_type());
  }
  TORCH_CHECK(hidden.numel() == H, op, ": one row of H=", H, " only, got ", hidden.sizes());
  TORCH_CHECK(weights.numel() == z.total() + extra, op, ": weights hold ", weights.numel(),
              " floats, dims say ", z.total() + extra);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == 2 + 2 * (2 * L + 1), op,
              ": params must be [rope_scale, scaling, eps (2L + 1), offsets (2L + 1)]");
  TORCH_CHECK(static_cast<int64_t>(cache.size()) == 2 * L && static_cast<int64_t>(
                  lengths.size()) == L, op, ": keys and values and a length per layer");
  TORCH_CHECK(position_ids.is_contiguous() && position_ids.scalar_type() == at::kLong &&
                  position_ids.numel() >= 1, op, ": position_ids must be int64");
  const int64_t t = position_ids.data_ptr<int64_t>()[position_ids.numel() - 1];
  const double* eps = params.data() + 2;
  const double* offsets = eps + 2 * L + 1;
  const float scale = static_cast<float>(params[1]);

  const float* wp = weights.data_ptr<float>();
  const float* inv = wp + z.total() - half;
  // cos/sin of position t: HF's default rotary (cat(freqs, freqs), times the scale)
  std::vector<float> cos(D), sin(D);
  for (int64_t i = 0; i < half; ++i) {
    const float f = static_cast<float>(t) * inv[i];
    cos[i] = cos[i + half] = std::cos(f) * static_cast<float>(params[0]);
    sin[i] = sin[i + half] = std::sin(f) * static_cast<float>(params[0]);
  }
  states.assign((L + 1) * H, 0.0f);
  std::copy(hidden.data_ptr<float>(), hidden.data_ptr<float>() + H, states.begin());
  std::vector<float> x(H), qkv(z.qkv()), o(hq * D), y(H), a(z.r), scores;
  const int64_t step = hk * D;  // one key (or value) of every kept KV head
  for (int64_t l = 0; l < L; ++l) {
    const float* w_qkv = wp + l * z.layer();
    const float* b_qkv = w_qkv + z.qkv() * H;
    const float* w_o = b_qkv + z.qkv();
    const float* b_o = w_o + H * hq * D;
    const float* down = b_o + H;
    const float* up = down + z.r * H;
    const float* ln_in = up + H * z.r;
    const float* ln_post = ln_in + H;
    const at::Tensor &keys = cache[2 * l], &values = cache[2 * l + 1];
    TORCH_CHECK(keys.dim() == 4 && keys.size(3) == D && keys.sizes() == values.sizes() &&
                    keys.stride(3) == 1 && keys.strides() == values.strides() &&
                    keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat &&
                    keys.device().is_cpu() && values.device().is_cpu(),
                op, ": layer ", l, ": keys/values must be float32 [B, h_kv, L, D=", D, "]");
    const int64_t n = lengths[l];
    TORCH_CHECK(n >= 0 && n <= keys.size(2), op, ": layer ", l, ": length ", n,
                " outside the cache");
    const float* p = states.data() + l * H;
    float* pn = states.data() + (l + 1) * H;
    rms_norm(p, ln_in, H, eps[2 * l], offsets[2 * l], x.data());
    matvec(w_qkv, z.qkv(), H, x.data(), b_qkv, qkv.data());
    if (qk != nullptr) qk_norm(*qk, l, hq, hk, D, qkv.data());
    for (int64_t h = 0; h < hq + hk; ++h) {  // rotary on the q and k heads
      float* r = qkv.data() + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float u = r[i], v = r[i + half];
        r[i] = u * cos[i] - v * sin[i];
        r[i + half] = v * cos[i + half] + u * sin[i + half];
      }
    }
    if (kv_out != nullptr) {  // the row's own keys and values (rotated keys, as the cache's)
      std::copy(qkv.data() + hq * D, qkv.data() + (hq + 2 * hk) * D, kv_out + l * 2 * step);
    }
    const float* kbase = keys.data_ptr<float>();
    const float* vbase = values.data_ptr<float>();
    const float* ek = earlier == nullptr ? nullptr : earlier + l * 2 * m * step;
    const float* ev = ek == nullptr ? nullptr : ek + m * step;
    const int64_t sh = keys.stride(1), ss = keys.stride(2);
    scores.resize(n + m + 1);
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = q_to_kv[h];
      TORCH_CHECK(g >= 0 && g < hk, op, ": q_to_kv out of range");
      const int64_t c = kv_heads[g];
      TORCH_CHECK(c >= 0 && c < keys.size(1), op, ": kv head ", c, " outside the cache");
      const float* q = qkv.data() + h * D;
      const float* kown = qkv.data() + (hq + g) * D;
      const float* vown = qkv.data() + (hq + hk + g) * D;
      const float* kh = kbase + c * sh;
      const float* vh = vbase + c * sh;
      for (int64_t s = 0; s < n; ++s) scores[s] = dot(q, kh + s * ss, D) * scale;
      for (int64_t s = 0; s < m; ++s) scores[n + s] = dot(q, ek + s * step + g * D, D) * scale;
      scores[n + m] = dot(q, kown, D) * scale;
      softmax(scores.data(), n + m + 1);
      float* oh = o.data() + h * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = scores[n + m] * vown[d];
      for (int64_t s = 0; s < n; ++s) {
        const float ws = scores[s];
        const float* vs = vh + s * ss;
        for (int64_t d = 0; d < D; ++d) oh[d] += ws * vs[d];
      }
      for (int64_t s = 0; s < m; ++s) {
        const float ws = scores[n + s];
        const float* vs = ev + s * step + g * D;
        for (int64_t d = 0; d < D; ++d) oh[d] += ws * vs[d];
      }
    }
    matvec(w_o, H, hq * D, o.data(), b_o, y.data());
    for (int64_t i = 0; i < H; ++i) pn[i] = p[i] + y[i];
    rms_norm(pn, ln_post, H, eps[2 * l + 1], offsets[2 * l + 1], x.data());
    for (int64_t i = 0; i < z.r; ++i) {
      const float v = dot(down + i * H, x.data(), H);
      a[i] = v / (1.0f + std::exp(-v));  // SiLU
    }
    for (int64_t i = 0; i < H; ++i) pn[i] += dot(up + i * z.r, a.data(), z.r);
  }
  return z;
}

// The final norm of the last state into `last`, then the LM head: logits [1, 1, V].
at::Tensor head_logits(const Dims& z, const at::Tensor& weights, at::ArrayRef<double> params,
                       const float* state, float* last) {
  const float* fin = weights.data_ptr<float>() + z.L * z.layer();
  const double* eps = params.data() + 2;
  const double* offsets = eps + 2 * z.L + 1;
  rms_norm(state, fin, z.H, eps[2 * z.L], offsets[2 * z.L], last);
  const float* head = fin + z.H + z.router();
  at::Tensor logits = at::empty({1, 1, z.V}, weights.options());
  matvec(head, z.V, z.H, last, head + z.V * z.H, logits.data_ptr<float>());
  return logits;
}

// An exit gate: the fast stream from the reset state, the ARLA router over its states, the
// head on the gate's state -> (score [1, 1], logits [1, 1, V]).
std::tuple<at::Tensor, at::Tensor> m2r2_gate(const at::Tensor& hidden,
                                             const at::Tensor& position_ids,
                                             const at::Tensor& weights, at::IntArrayRef dims,
                                             at::ArrayRef<double> params, at::TensorList cache,
                                             at::IntArrayRef lengths) {
  std::vector<float> states;
  const Dims z = fast_stream("leapfx_cpu::m2r2_gate", hidden, position_ids, weights, dims,
                             params, cache, lengths, nullptr, 0, nullptr, states);
  TORCH_CHECK(z.dl > 0, "leapfx_cpu::m2r2_gate: the router's latent size must be > 0");
  const int64_t L = z.L, H = z.H, dl = z.dl;
  const double* eps = params.data() + 2;
  const double* offsets = eps + 2 * L + 1;
  // The router: q from the last state's final norm, keys/values from every state's, one head
  // in the latent space. Linear algebra instead of L + 1 key and value products: the score of
  // state s is (W_k^T q) . x_s + q . b_k, and sum_s w_s (W_v x_s + b_v) = W_v (sum_s w_s x_s)
  // + b_v (the weights sum to 1): three latent products a gate instead of 2 (L + 1) + 1.
  const float* fin = weights.data_ptr<float>() + L * z.layer();
  const float *q_w = fin + H, *q_b = q_w + dl * H, *k_w = q_b + dl, *k_b = k_w + dl * H;
  const float *v_w = k_b + dl, *v_b = v_w + dl * H, *out_w = v_b + dl, *out_b = out_w + dl;
  std::vector<float> normed((L + 1) * H), ql(dl), u(H, 0.0f), xbar(H, 0.0f), al(dl), att(L + 1);
  for (int64_t s = 0; s < L; ++s) {
    rms_norm(states.data() + s * H, fin, H, eps[2 * L], offsets[2 * L], normed.data() + s * H);
  }
  float* last = normed.data() + L * H;
  at::Tensor logits = head_logits(z, weights, params, states.data() + L * H, last);
  matvec(q_w, dl, H, last, q_b, ql.data());
  for (int64_t i = 0; i < dl; ++i) {  // u = W_k^T q
    const float qi = ql[i];
    const float* row = k_w + i * H;
    for (int64_t j = 0; j < H; ++j) u[j] += qi * row[j];
  }
  const float qb = dot(ql.data(), k_b, dl);
  const float latent_scale = 1.0f / std::sqrt(static_cast<float>(dl));
  for (int64_t s = 0; s <= L; ++s) {
    att[s] = (dot(u.data(), normed.data() + s * H, H) + qb) * latent_scale;
  }
  softmax(att.data(), L + 1);
  for (int64_t s = 0; s <= L; ++s) {
    const float ws = att[s];
    const float* xs = normed.data() + s * H;
    for (int64_t j = 0; j < H; ++j) xbar[j] += ws * xs[j];
  }
  matvec(v_w, dl, H, xbar.data(), v_b, al.data());
  const float zs = dot(out_w, al.data(), dl) + out_b[0];
  at::Tensor score = at::empty({1, 1}, hidden.options());
  score.data_ptr<float>()[0] = 1.0f / (1.0f + std::exp(-zs));
  return {score, logits};
}

// A draft of M2R2's self-speculation: the fast stream from the token's embedding, reading the
// slow keys < n and the round's earlier drafts' fast keys `earlier` [L, 2, m, h_kv, D], then
// the head -> (logits [1, 1, V], hidden [1, 1, H] (the gate's state), kv [L, 2, h_kv, D]: this
// draft's own keys and values, for the next drafts of the round).
std::tuple<at::Tensor, at::Tensor, at::Tensor> m2r2_draft(
    const at::Tensor& hidden, const at::Tensor& position_ids, const at::Tensor& weights,
    at::IntArrayRef dims, at::ArrayRef<double> params, at::TensorList cache,
    at::IntArrayRef lengths, const at::Tensor& earlier) {
  const char* op = "leapfx_cpu::m2r2_draft";
  TORCH_CHECK(dims.size() >= 8, op, ": dims must start [L, H, D, h_q, h_kv, r, d, V]");
  const int64_t L = dims[0], D = dims[2], hk = dims[4];
  TORCH_CHECK(earlier.device().is_cpu() && earlier.scalar_type() == at::kFloat &&
                  earlier.is_contiguous() && earlier.dim() == 5 && earlier.size(0) == L &&
                  earlier.size(1) == 2 && earlier.size(3) == hk && earlier.size(4) == D,
              op, ": earlier must be a contiguous float32 [L, 2, m, h_kv, D]");
  at::Tensor kv = at::empty({L, 2, hk, D}, hidden.options());
  std::vector<float> states;
  const Dims z = fast_stream(op, hidden, position_ids, weights, dims, params, cache, lengths,
                             earlier.data_ptr<float>(), earlier.size(2), kv.data_ptr<float>(),
                             states);
  at::Tensor out = at::empty({1, 1, z.H}, hidden.options());
  std::copy(states.data() + L * z.H, states.data() + (L + 1) * z.H, out.data_ptr<float>());
  std::vector<float> last(z.H);
  at::Tensor logits = head_logits(z, weights, params, out.data_ptr<float>(), last.data());
  return {logits, out, kv};
}

// The m2r2 prefetch policy's prediction for one decode step (offload, passes/offload.py): the
// fast stream from the token's embedding p^0 = h^0 through fast layers 0..L-1, run before the
// slow pass (fast layer i reads slow layer i's keys 0..lengths[i] - 1, all of positions < t,
// plus the row's own), then per target j the experts of MoE layer 2i + 2 or 2i + 3 (i =
// sources[j]): scores_j = R_j p^{i+1} with R_j [E, H] the layer's router weight times its
// post-attention RMSNorm's weight (for one row the ranking of softmax(router(norm(p)))), and
// their top_k. weights: pack_gate's layout with no router and no head (d = V = 0; the final
// norm's slot unused), then, when qk[0] > 0, the q/k norm weights per layer (QkNorm), then
// the R_j [T, E, H]. qk: [gq, gk] (QkNorm's groups; 0, 0: none), qk_params: [clip (inf:
// none), then per layer the q and k norms' eps]. -> (ids [T, top_k] int64, most probable
// first; scores [T, E]; states [L + 1, H]: p^0, then every fast layer's output). Order: NaN
// first (as torch.topk), then by score, exact ties to the lower expert id (torch.topk's order
// among ties is unspecified: on CPU it changes with E), so only an exact tie of scores can
// pick other experts than torch.topk does on the same scores.
std::tuple<at::Tensor, at::Tensor, at::Tensor> m2r2_predict(
    const at::Tensor& hidden, const at::Tensor& position_ids, const at::Tensor& weights,
    at::IntArrayRef dims, at::ArrayRef<double> params, at::TensorList cache,
    at::IntArrayRef lengths, at::IntArrayRef qk, at::ArrayRef<double> qk_params,
    at::IntArrayRef sources, int64_t experts, int64_t top_k) {
  const char* op = "leapfx_cpu::m2r2_predict";
  TORCH_CHECK(dims.size() >= 8 && dims[6] == 0 && dims[7] == 0, op,
              ": dims must be [L, H, D, h_q, h_kv, r, 0, 0, ...] (no router, no head)");
  const int64_t L = dims[0], H = dims[1], D = dims[2], hq = dims[3], hk = dims[4];
  const int64_t T = static_cast<int64_t>(sources.size()), E = experts;
  TORCH_CHECK(qk.size() == 2 && (qk[0] > 0) == (qk[1] > 0), op, ": qk must be [gq, gk]");
  const bool norms = qk[0] > 0;
  TORCH_CHECK(!norms || ((hq * D) % qk[0] == 0 && (hk * D) % qk[1] == 0), op,
              ": q/k norm groups must divide h_q D and h_kv D");
  TORCH_CHECK(static_cast<int64_t>(qk_params.size()) == 1 + 2 * L, op,
              ": qk_params must be [clip, eps_q, eps_k per layer]");
  TORCH_CHECK(E >= 1 && top_k >= 1 && top_k <= E, op, ": top_k must be in 1..experts");
  for (int64_t s : sources) TORCH_CHECK(s >= 0 && s < L, op, ": source layer outside 0..L-1");
  std::vector<double> eps(qk_params.begin() + 1, qk_params.end());
  const int64_t norm_floats = norms ? L * (hq + hk) * D : 0;
  const int64_t extra = norm_floats + T * E * H;
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.numel() >= extra, op, ": weights must be pack_predict's float32");
  const int64_t base = weights.numel() - extra;  // pack_gate's part (fast_stream checks it)
  const QkNorm z_qk{weights.data_ptr<float>() + base, qk[0], qk[1], eps.data(),
                    static_cast<float>(qk_params[0])};
  std::vector<float> states;
  fast_stream(op, hidden, position_ids, weights, dims, params, cache, lengths, nullptr, 0,
              nullptr, states, &z_qk, extra);
  const float* routers = weights.data_ptr<float>() + base + norm_floats;
  at::Tensor scores = at::empty({T, E}, hidden.options());
  at::Tensor ids = at::empty({T, top_k}, hidden.options().dtype(at::kLong));
  at::Tensor out = at::empty({L + 1, H}, hidden.options());
  std::copy(states.begin(), states.end(), out.data_ptr<float>());
  const std::vector<float> zeros(E, 0.0f);
  std::vector<int64_t> order(E);
  for (int64_t j = 0; j < T; ++j) {
    float* s = scores.data_ptr<float>() + j * E;
    matvec(routers + j * E * H, E, H, states.data() + (sources[j] + 1) * H, zeros.data(), s);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [s](int64_t a, int64_t b) {
                        const float x = s[a], y = s[b];
                        const bool nx = std::isnan(x), ny = std::isnan(y);
                        if (nx != ny) return nx;  // torch.topk ranks NaN above every number
                        if (!nx && x != y) return x > y;
                        return a < b;
                      });
    std::copy(order.begin(), order.begin() + top_k, ids.data_ptr<int64_t>() + j * top_k);
  }
  return {ids, scores, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  LEAPFX_CPU_OP(m, m2r2_gate, "(Tensor hidden, Tensor position_ids, Tensor weights, int[] dims, "
      "float[] params, Tensor[] cache, int[] lengths) -> (Tensor, Tensor)");
  LEAPFX_CPU_OP(m, m2r2_draft, "(Tensor hidden, Tensor position_ids, Tensor weights, int[] dims, "
      "float[] params, Tensor[] cache, int[] lengths, Tensor earlier) -> (Tensor, Tensor, Tensor)");
  LEAPFX_CPU_OP(m, m2r2_predict, "(Tensor hidden, Tensor position_ids, Tensor weights, int[] dims, "
      "float[] params, Tensor[] cache, int[] lengths, int[] qk, float[] qk_params, "
      "int[] sources, int experts, int top_k) -> (Tensor, Tensor, Tensor)");
}
