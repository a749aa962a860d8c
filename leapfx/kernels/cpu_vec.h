// Vector helpers shared by leapfx's CPU ops (cpu_gemm.cpp, cpu_attention.cpp, cpu_specee.cpp,
// cpu_m2r2.cpp, cpu_blocks.cpp), and the macro that declares each op. Each op is
// its own extension; this header is compiled into each (load_extension names the build after
// the headers' contents too, so that a change here rebuilds them).
#pragma once

#include <torch/library.h>

#include <cmath>
#include <cstdint>

// Declare the op `fn` of the leapfx_cpu library by its schema after the name, with `fn` as its
// CPU kernel: one line an op, its name written once (a def and an impl would each repeat it).
#define LEAPFX_CPU_OP(m, fn, schema) \
  (m).def(#fn schema, torch::dispatch(c10::DispatchKey::CPU, &fn))

namespace leapfx_vec {

// One register's worth of floats (cpu_gemm.cpp, cpu_attention.cpp): one AVX-512 register, or
// one AVX register where the build has no AVX-512. A 16-float block is one AVX-512 register or
// two AVX ones; both give every column the same fused multiply-adds in the same order.
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
typedef float vecu __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
constexpr int kLanes = 16;
#else
typedef float vec __attribute__((vector_size(32)));
typedef float vecu __attribute__((vector_size(32), aligned(4)));
constexpr int kLanes = 8;
#endif

typedef int32_t veci __attribute__((vector_size(sizeof(vec))));  // lane masks and bits

// exp(x) lane by lane: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2 and p Cephes' expf
// polynomial (relative error ~2e-7, like expf); 0 below -87 (and for -inf), +inf above 88.
// Each lane's result depends on that lane's x only.
inline vec exp(vec x) {
  const veci low = x < -87.0f, high = x > 88.0f;
  x = low ? vec{} - 87.0f : x;
  x = high ? vec{} + 88.0f : x;
  const vec kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vec r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const veci bits = (__builtin_convertvector(kf, veci) + 127) << 23;
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof(vec));
  const vec out = low ? vec{} : p * scale;
  return high ? vec{} + __builtin_inff() : out;
}

// silu(g) * u over n floats, in place into g: g / (1 + exp(-g)) * u, vectorised (the tail
// through one padded vector), each element from its own g and u only.
inline void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec a = *(const vecu*)(g + i);
    *(vecu*)(g + i) = a / (1.0f + exp(vec{} - a)) * *(const vecu*)(u + i);
  }
  if (i < n) {
    float ga[kLanes] = {}, ua[kLanes] = {};
    for (int64_t j = i; j < n; ++j) ga[j - i] = g[j], ua[j - i] = u[j];
    const vec a = *(const vecu*)ga;
    *(vecu*)ga = a / (1.0f + exp(vec{} - a)) * *(const vecu*)ua;
    for (int64_t j = i; j < n; ++j) g[j] = ga[j - i];
  }
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads

// Eight running sums (one vector), then the tail: vectorised whatever the compiler's
// floating-point flags (a single running sum may not be reordered).
inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += *(const v8u*)(a + i) * *(const v8u*)(b + i);
  float out = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

// out = h * rsqrt(mean(h^2) + eps) * (offset + w): the float32 math of HF's RMSNorm (Llama
// family: offset 0; Gemma: offset 1).
inline void rms_norm(const float* h, const float* w, int64_t H, double eps, double offset,
                     float* out) {
  const float sum = dot(h, h, H);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
  const float off = static_cast<float>(offset);
  for (int64_t i = 0; i < H; ++i) out[i] = (off + w[i]) * (h[i] * inv);
}

// Llama's rotary on one head's row of D values (half = D / 2): o = x * cos + rotate_half(x) * sin,
// each element one product and one sum in this order (what HF's apply_rotary_pos_emb computes).
// No fused multiply-add (the build contracts by default): the products are rounded first.
__attribute__((optimize("fp-contract=off"))) inline void rope_row(const float* x, const float* c,
                                                                   const float* n, float* o,
                                                                   int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * c[d], r = (-x[d + half]) * n[d];
    o[d] = a + r;
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = x[d] * c[d], r = x[d - half] * n[d];
    o[d] = a + r;
  }
}

}  // namespace leapfx_vec
