// Small-M float32 matrix products for decode steps on a CPU (see leapfx/kernels/cpu.py).
//
// A decode step multiplies 1 row, a verify pass d + 1 rows, by each weight matrix. MKL's
// products cost about linearly in the rows at these sizes (a 5 x 192 by 192 x 512 product ~3.3x
// one row), while what bounds them is reading the weights. These kernels read each weight once
// for up to kMaxRows rows: a block of 16 output columns is accumulated for every row in
// registers while the weight's rows stream past. Each output row is computed with the same
// operations in the same order whatever the number of rows, so a row's result does not depend
// on how many rows were multiplied with it.
//
// Weights are given packed (see pack_weight in cpu.py): wp [ceil(N / 16), K, 16] contiguous,
// block b holding output columns 16b .. 16b + 15 (zero past N) for every k, so that a block's
// weights are one sequential stream (a [K, N] layout strides by N floats per k: with N = 1024
// that is one 4 KB page per k, where hardware prefetchers stop).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

// One register's worth of floats (cpu_vec.h): results do not depend on which one the build used.
using leapfx_vec::kLanes;
using leapfx_vec::vec;
using leapfx_vec::vecu;

constexpr int64_t kBlock = 16;  // output columns per register block
constexpr int kParts = kBlock / kLanes;  // registers per block row
constexpr int kMaxRows = 6;
#ifndef LEAPFX_PREFETCH
#define LEAPFX_PREFETCH 16  // cache lines (16 floats each) ahead
#endif

// Blocks per pass for R rows: enough independent accumulator chains (R * NB * kParts >= 8) to
// hide the FMA latency; one row alone has kParts chains and would wait on it at every k. The
// registers hold them: (R + 1) * NB * kParts <= 16 (AVX: 16 registers; AVX-512 has 32).
template <int R>
constexpr int kBlocksAtOnce = (8 + R * kParts - 1) / (R * kParts);

// y[r, 16(b + j) : 16(b + j) + 16] = x[r, :] @ block b + j for j < NB, for R rows (x row
// stride ldx, y row stride ldy); only the first widths[j] (<= 16) columns of block j are stored.
// Each column's sum runs over k in the same order whatever R and NB.
template <int R, int NB>
inline void blocks16(const float* x, int64_t ldx, const float* wb, int64_t K, float* y,
                     int64_t ldy, const int64_t* widths) {
  vec acc[NB][R][kParts];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kParts; ++p) acc[j][r][p] = vec{};
  const int64_t stride = K * kBlock;  // from one block's weights to the next's
  for (int64_t k = 0; k < K; ++k) {
    float xv[R];
    for (int r = 0; r < R; ++r) xv[r] = x[r * ldx + k];
    for (int j = 0; j < NB; ++j) {
      const float* w = wb + j * stride + k * kBlock;
      // Each block's weights are one sequential stream: fetch ahead of it so that the loads
      // overlap the arithmetic when the weights come from memory. Into every cache level
      // (locality 3): a non-temporal prefetch keeps the lines out of L2/L3 on Intel CPUs, and
      // the next call, which reads the same weights, then finds none of them there (2.5-4x
      // slower products, measured on a Xeon with AVX-512).
      __builtin_prefetch(w + LEAPFX_PREFETCH * kBlock, 0, 3);
      vec wv[kParts];
      for (int p = 0; p < kParts; ++p) wv[p] = *(const vecu*)(w + p * kLanes);
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < kParts; ++p) acc[j][r][p] += xv[r] * wv[p];
    }
  }
  for (int j = 0; j < NB; ++j) {
    float* yj = y + j * kBlock;
    for (int r = 0; r < R; ++r) {
      if (widths[j] == kBlock) {
        for (int p = 0; p < kParts; ++p) *(vecu*)(yj + r * ldy + p * kLanes) = acc[j][r][p];
      } else {
        float tmp[kBlock];
        for (int p = 0; p < kParts; ++p) *(vecu*)(tmp + p * kLanes) = acc[j][r][p];
        for (int64_t c = 0; c < widths[j]; ++c) yj[r * ldy + c] = tmp[c];
      }
    }
  }
}

