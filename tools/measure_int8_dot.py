"""Would llama.cpp-style arithmetic (activations as 8-bit blocks, integer dot products) make a
cheaper draft step? A microbenchmark of one-row products over SmolLM2's shapes
(docs/recipes.md, "qspec", the GGUF-native question):

    flock /tmp/leapfx-bench.lock python tools/measure_int8_dot.py [--threads 2]

``q4_0_q8`` and ``q8_0_q8`` are minimal AVX-512 VNNI versions of ggml's
``ggml_vec_dot_q4_0_q8_0`` / ``q8_0_q8_0`` (the activation row quantized to Q8 blocks once,
then per block one ``vpdpbusd`` over 32 weights, its int32 lanes scaled into float32
accumulators), built here with ``torch.utils.cpp_extension.load_inline``, against leapfx's
exact ``block_mm`` (float32 activations, each block dequantized in registers) on the same
blocks. They are measurements, not a leapfx kernel: no tests guard their numbers. Times are
the minimum over 9 rounds of a batch of calls.
"""

from __future__ import annotations

import argparse
import time

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline float h2f(const uint8_t* p) {
  uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h);
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x [k] float32 -> Q8 blocks of 32: int8 values, scales, and each block's sum of values
struct Q8Row { std::vector<int8_t> q; std::vector<float> d; std::vector<int32_t> s; };

static Q8Row quantize_row(const float* x, int64_t k) {
  Q8Row r{std::vector<int8_t>(k), std::vector<float>(k / 32), std::vector<int32_t>(k / 32)};
  for (int64_t b = 0; b < k / 32; ++b) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    float db = amax / 127.f, id = db ? 1.f / db : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      int v = (int)std::lrintf(x[b * 32 + i] * id);
      r.q[b * 32 + i] = (int8_t)v; sum += v;
    }
    r.d[b] = db; r.s[b] = sum;
  }
  return r;
}

// out[r] = row_dot(row r's blocks, blocks a row, the quantized x) over the rows, in parallel
template <typename RowDot>
static torch::Tensor gemv(torch::Tensor x, torch::Tensor w, int64_t n, int64_t k,
                          int64_t block_bytes, RowDot row_dot) {
  const int64_t nb = k / 32;
  const Q8Row qx = quantize_row(x.data_ptr<float>(), k);
  auto out = torch::empty({n}, x.options());
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_dot(W + r * nb * block_bytes, nb, qx);
  });
  return out;
}

torch::Tensor q4_0_q8(torch::Tensor x, torch::Tensor w, int64_t n, int64_t k) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  return gemv(x, w, n, k, 18, [&](const uint8_t* row, int64_t nb, const Q8Row& qx) {
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * 18;
      float scale = h2f(blk) * qx.d[b];
      __m128i packed = _mm_loadu_si128((const __m128i*)(blk + 2));
      __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
      __m256i wq = _mm256_and_si256(both, low);  // 0..15: low nibbles, then high
      __m256i xq = _mm256_loadu_si256((const __m256i*)(qx.q.data() + b * 32));
      __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(dot), acc);
      corr += scale * (float)qx.s[b];  // the -8 of every weight
    }
    return hsum8(acc) - 8.f * corr;
  });
}

torch::Tensor q8_0_q8(torch::Tensor x, torch::Tensor w, int64_t n, int64_t k) {
  return gemv(x, w, n, k, 34, [&](const uint8_t* row, int64_t nb, const Q8Row& qx) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * 34;
      float scale = h2f(blk) * qx.d[b];
      __m256i wq = _mm256_loadu_si256((const __m256i*)(blk + 2));
      __m256i xq = _mm256_loadu_si256((const __m256i*)(qx.q.data() + b * 32));
      // u8 x s8 only: |w| against x with w's sign (ggml's AVX2 trick)
      __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wq, wq),
                                        _mm256_sign_epi8(xq, wq));
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(dot), acc);
    }
    return hsum8(acc);
  });
}
"""

# SmolLM2-135M's products per layer and the tied head: (name, rows, k)
SHAPES = [("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536),
          ("head", 49152, 576)]  # fmt: skip
LAYERS = 30


def _time(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(9):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    from torch.utils.cpp_extension import load_inline

    from leapfx.kernels import cpu_blocks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_inline(
        "leapfx_measure_int8_dot", cpp_sources=SOURCE, functions=["q4_0_q8", "q8_0_q8"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl",
                      "-mavx512bw", "-mavx512vnni"],
    )  # fmt: skip
    assert cpu_blocks.available()
    totals = {}
    for fmt, int8 in (("Q4_0", ext.q4_0_q8), ("Q8_0", ext.q8_0_q8)):
        exact_total = int8_total = 0.0
        for name, n, k in SHAPES:
            g = torch.Generator().manual_seed(n + k)
            w = cpu_blocks.quantize(torch.randn(n, k, generator=g), fmt)
            x = torch.randn(1, k, generator=g)
            want = x @ cpu_blocks.dequantize(w).T
            got = int8(x[0], w.data, n, k)
            err = float((got - want[0]).abs().max() / want.abs().max())
            calls = 20 if n > 10000 else 200
            exact = _time(lambda: cpu_blocks.block_mm(x, w), calls)  # noqa: B023
            fast = _time(lambda: int8(x[0], w.data, n, k), calls)  # noqa: B023
            times = 1 if name == "head" else LAYERS
            exact_total += exact * times
            int8_total += fast * times
            print(f"{fmt} {name} [{n} x {k}]: exact {exact * 1e6:.1f} us, int8 activations "
                  f"{fast * 1e6:.1f} us ({exact / fast:.2f}x), max error {err:.1e} of "
                  "max |y|")  # fmt: skip
        totals[fmt] = (exact_total, int8_total)
        print(f"{fmt}: one token's products {exact_total * 1e3:.2f} ms exact, "
              f"{int8_total * 1e3:.2f} ms with int8 activations", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
