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

#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads

float dot(const float* a, const float* b, int64_t n) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += *(const v8u*)(a + i) * *(const v8u*)(b + i);
  float out = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

// y[N] = W [N, K] x [K] (+ b [N] when given). Four rows at a time: four independent
// accumulators hide the latency of the multiply-adds (one row's chain of K/8 dependent updates
// would stall on each); each row's sum is formed exactly as dot() forms it.
void matvec(const at::Tensor& w, const float* x, const at::Tensor& b, float* y) {
  const int64_t N = w.size(0), K = w.size(1);
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() && b.numel() ? b.data_ptr<float>() : nullptr;
  int64_t n = 0;
  if (K % 8 == 0) {
    for (; n + 4 <= N; n += 4) {
      const float* r0 = wp + n * K;
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
        y[n + j] = sum + (bp ? bp[n + j] : 0.0f);
      }
    }
  }
  for (; n < N; ++n) y[n] = dot(wp + n * K, x, K) + (bp ? bp[n] : 0.0f);
}

void rms_norm(const float* h, const float* w, int64_t H, double eps, double offset, float* out) {
  const float sum = dot(h, h, H);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
  const float off = static_cast<float>(offset);
  for (int64_t i = 0; i < H; ++i) out[i] = (off + w[i]) * (h[i] * inv);
}

// In place: softmax of s[0..n) (max subtracted).
void softmax(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - mx));
  for (int64_t i = 0; i < n; ++i) s[i] /= total;
}

constexpr int64_t kPerLayer = 10;  // tensors per layer in `layers`

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "leapfx_cpu::m2r2_gate: ", what, " must be a contiguous float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
}