// Blocks b .. b1 - 1, NB at a time, then the rest at halving widths (a ragged end still gets
// several chains).
template <int R, int NB>
inline void span(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t N, float* y,
                 int64_t ldy, int64_t b, int64_t b1) {
  for (; b + NB <= b1; b += NB) {
    int64_t widths[NB];
    for (int j = 0; j < NB; ++j) widths[j] = std::min(kBlock, N - (b + j) * kBlock);
    blocks16<R, NB>(x, ldx, wp + b * K * kBlock, K, y + b * kBlock, ldy, widths);
  }
  if constexpr (NB > 1) span<R, NB / 2>(x, ldx, wp, K, N, y, ldy, b, b1);
}

// R (<= kMaxRows) rows over blocks b0 .. b1 - 1, as many blocks at once as the registers hold.
inline void group_span(int R, const float* x, int64_t ldx, const float* wp, int64_t K, int64_t N,
                       float* y, int64_t ldy, int64_t b0, int64_t b1) {
  switch (R) {
    case 6: span<6, kBlocksAtOnce<6>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    case 5: span<5, kBlocksAtOnce<5>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    case 4: span<4, kBlocksAtOnce<4>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    case 3: span<3, kBlocksAtOnce<3>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    case 2: span<2, kBlocksAtOnce<2>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    case 1: span<1, kBlocksAtOnce<1>>(x, ldx, wp, K, N, y, ldy, b0, b1); break;
    default: break;
  }
}

// Weights a chunk of column blocks may hold so that they are still in the core's L2 cache
// when the next group of kMaxRows rows reads them (these CPUs have 512 KB - 2 MB of L2).
constexpr int64_t kChunkBytes = 256 * 1024;

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ packed wp.
//
// The rows go kMaxRows at a time (the registers hold no more). Over more rows than that (a
// batch's decode step, its verify, a prefill), each thread walks its column blocks a chunk at
// a time and runs every group of rows over a chunk before the next: the chunk's weights come
// from memory once and from the cache for the other groups, where a pass of all the weights a
// group would read them from memory once per group. The sums are the same either way.
void matmul_rows(const float* x, int64_t ldx, int64_t M, const float* wp, int64_t K, int64_t N,
                 float* y, int64_t ldy) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // a multiple of 4 blocks (one row's registers take 4 at once); one group: no chunks
  const int64_t fit = kChunkBytes / (K * kBlock * static_cast<int64_t>(sizeof(float)));
  const int64_t chunk = M <= kMaxRows ? blocks : std::max<int64_t>(4, fit / 4 * 4);
  // Grain: at least 4 blocks per task, so that tiny products stay on one thread.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
        group_span(R, x + m * ldx, ldx, wp, K, N, y + m * ldy, ldy, c0, c1);
      }
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& wp, int64_t n, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, op,
              ": float32 only, got ", x.scalar_type(), " and ", wp.scalar_type());
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kBlock && wp.is_contiguous(), op,
              ": weight must be packed, a contiguous [ceil(N/16), K, 16]");
  TORCH_CHECK(n > 0 && (n + kBlock - 1) / kBlock == wp.size(0), op, ": n=", n,
              " does not match ", wp.size(0), " column blocks");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == wp.size(1), op, ": x [..., ", x.size(-1),
              "] does not match the weight's K=", wp.size(1));
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// x [..., K] @ W -> [..., n], W packed in wp.
at::Tensor small_mm(const at::Tensor& x, const at::Tensor& wp, int64_t n) {
  check(x, wp, n, "leapfx_cpu::small_mm");
  const at::Tensor xc = x.contiguous();
  const int64_t K = wp.size(1), M = xc.numel() / K;
  at::Tensor y = at::empty(out_shape(x, n), x.options());
  matmul_rows(xc.data_ptr<float>(), K, M, wp.data_ptr<float>(), K, n, y.data_ptr<float>(), n);
  return y;
}

