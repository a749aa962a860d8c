// Vector helpers shared by leapfx's CPU ops (cpu_gemm.cpp, cpu_attention.cpp, cpu_specee.cpp,
// cpu_m2r2.cpp). Each op is
// its own extension; this header is compiled into each (load_extension names the build after
// the headers' contents too, so that a change here rebuilds them).
#pragma once

#include <cmath>
#include <cstdint>

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

}  // namespace leapfx_vec
