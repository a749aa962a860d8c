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
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores

constexpr int64_t kBlock = 16;  // output columns per register block
constexpr int kMaxRows = 6;
#ifndef LEAPFX_PREFETCH
#define LEAPFX_PREFETCH 16  // cache lines (16 floats each) ahead
#endif     // 2 * kMaxRows accumulators + 2 weight vectors fit 16 ymm

// y[r, 16b : 16b + 16] = x[r, :] @ block b, for R rows (x row stride ldx, y row stride ldy);
// only the first `width` (<= 16) columns are stored.
template <int R>
inline void block16(const float* x, int64_t ldx, const float* wb, int64_t K, float* y,
                    int64_t ldy, int64_t width) {
  v8 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = (v8){0, 0, 0, 0, 0, 0, 0, 0};
    a1[r] = a0[r];
  }
  for (int64_t k = 0; k < K; ++k) {
    // The packed weight is one sequential stream (blocks follow each other): fetch ahead of
    // it so that the loads overlap the arithmetic when the weights come from memory.
    __builtin_prefetch(wb + (k + LEAPFX_PREFETCH) * kBlock, 0, 0);
    const v8 w0 = *(const v8u*)(wb + k * kBlock);
    const v8 w1 = *(const v8u*)(wb + k * kBlock + 8);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  if (width == kBlock) {
    for (int r = 0; r < R; ++r) {
      *(v8u*)(y + r * ldy) = a0[r];
      *(v8u*)(y + r * ldy + 8) = a1[r];
    }
  } else {
    for (int r = 0; r < R; ++r) {
      float tmp[kBlock];
      *(v8u*)(tmp) = a0[r];
      *(v8u*)(tmp + 8) = a1[r];
      for (int64_t j = 0; j < width; ++j) y[r * ldy + j] = tmp[j];
    }
  }
}

template <int R>
void rows(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t N, float* y,
          int64_t ldy) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Grain: at least 4 blocks per task, so that tiny products stay on one thread.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      block16<R>(x, ldx, wp + b * K * kBlock, K, y + n0, ldy, std::min(kBlock, N - n0));
    }
  });
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ packed wp.
void matmul_rows(const float* x, int64_t ldx, int64_t M, const float* wp, int64_t K, int64_t N,
                 float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) {
    rows<kMaxRows>(x + m * ldx, ldx, wp, K, N, y + m * ldy, ldy);
  }
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: rows<5>(xm, ldx, wp, K, N, ym, ldy); break;
    case 4: rows<4>(xm, ldx, wp, K, N, ym, ldy); break;
    case 3: rows<3>(xm, ldx, wp, K, N, ym, ldy); break;
    case 2: rows<2>(xm, ldx, wp, K, N, ym, ldy); break;
    case 1: rows<1>(xm, ldx, wp, K, N, ym, ldy); break;
    default: break;
  }
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
    for (int64_t i = 0; i < I; ++i) {
      const float a = row[i];
      row[i] = a / (1.0f + std::exp(-a)) * row[I + i];
    }
  }
  at::Tensor y = at::empty(out_shape(x, k_out), x.options());
  matmul_rows(g, i2, M, w_down.data_ptr<float>(), I, k_out, y.data_ptr<float>(), k_out);
  return y;
}

}  // namespace

TORCH_LIBRARY(leapfx_cpu, m) {
  m.def("small_mm(Tensor x, Tensor wp, int n) -> Tensor");
  m.def("gated_mlp(Tensor x, Tensor w_gate_up, int i2, Tensor w_down, int k_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(leapfx_cpu, CPU, m) {
  m.impl("small_mm", &small_mm);
  m.impl("gated_mlp", &gated_mlp);
}