// The gated MLP of Llama-style layers: down(silu(x @ gate) * (x @ up)) in one call.
// w_gate_up packs the 2I columns [gate | up]; w_down packs K columns over I inputs.
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, int64_t i2,
                     const at::Tensor& w_down, int64_t k_out) {
  check(x, w_gate_up, i2, "leapfx_cpu::gated_mlp");
  const int64_t K = w_gate_up.size(1), I = i2 / 2;
  TORCH_CHECK(i2 % 2 == 0, "leapfx_cpu::gated_mlp: 2I must be even, got ", i2);
  TORCH_CHECK(w_down.dim() == 3 && w_down.size(1) == I && w_down.size(2) == kBlock &&
                  w_down.is_contiguous() && w_down.scalar_type() == at::kFloat &&
                  (k_out + kBlock - 1) / kBlock == w_down.size(0),
              "leapfx_cpu::gated_mlp: w_down must be packed [ceil(k_out/16), I=", I,
              ", 16] float32 for k_out=", k_out);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  at::Tensor gu = at::empty({M, i2}, x.options());
  float* g = gu.data_ptr<float>();
  matmul_rows(xc.data_ptr<float>(), K, M, w_gate_up.data_ptr<float>(), K, i2, g, i2);
  for (int64_t m = 0; m < M; ++m) {  // silu(gate) * up, into the gate half
    float* row = g + m * i2;
    leapfx_vec::silu_mul(row, row + I, I);
  }
  at::Tensor y = at::empty(out_shape(x, k_out), x.options());
  matmul_rows(g, i2, M, w_down.data_ptr<float>(), I, k_out, y.data_ptr<float>(), k_out);
  return y;
}

// RMSNorm over the last dim (leapfx_vec::rms_norm: HF's float32 math, one row at a time).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "leapfx_cpu::rms_norm: float32 CPU tensors only, got ", x.scalar_type(), " and ",
              w.scalar_type());
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H, "leapfx_cpu::rms_norm: weight [", H,
              "] expected, got ", w.sizes());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0, rows = H ? xc.numel() / H : 0; r < rows; ++r)
    leapfx_vec::rms_norm(xp + r * H, wp, H, eps, offset, yp + r * H);
  return y;
}

// HF's rotary: t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1] over the halves of
// the last dim, for t [B, heads, S, D] (any strides but the last dim's) and cos, sin [B, S, D].
// The products are rounded before the sum, as in torch's two multiplies and one add (no fused
// multiply-add, whatever the build's flags): the same values as HF's six ops.
__attribute__((optimize("fp-contract=off"))) void rope_into(const at::Tensor& t,
                                                            const at::Tensor& cos,
                                                            const at::Tensor& sin,
                                                            at::Tensor& out) {
  const int64_t B = t.size(0), Hn = t.size(1), S = t.size(2), D = t.size(3);
  const float* tp = t.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hn; ++h)
      for (int64_t s = 0; s < S; ++s) {
        const float* x = tp + b * t.stride(0) + h * t.stride(1) + s * t.stride(2);
        const float* c = cp + (b * S + s) * D;
        const float* n = sp + (b * S + s) * D;
        float* o = op + ((b * Hn + h) * S + s) * D;
        leapfx_vec::rope_row(x, c, n, o, D);
      }
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "leapfx_cpu::rope: float32 CPU tensors only, got ", t->scalar_type());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(3) == k.size(3) && q.size(3) % 2 == 0 &&
                  q.size(3) > 0 && q.stride(3) == 1 && k.stride(3) == 1,
              "leapfx_cpu::rope: q, k [B, heads, S, D] with an even D and a contiguous last "
              "dim expected, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "leapfx_cpu::rope: q ",
              q.sizes(), " and k ", k.sizes(), " differ in B or S");
  const std::vector<int64_t> cs = {q.size(0), q.size(2), q.size(3)};
  TORCH_CHECK(cos.sizes() == at::IntArrayRef(cs) && sin.sizes() == at::IntArrayRef(cs),
              "leapfx_cpu::rope: cos, sin ", at::IntArrayRef(cs), " expected, got ", cos.sizes(),
              " and ", sin.sizes());
  const at::Tensor c = cos.contiguous(), n = sin.contiguous();
  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  rope_into(q, c, n, qo);
  rope_into(k, c, n, ko);
  return {qo, ko};
}