// hidden [1, 1, H] (the reset state, one row), position_ids (its position t, int64, last
// element read), layers: per layer [w_qkv, b_qkv, w_o, b_o, down, up, ln_in, ln_post, keys,
// values] (biases [0] when absent; keys/values the slow cache's [1, h_kv_all, L, D] buffers),
// lengths: per layer the slow keys the row reads (n_l), kv_heads: the cache heads read,
// q_to_kv: query head -> index into kv_heads, inv_freq [D/2] and rope_scale (the rotary),
// router [final, q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b], head_w [V, H], head_b ([0]
// when absent), eps/offset per norm (2 per layer, then the final norm's) -> (score [1, 1],
// logits [1, 1, V]).
std::tuple<at::Tensor, at::Tensor> m2r2_gate(
    const at::Tensor& hidden, const at::Tensor& position_ids, at::TensorList layers,
    at::IntArrayRef lengths, at::IntArrayRef kv_heads, at::IntArrayRef q_to_kv,
    const at::Tensor& inv_freq, double rope_scale, double scaling, at::TensorList router,
    const at::Tensor& head_w, const at::Tensor& head_b, at::ArrayRef<double> eps,
    at::ArrayRef<double> offsets) {
  const char* op = "leapfx_cpu::m2r2_gate";
  check_f32(hidden, "hidden");
  const int64_t H = hidden.size(-1);
  TORCH_CHECK(hidden.numel() == H, op, ": one row only, got hidden ", hidden.sizes());
  const int64_t L = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(layers.size()) == kPerLayer * L, op, ": ",
              kPerLayer, " tensors per layer expected for ", L, " layers, got ", layers.size());
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == 2 * L + 1 && eps.size() == offsets.size(), op,
              ": eps/offsets need 2 per layer + 1");
  TORCH_CHECK(router.size() == 9, op, ": the router takes 9 tensors, got ", router.size());
  const int64_t hq = static_cast<int64_t>(q_to_kv.size());
  const int64_t hk = static_cast<int64_t>(kv_heads.size());
  check_f32(inv_freq, "inv_freq");
  const int64_t D = 2 * inv_freq.numel(), half = D / 2;
  TORCH_CHECK(position_ids.numel() >= 1 && position_ids.scalar_type() == at::kLong, op,
              ": position_ids must be int64");
  const int64_t t = position_ids.reshape(-1)[-1].item<int64_t>();
  for (int64_t j = 0; j < hq; ++j) {
    TORCH_CHECK(q_to_kv[j] >= 0 && q_to_kv[j] < hk, op, ": q_to_kv out of range");
  }
  for (const at::Tensor& w : layers) check_f32(w, "a layer tensor");
  for (const at::Tensor& w : router) check_f32(w, "a router tensor");
  check_f32(head_w, "head_w");
  check_f32(head_b, "head_b");
  TORCH_CHECK(head_w.dim() == 2 && head_w.size(1) == H, op, ": head_w must be [V, H=", H, "]");

  // cos/sin of position t: HF's default rotary (cat(freqs, freqs), times the scale)
  std::vector<float> cos(D), sin(D);
  const float* inv = inv_freq.data_ptr<float>();
  for (int64_t i = 0; i < half; ++i) {
    const float f = static_cast<float>(t) * inv[i];
    cos[i] = cos[i + half] = std::cos(f) * static_cast<float>(rope_scale);
    sin[i] = sin[i + half] = std::sin(f) * static_cast<float>(rope_scale);
  }
  // states: the reset, then every layer's output
  std::vector<float> states((L + 1) * H);
  std::copy(hidden.data_ptr<float>(), hidden.data_ptr<float>() + H, states.begin());
  std::vector<float> x(H), qkv((hq + 2 * hk) * D), o(hq * D), y(H), scores;
  const float scale = static_cast<float>(scaling);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + kPerLayer * l;
    const at::Tensor &w_qkv = w[0], &b_qkv = w[1], &w_o = w[2], &b_o = w[3], &down = w[4],
                     &up = w[5], &ln_in = w[6], &ln_post = w[7], &keys = w[8], &values = w[9];
    TORCH_CHECK(w_qkv.dim() == 2 && w_qkv.size(0) == (hq + 2 * hk) * D && w_qkv.size(1) == H,
                op, ": layer ", l, ": w_qkv must be [(h_q + 2 h_kv) D, H]");
    TORCH_CHECK(w_o.dim() == 2 && w_o.size(0) == H && w_o.size(1) == hq * D, op, ": layer ",
                l, ": w_o must be [H, h_q D]");
    TORCH_CHECK(down.dim() == 2 && down.size(1) == H && up.dim() == 2 && up.size(0) == H &&
                    up.size(1) == down.size(0),
                op, ": layer ", l, ": adapter must be down [r, H], up [H, r]");
    TORCH_CHECK(keys.dim() == 4 && keys.size(3) == D && keys.sizes() == values.sizes(), op,
                ": layer ", l, ": keys/values must be [B, h_kv, L, D=", D, "]");
    const int64_t n = lengths[l];
    TORCH_CHECK(n >= 0 && n <= keys.size(2), op, ": layer ", l, ": length ", n,
                " outside the cache");
    const float* p = states.data() + l * H;
    float* pn = states.data() + (l + 1) * H;
    rms_norm(p, ln_in.data_ptr<float>(), H, eps[2 * l], offsets[2 * l], x.data());
    matvec(w_qkv, x.data(), b_qkv, qkv.data());
    for (int64_t h = 0; h < hq + hk; ++h) {  // rotary on the q and k heads
      float* r = qkv.data() + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = r[i], b = r[i + half];
        r[i] = a * cos[i] - b * sin[i];
        r[i + half] = b * cos[i + half] + a * sin[i + half];
      }
    }
    const float* kbase = keys.data_ptr<float>();
    const float* vbase = values.data_ptr<float>();
    const int64_t sh = keys.stride(1), ss = keys.stride(2);
    scores.resize(n + 1);
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = q_to_kv[h];
      const int64_t c = kv_heads[g];
      TORCH_CHECK(c >= 0 && c < keys.size(1), op, ": kv head ", c, " outside the cache");
      const float* q = qkv.data() + h * D;
      const float* kown = qkv.data() + (hq + g) * D;
      const float* vown = qkv.data() + (hq + hk + g) * D;
      const float* kh = kbase + c * sh;
      const float* vh = vbase + c * sh;
      for (int64_t s = 0; s < n; ++s) scores[s] = dot(q, kh + s * ss, D) * scale;
      scores[n] = dot(q, kown, D) * scale;
      softmax(scores.data(), n + 1);
      float* oh = o.data() + h * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = scores[n] * vown[d];
      for (int64_t s = 0; s < n; ++s) {
        const float ws = scores[s];
        const float* vs = vh + s * ss;
        for (int64_t d = 0; d < D; ++d) oh[d] += ws * vs[d];
      }
    }
    matvec(w_o, o.data(), b_o, y.data());
    for (int64_t i = 0; i < H; ++i) pn[i] = p[i] + y[i];
    rms_norm(pn, ln_post.data_ptr<float>(), H, eps[2 * l + 1], offsets[2 * l + 1], x.data());
    const int64_t r = down.size(0);
    std::vector<float> a(r);
    matvec(down, x.data(), at::Tensor(), a.data());
    for (int64_t i = 0; i < r; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i]));
    matvec(up, a.data(), at::Tensor(), y.data());
    for (int64_t i = 0; i < H; ++i) pn[i] += y[i];
  }
  // The router: the final norm of every state, one-head attention in the latent space.
  const at::Tensor &fin = router[0], &q_w = router[1], &q_b = router[2], &k_w = router[3],
                   &k_b = router[4], &v_w = router[5], &v_b = router[6], &out_w = router[7],
                   &out_b = router[8];
  const int64_t dl = q_w.size(0);
  TORCH_CHECK(q_w.dim() == 2 && q_w.size(1) == H && k_w.sizes() == q_w.sizes() &&
                  v_w.sizes() == q_w.sizes() && out_w.numel() == dl && out_b.numel() == 1,
              op, ": router weights must be q/k/v [d, H], out [1, d]");
  std::vector<float> normed((L + 1) * H), kl((L + 1) * dl), vl((L + 1) * dl), ql(dl), al(dl, 0);
  std::vector<float> att(L + 1);
  for (int64_t s = 0; s <= L; ++s) {
    rms_norm(states.data() + s * H, fin.data_ptr<float>(), H, eps[2 * L], offsets[2 * L],
             normed.data() + s * H);
    matvec(k_w, normed.data() + s * H, k_b, kl.data() + s * dl);
    matvec(v_w, normed.data() + s * H, v_b, vl.data() + s * dl);
  }
  const float* last = normed.data() + L * H;
  matvec(q_w, last, q_b, ql.data());
  const float latent_scale = 1.0f / std::sqrt(static_cast<float>(dl));
  for (int64_t s = 0; s <= L; ++s) att[s] = dot(ql.data(), kl.data() + s * dl, dl) * latent_scale;
  softmax(att.data(), L + 1);
  for (int64_t s = 0; s <= L; ++s) {
    for (int64_t i = 0; i < dl; ++i) al[i] += att[s] * vl[s * dl + i];
  }
  const float z = dot(out_w.data_ptr<float>(), al.data(), dl) + out_b.data_ptr<float>()[0];
  at::Tensor score = at::empty({1, 1}, hidden.options());
  score.data_ptr<float>()[0] = 1.0f / (1.0f + std::exp(-z));
  at::Tensor logits = at::empty({1, 1, head_w.size(0)}, hidden.options());
  matvec(head_w, last, head_b, logits.data_ptr<float>());
  return {score, logits};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  m.def(
      "m2r2_gate(Tensor hidden, Tensor position_ids, Tensor[] layers, int[] lengths, "
      "int[] kv_heads, int[] q_to_kv, Tensor inv_freq, float rope_scale, float scaling, "
      "Tensor[] router, Tensor head_w, Tensor head_b, float[] eps, float[] offsets) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(leapfx_cpu, CPU, m) { m.impl("m2r2_gate", &m2r2_gate); }