// ---- Mixture-of-Experts experts (HF's <X>Experts layout) -----------------------------------

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads

inline float sum8(v8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// y[r, w] = W[w, :] . x[r, :] for NW weight rows of W [., K] (row-major) and R vectors x
// (row stride ldx), into y (row stride ldy): NW * R eight-lane sums sharing every load. Each
// sum's arithmetic is the same whatever NW and R: a result does not depend on what it was
// computed with.
template <int NW, int R>
inline void dots(const float* W, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  v8 acc[NW][R];
  for (int w = 0; w < NW; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = v8{};
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    v8 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = *(const v8u*)(x + r * ldx + i);
    for (int w = 0; w < NW; ++w) {
      const v8 wv = *(const v8u*)(W + w * K + i);
      for (int r = 0; r < R; ++r) acc[w][r] += wv * xv[r];
    }
  }
  for (int w = 0; w < NW; ++w)
    for (int r = 0; r < R; ++r) {
      float out = sum8(acc[w][r]);
      for (int64_t j = i; j < K; ++j) out += W[w * K + j] * x[r * ldx + j];
      y[r * ldy + w] = out;
    }
}

// y [R, N] (row stride ldy) = x [R, K] (row stride ldx) @ W [N, K]^T: each weight row is read
// once for the R vectors (R <= 4), in order.
template <int R>
void gemv_rows(const float* W, int64_t N, int64_t K, const float* x, int64_t ldx, float* y,
               int64_t ldy) {
  constexpr int NW = R == 1 ? 4 : 2;  // independent sums enough to hide the FMA latency
  int64_t n = 0;
  for (; n + NW <= N; n += NW) dots<NW, R>(W + n * K, K, x, ldx, y + n, ldy);
  for (; n < N; ++n) dots<1, R>(W + n * K, K, x, ldx, y + n, ldy);
}

void gemv_any(int R, const float* W, int64_t N, int64_t K, const float* x, int64_t ldx, float* y,
              int64_t ldy) {
  switch (R) {
    case 4: gemv_rows<4>(W, N, K, x, ldx, y, ldy); break;
    case 3: gemv_rows<3>(W, N, K, x, ldx, y, ldy); break;
    case 2: gemv_rows<2>(W, N, K, x, ldx, y, ldy); break;
    default: gemv_rows<1>(W, N, K, x, ldx, y, ldy); break;
  }
}

// out += y * w, each product rounded before the sum (HF weights each expert's output, then
// sums over the top-k).
__attribute__((optimize("fp-contract=off"))) void add_weighted(float* out, const float* y,
                                                                float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] + y[i] * w;
}

// HF's experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) over gate_up [S, 2I, H]
// ([gate | up] rows) and down [S, H, I]: out[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @
// x[t]) * (up[e] @ x[t])), e = index[t, j], the sum in j order. An index outside 0 .. S - 1 (an
// offload wave's sentinel) adds nothing. The (token, expert) pairs are grouped by expert, so
// that an expert's weights are read once for up to four of its tokens (a verify pass, a
// prefill); a pair's result does not depend on the grouping (see dots): each token's row is
// the same whatever the other tokens.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down) {
  const char* op = "leapfx_cpu::moe_experts";
  for (const at::Tensor* t : {&x, &weights, &gate_up, &down})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, op,
                ": float32 CPU tensors expected, got ", t->scalar_type(), " on ", t->device());
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong, op,
              ": top_k_index must be int64 on the CPU, got ", index.scalar_type());
  TORCH_CHECK(x.dim() == 2 && index.dim() == 2 && weights.sizes() == index.sizes() &&
                  index.size(0) == x.size(0),
              op, ": hidden [T, H], top_k_index and top_k_weights [T, k] expected, got ",
              x.sizes(), ", ", index.sizes(), " and ", weights.sizes());
  const int64_t T = x.size(0), H = x.size(1), k = index.size(1);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(2) == H && gate_up.size(1) % 2 == 0, op,
              ": gate_up [S, 2I, H=", H, "] expected, got ", gate_up.sizes());
  const int64_t S = gate_up.size(0), I2 = gate_up.size(1), I = I2 / 2;
  TORCH_CHECK(down.dim() == 3 && down.size(0) == S && down.size(1) == H && down.size(2) == I, op,
              ": down [S=", S, ", H=", H, ", I=", I, "] expected, got ", down.sizes());
  const at::Tensor xc = x.contiguous(), ic = index.contiguous(), wc = weights.contiguous();
  const at::Tensor gc = gate_up.contiguous(), dc = down.contiguous();
  at::Tensor out = at::zeros({T, H}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  const float *gp = gc.data_ptr<float>(), *dp = dc.data_ptr<float>();
  const int64_t* ip = ic.data_ptr<int64_t>();
  float* op_ = out.data_ptr<float>();
  // Pairs p = t * k + j by expert, in token order.
  std::vector<std::vector<int64_t>> pairs(S);
  int64_t used = 0;
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ip[p];
    if (e >= 0 && e < S) pairs[e].push_back(p), ++used;
  }
  std::vector<float> ys(used ? T * k * H : 0);  // each pair's expert output, unweighted
  // Experts over threads only when there is work enough to pay for waking them (prefill).
  const int64_t grain = used * I2 * H >= (int64_t{1} << 20) ? 1 : S;
  at::parallel_for(0, S, grain, [&](int64_t e0, int64_t e1) {
    std::vector<float> xg(4 * H), gu(4 * I2);
    for (int64_t e = e0; e < e1; ++e) {
      const std::vector<int64_t>& ps = pairs[e];
      for (size_t g = 0; g < ps.size(); g += 4) {
        const int R = static_cast<int>(std::min<size_t>(4, ps.size() - g));
        for (int r = 0; r < R; ++r)
          std::copy_n(xp + (ps[g + r] / k) * H, H, xg.data() + r * H);
        gemv_any(R, gp + e * I2 * H, I2, H, xg.data(), H, gu.data(), I2);
        for (int r = 0; r < R; ++r) leapfx_vec::silu_mul(gu.data() + r * I2, gu.data() + r * I2 + I, I);
        // reuse xg for the outputs, then scatter them to their pairs
        gemv_any(R, dp + e * H * I, H, I, gu.data(), I2, xg.data(), H);
        for (int r = 0; r < R; ++r) std::copy_n(xg.data() + r * H, H, ys.data() + ps[g + r] * H);
      }
    }
  });
  for (int64_t t = 0; t < T; ++t)  // the weighted sum over the top-k, in j order
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ip[t * k + j];
      if (e >= 0 && e < S) add_weighted(op_ + t * H, ys.data() + (t * k + j) * H, wp[t * k + j], H);
    }
  return out;
}

}  // namespace

TORCH_LIBRARY(leapfx_cpu, m) {
  LEAPFX_CPU_OP(m, small_mm, "(Tensor x, Tensor wp, int n) -> Tensor");
  LEAPFX_CPU_OP(m, gated_mlp, "(Tensor x, Tensor w_gate_up, int i2, Tensor w_down, int k_out) -> "
      "Tensor");
  LEAPFX_CPU_OP(m, rms_norm, "(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  LEAPFX_CPU_OP(m, rope, "(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  LEAPFX_CPU_OP(m, moe_experts, "(Tensor x, Tensor index, Tensor weights, Tensor gate_up, "
      "Tensor down) -> Tensor");
}
