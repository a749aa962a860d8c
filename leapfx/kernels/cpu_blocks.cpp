// Small-M products over GGUF's block-quantized weights, float32 activations (see
// leapfx/kernels/cpu_blocks.py).
//
// A weight [N, K] is given as the file holds it: N rows of K / 32 blocks, each block 32 weights
// (Q4_0: fp16 d + 16 bytes of 4-bit q; Q4_1: fp16 d, fp16 m + 16 bytes; Q8_0: fp16 d + 32 int8;
// F16, BF16, F32: 32 plain values). A block is dequantized in registers (two AVX-512 registers
// of 16 floats where the build has AVX-512, else four AVX2 ones of 8), each float bitwise the
// value gguf's numpy dequantize gives:
//   Q4_0: d * (q - 8)    Q4_1: d * q + m    Q8_0: q * d    F16, BF16: the value as float32
// (d * q is exact in float32 here: d has 11 significant bits and q at most 8, so rounding the
// product first, as numpy does, or not, gives the same float; the product is kept apart from
// the add anyway). The rows of x [M, K] multiply each dequantized block while it is in
// registers: up to kMaxRows rows share one dequantization. Each (output, row) sum is one vector
// accumulator fed in k order, then summed lane by lane in a fixed order: a row's result does not
// depend on how many rows or output columns were computed with it.
//
// A prefill (kGemmRows or more rows of one sequence) is another shape of work: there float32
// GEMM's blocked products beat one dequantization per kMaxRows rows (on a 2-core Xeon, gate
// [1536 x 576] at 200 rows: 3.4 ms as blocks, 1.9 ms dequantized into a float chunk then
// at::mm), so its weights are dequantized (the same floats) a chunk of output rows at a time
// into a scratch buffer and multiplied by at::mm, as a float32 model's prefill is. Such rows'
// sums follow the GEMM's order, not the one above; decode steps, verifies and batches of
// those keep the kernel (their rows per sequence stay below kGemmRows).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

// ggml's type ids (gguf.GGMLQuantizationType)
enum Format : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

constexpr int64_t kWeights = 32;  // weights per block
constexpr int kMaxRows = 8;       // rows of x that share one dequantization
constexpr int64_t kGemmRows = 32;  // rows of one sequence from which a product is a GEMM

int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case F32: return 128;
    case F16: return 64;
    case BF16: return 64;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// AVX-512: a block is two registers of 16 floats.
#define LEAPFX_BLOCKS_AVX512 1
typedef __m512 reg;
constexpr int kRegs = 2;
inline reg set1(float v) { return _mm512_set1_ps(v); }
inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
inline reg loadu(const float* x) { return _mm512_loadu_ps(x); }
inline reg fmadd(reg a, const float* x, reg acc) { return _mm512_fmadd_ps(a, loadu(x), acc); }
inline reg zero() { return _mm512_setzero_ps(); }
inline void storeu(float* p, reg v) { _mm512_storeu_ps(p, v); }
#else
// AVX2: a block is four registers of 8 floats.
typedef __m256 reg;
constexpr int kRegs = 4;
inline reg set1(float v) { return _mm256_set1_ps(v); }
inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
inline reg loadu(const float* x) { return _mm256_loadu_ps(x); }
inline reg fmadd(reg a, const float* x, reg acc) { return _mm256_fmadd_ps(a, loadu(x), acc); }
inline reg zero() { return _mm256_setzero_ps(); }
inline void storeu(float* p, reg v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kLanes = 32 / kRegs;  // floats per register

// An empty asm that the compiler must treat as changing v: no multiply-add is fused across it.
inline reg opaque(reg v) {
  asm("" : "+v"(v));
  return v;
}

// 16 bytes -> the registers of their values as floats (signed or not), in byte order.
template <bool Signed>
inline void bytes_to_ps(__m128i b, reg* w) {
#ifdef LEAPFX_BLOCKS_AVX512
  w[0] = _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m128i h = _mm_srli_si128(b, 8);
  w[0] = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  w[1] = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
#endif
}

// The 32 weights of one block into w[0 .. kRegs - 1], in order.
template <int64_t FMT>
inline void dequant(const uint8_t* b, reg w[kRegs]) {
  constexpr int kHalf = kRegs / 2;  // registers per 16 weights
#ifdef LEAPFX_BLOCKS_AVX512
  if constexpr (FMT == Q4_0 || FMT == Q4_1) {
    // A 4-bit block has 16 possible weights: one register holds them all (table[v] = d * v + m,
    // or d * (v - 8)), and each 16 weights are one permute of it by their nibbles. The table's
    // floats are the ones below (d * v is exact, so rounding d * v + m once, as the fused
    // multiply-add does, or twice, as numpy does, gives one float), at 5 vector instructions
    // a block instead of 10.
    const __m512 v = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = FMT == Q4_1
        ? _mm512_fmadd_ps(set1(half(b)), v, set1(half(b + 2)))
        : _mm512_mul_ps(set1(half(b)), _mm512_sub_ps(v, set1(8.0f)));
    // vpermps reads bits 0..3 of each index: the low nibble as it is, the high one shifted
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (FMT == Q4_1 ? 4 : 2))));
    w[0] = _mm512_permutexvar_ps(q, table);                         // weights 0..15
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);  // weights 16..31
    return;
  }
#endif
  if constexpr (FMT == Q4_0 || FMT == Q4_1) {
    const int off = FMT == Q4_1 ? 4 : 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask);                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);  // weights 16..31
    if constexpr (FMT == Q4_0) {
      const __m128i eight = _mm_set1_epi8(8);
      bytes_to_ps<true>(_mm_sub_epi8(lo, eight), w);
      bytes_to_ps<true>(_mm_sub_epi8(hi, eight), w + kHalf);
    } else {
      bytes_to_ps<false>(lo, w);
      bytes_to_ps<false>(hi, w + kHalf);
    }
    const reg d = set1(half(b));
    if constexpr (FMT == Q4_1) {
      const reg m = set1(half(b + 2));
      for (int j = 0; j < kRegs; ++j) w[j] = add(opaque(mul(d, w[j])), m);
    } else {
      for (int j = 0; j < kRegs; ++j) w[j] = mul(d, w[j]);
    }
  } else if constexpr (FMT == Q8_0) {
    const reg d = set1(half(b));
    for (int j = 0; j < 2; ++j)
      bytes_to_ps<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j)),
                        w + j * kHalf);
    for (int j = 0; j < kRegs; ++j) w[j] = mul(w[j], d);
  } else if constexpr (FMT == F16) {
#ifdef LEAPFX_BLOCKS_AVX512
    for (int j = 0; j < 2; ++j)
      w[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j)));
#else
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
#endif
  } else if constexpr (FMT == BF16) {
#ifdef LEAPFX_BLOCKS_AVX512
    for (int j = 0; j < 2; ++j) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j));
      w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#else
    for (int j = 0; j < 4; ++j) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j));
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#endif
  } else {  // F32
    for (int j = 0; j < kRegs; ++j) w[j] = loadu(reinterpret_cast<const float*>(b) + kLanes * j);
  }
}

// The lanes of a summed in a fixed order (halves, then halves of those ...).
inline float hsum(reg a) {
  alignas(64) float t[kLanes];
  storeu(t, a);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

// y[r, n + i] = x[r, :] . W[n + i, :] for i < NW output rows and r < R rows of x.
template <int64_t FMT, int R, int NW>
inline void rows_dot(const uint8_t* W, int64_t row_bytes, int64_t blocks, const float* x,
                     int64_t ldx, float* y, int64_t ldy) {
  constexpr int64_t bb = FMT == F32 ? 128 : FMT == F16 || FMT == BF16 ? 64
                                          : FMT == Q4_0 ? 18 : FMT == Q4_1 ? 20 : 34;
  reg acc[NW][R];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = zero();
  // Fully unrolled over the NW rows and R rows (the accumulators stay in registers; GCC
  // otherwise keeps them in memory and loops).
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* xb = x + blk * kWeights;
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) {
      reg w[kRegs];
      dequant<FMT>(W + i * row_bytes + blk * bb, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < kRegs; ++j)
          acc[i][r] = fmadd(w[j], xb + r * ldx + kLanes * j, acc[i][r]);
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < R; ++r) y[r * ldy + i] = hsum(acc[i][r]);
}

// R rows of x over output rows n0 .. n1 - 1, NW at a time, the rest one by one.
template <int64_t FMT, int R>
void rows_span(const uint8_t* W, int64_t row_bytes, int64_t blocks, const float* x, int64_t ldx,
               float* y, int64_t ldy, int64_t n0, int64_t n1) {
#ifdef LEAPFX_BLOCKS_AVX512  // 32 registers: more output rows at once
  constexpr int NW = R <= 2 ? 8 : R <= 4 ? 4 : 2;
#else  // 16 registers
  constexpr int NW = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;
#endif
  int64_t n = n0;
  for (; n + NW <= n1; n += NW)
    rows_dot<FMT, R, NW>(W + n * row_bytes, row_bytes, blocks, x, ldx, y + n, ldy);
  for (; n < n1; ++n)
    rows_dot<FMT, R, 1>(W + n * row_bytes, row_bytes, blocks, x, ldx, y + n, ldy);
}

template <int64_t FMT>
void group(int R, const uint8_t* W, int64_t row_bytes, int64_t blocks, const float* x,
           int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  switch (R) {
    case 8: rows_span<FMT, 8>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 7: rows_span<FMT, 7>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 6: rows_span<FMT, 6>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 5: rows_span<FMT, 5>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 4: rows_span<FMT, 4>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 3: rows_span<FMT, 3>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    case 2: rows_span<FMT, 2>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
    default: rows_span<FMT, 1>(W, row_bytes, blocks, x, ldx, y, ldy, n0, n1); break;
  }
}

template <int64_t FMT>
void dequant_rows(const uint8_t* W, int64_t row_bytes, int64_t blocks, float* out, int64_t n0,
                  int64_t n1) {
  constexpr int64_t bb = FMT == F32 ? 128 : FMT == F16 || FMT == BF16 ? 64
                                          : FMT == Q4_0 ? 18 : FMT == Q4_1 ? 20 : 34;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      reg w[kRegs];
      dequant<FMT>(W + n * row_bytes + blk * bb, w);
      float* o = out + (n * blocks + blk) * kWeights;
      for (int j = 0; j < kRegs; ++j) storeu(o + kLanes * j, w[j]);
    }
}

// Output rows n0 .. n1 - 1 of W [N, K] in blocks of fmt, dequantized into out [n1 - n0, K].
void dequant_span(const uint8_t* W, int64_t fmt, int64_t K, float* out, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kWeights, row_bytes = blocks * block_bytes(fmt);
  const uint8_t* w = W + n0 * row_bytes;
  const int64_t n = n1 - n0;
  switch (fmt) {
    case Q4_1: dequant_rows<Q4_1>(w, row_bytes, blocks, out, 0, n); break;
    case Q8_0: dequant_rows<Q8_0>(w, row_bytes, blocks, out, 0, n); break;
    case Q4_0: dequant_rows<Q4_0>(w, row_bytes, blocks, out, 0, n); break;
    case F16: dequant_rows<F16>(w, row_bytes, blocks, out, 0, n); break;
    case BF16: dequant_rows<BF16>(w, row_bytes, blocks, out, 0, n); break;
    default: dequant_rows<F32>(w, row_bytes, blocks, out, 0, n); break;
  }
}

// Floats a GEMM's chunk of dequantized weights holds at most (4 MB): a layer's weights are one
// chunk each, so their product is at::mm's over the whole dequantized weight, bitwise a float32
// model's; a vocabulary head goes a slice of rows at a time.
constexpr int64_t kGemmChunkFloats = 1 << 20;

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T as float32 GEMM over W
// dequantized a chunk of output rows at a time (the prefill path, see kGemmRows). The chunks
// depend on N and K only, so a product's numbers do not depend on the caller.
void gemm_blocks(const float* x, int64_t ldx, int64_t M, const uint8_t* W, int64_t fmt,
                 int64_t K, int64_t N, float* y, int64_t ldy) {
  const int64_t chunk = std::max<int64_t>(16, kGemmChunkFloats / K / 16 * 16);
  thread_local std::vector<float> scratch;
  scratch.resize(std::min(N, chunk) * K);
  const at::Tensor xt =
      at::from_blob(const_cast<float*>(x), {M, K}, {ldx, 1}, at::TensorOptions(at::kFloat));
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t c1 = std::min(N, c0 + chunk);
    float* s = scratch.data();
    at::parallel_for(c0, c1, 16, [&](int64_t a, int64_t b) {
      dequant_span(W, fmt, K, s + (a - c0) * K, a, b);
    });
    const at::Tensor wt = at::from_blob(s, {c1 - c0, K}, at::TensorOptions(at::kFloat));
    at::Tensor yt = at::from_blob(y + c0, {M, c1 - c0}, {ldy, 1}, at::TensorOptions(at::kFloat));
    at::mm_out(yt, xt, wt.t());
  }
}

// Output rows a chunk of the weight holds so that they are still in L2 when the next group of
// kMaxRows rows of x reads them (over more rows than one group: a batch, a prefill).
constexpr int64_t kChunkBytes = 256 * 1024;

// Output rows n0 .. n1 - 1 of y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W
// [N, K] in blocks of fmt: one thread's share of a product.
void span_blocks(const float* x, int64_t ldx, int64_t M, const uint8_t* W, int64_t fmt,
                 int64_t K, float* y, int64_t ldy, int64_t a, int64_t b) {
  const int64_t blocks = K / kWeights, row_bytes = blocks * block_bytes(fmt);
  const int64_t chunk = M <= kMaxRows ? b - a
                                      : std::max<int64_t>(8, kChunkBytes / row_bytes / 8 * 8);
  for (int64_t c0 = a; c0 < b; c0 += chunk) {
    const int64_t c1 = std::min(b, c0 + chunk);
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
      const float* xm = x + m * ldx;
      float* ym = y + m * ldy;
      switch (fmt) {
        case Q4_1: group<Q4_1>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
        case Q8_0: group<Q8_0>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
        case Q4_0: group<Q4_0>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
        case F16: group<F16>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
        case BF16: group<BF16>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
        default: group<F32>(R, W, row_bytes, blocks, xm, ldx, ym, ldy, c0, c1); break;
      }
    }
  }
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W [N, K] in blocks of fmt;
// seq_rows: the rows of one sequence among M (kGemmRows or more: a prefill, see gemm_blocks).
void matmul_blocks(const float* x, int64_t ldx, int64_t M, const uint8_t* W, int64_t fmt,
                   int64_t K, int64_t N, float* y, int64_t ldy, int64_t seq_rows) {
  if (seq_rows >= kGemmRows) return gemm_blocks(x, ldx, M, W, fmt, K, N, y, ldy);
  // Grain: 32 output rows per task at least, so that tiny products stay on one thread.
  at::parallel_for(0, N, 32, [&](int64_t a, int64_t b) {
    span_blocks(x, ldx, M, W, fmt, K, y, ldy, a, b);
  });
}

// Weights of one format and K side by side (q | k | v, gate | up), each as the file holds it:
// part p's output rows go to its own columns y + p's offset. One parallel region for all of
// them (each row computed as matmul_blocks computes it).
struct Part {
  const uint8_t* W;
  int64_t n;
  float* y;
};

void matmul_parts(const float* x, int64_t ldx, int64_t M, const std::vector<Part>& parts,
                  int64_t fmt, int64_t K, int64_t ldy, int64_t seq_rows) {
  if (seq_rows >= kGemmRows) {  // each part as block_mm computes it alone
    for (const Part& p : parts) gemm_blocks(x, ldx, M, p.W, fmt, K, p.n, p.y, ldy);
    return;
  }
  int64_t N = 0;
  for (const Part& p : parts) N += p.n;
  at::parallel_for(0, N, 32, [&](int64_t a, int64_t b) {
    int64_t off = 0;
    for (const Part& p : parts) {
      const int64_t lo = std::max(a, off), hi = std::min(b, off + p.n);
      if (lo < hi) span_blocks(x, ldx, M, p.W, fmt, K, p.y, ldy, lo - off, hi - off);
      off += p.n;
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t n, int64_t k,
           const char* op) {
  TORCH_CHECK(block_bytes(fmt) > 0, op, ": format ", fmt,
              " is not one of F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q8_0 (8), BF16 (30)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1 &&
                  w.stride(0) == w.size(1),
              op, ": blocks must be a contiguous uint8 [N, K / 32 * block bytes]");
  TORCH_CHECK(k > 0 && k % kWeights == 0, op, ": K=", k, " must be a positive multiple of 32");
  TORCH_CHECK(n > 0 && w.size(0) == n && w.size(1) == k / kWeights * block_bytes(fmt), op,
              ": blocks ", w.sizes(), " do not hold [", n, ", ", k, "] in format ", fmt);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": x [..., ", x.size(-1),
              "] does not match K=", k);
}

// The rows of one sequence in x [..., K]: its second-to-last size (1 for one vector).
int64_t sequence_rows(const at::Tensor& x) { return x.dim() >= 2 ? x.size(-2) : 1; }

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// x [..., K] @ W.T -> [..., N], W [N, K] in blocks of fmt.
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t n, int64_t k) {
  check(x, w, fmt, n, k, "leapfx_cpu::block_mm");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / k;
  at::Tensor y = at::empty(out_shape(x, n), x.options());
  if (M > 0)
    matmul_blocks(xc.data_ptr<float>(), k, M, w.data_ptr<uint8_t>(), fmt, k, n,
                  y.data_ptr<float>(), n, sequence_rows(x));
  return y;
}

// y [M, k_out] = down(silu(x @ gate.T) * (x @ up.T)) for x [M, K] (contiguous): gate and up
// [I, K] in fmt_gu, down [k_out, I] in fmt_down.
void gated_mlp_rows(const float* x, int64_t M, int64_t K, const uint8_t* w_gate,
                    const uint8_t* w_up, int64_t fmt_gu, int64_t I, const uint8_t* w_down,
                    int64_t fmt_down, int64_t k_out, float* y, int64_t seq_rows) {
  std::vector<float> gu(M * 2 * I);
  float* g = gu.data();
  matmul_parts(x, K, M, {{w_gate, I, g}, {w_up, I, g + I}}, fmt_gu, K, 2 * I, seq_rows);
  for (int64_t m = 0; m < M; ++m) {  // silu(gate) * up, into the gate half
    float* row = g + m * 2 * I;
    leapfx_vec::silu_mul(row, row + I, I);
  }
  matmul_blocks(g, 2 * I, M, w_down, fmt_down, I, k_out, y, k_out, seq_rows);
}

// down(silu(x @ gate.T) * (x @ up.T)): gate and up [I, K] in fmt_gu, down [k_out, I] in
// fmt_down (each as the file holds it: no copy to put gate and up side by side).
at::Tensor block_gated_mlp(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                           int64_t fmt_gu, int64_t I, const at::Tensor& w_down, int64_t fmt_down,
                           int64_t k_out) {
  const int64_t K = x.size(-1);
  check(x, w_gate, fmt_gu, I, K, "leapfx_cpu::block_gated_mlp (gate)");
  check(x, w_up, fmt_gu, I, K, "leapfx_cpu::block_gated_mlp (up)");
  check(at::empty({1, I}, x.options()), w_down, fmt_down, k_out, I,
        "leapfx_cpu::block_gated_mlp (down)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  at::Tensor y = at::empty(out_shape(x, k_out), x.options());
  if (M == 0) return y;
  gated_mlp_rows(xc.data_ptr<float>(), M, K, w_gate.data_ptr<uint8_t>(),
                 w_up.data_ptr<uint8_t>(), fmt_gu, I, w_down.data_ptr<uint8_t>(), fmt_down,
                 k_out, y.data_ptr<float>(), sequence_rows(x));
  return y;
}

// W [N, K] in blocks of fmt -> float32 [N, K]: the kernels' own dequantization.
at::Tensor block_dequantize(const at::Tensor& w, int64_t fmt, int64_t n, int64_t k) {
  check(at::empty({1, k}, at::kFloat), w, fmt, n, k, "leapfx_cpu::block_dequantize");
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t b) {
    dequant_span(W, fmt, k, o + a * k, a, b);
  });
  return out;
}

// Rows index [T] of W [N, K] in blocks, dequantized: an embedding lookup, [T, K].
at::Tensor block_rows(const at::Tensor& w, int64_t fmt, int64_t n, int64_t k,
                      const at::Tensor& index) {
  check(at::empty({1, k}, at::kFloat), w, fmt, n, k, "leapfx_cpu::block_rows");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.device().is_cpu(),
              "leapfx_cpu::block_rows: index must be int64 on the CPU");
  const at::Tensor ic = index.contiguous();
  const int64_t T = ic.numel();
  std::vector<int64_t> shape(ic.sizes().begin(), ic.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::kFloat);
  const int64_t blocks = k / kWeights, row_bytes = blocks * block_bytes(fmt);
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < n, "leapfx_cpu::block_rows: index ", ip[t],
                " is outside 0 .. ", n - 1);
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* row = W + ip[t] * row_bytes;
    float* dst = o + t * k;
    switch (fmt) {
      case Q4_1: dequant_rows<Q4_1>(row, row_bytes, blocks, dst, 0, 1); break;
      case Q8_0: dequant_rows<Q8_0>(row, row_bytes, blocks, dst, 0, 1); break;
      case Q4_0: dequant_rows<Q4_0>(row, row_bytes, blocks, dst, 0, 1); break;
      case F16: dequant_rows<F16>(row, row_bytes, blocks, dst, 0, 1); break;
      case BF16: dequant_rows<BF16>(row, row_bytes, blocks, dst, 0, 1); break;
      default: dequant_rows<F32>(row, row_bytes, blocks, dst, 0, 1); break;
    }
  }
  return out;
}

// ---- one Llama decoder layer over blocks (decode and verify calls) -------------------------

// HF's rotary for the rows of x (row (b, s) at x + (b * S + s) * ldx, its heads D apart) into
// out (head h of row (b, s) at out + b * ob + h * oh + s * os): t * cos + rotate_half(t) * sin,
// the products rounded before the sum, as leapfx_cpu::rope (cpu_gemm.cpp) computes it.
__attribute__((optimize("fp-contract=off"))) void rope_rows(
    const float* x, int64_t ldx, int64_t B, int64_t S, int64_t heads, int64_t D,
    const float* cos, const float* sin, float* out, int64_t ob, int64_t oh, int64_t os) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        const float* t = x + (b * S + s) * ldx + h * D;
        const float* c = cos + (b * S + s) * D;
        const float* n = sin + (b * S + s) * D;
        float* o = out + b * ob + h * oh + s * os;
        leapfx_vec::rope_row(t, c, n, o, D);
      }
}

// A Llama decoder layer (no biases, SiLU gating, plain causal attention) for hidden states h
// [B, S, H] at positions [S] over the cache buffers k_cache, v_cache [B, Hkv, max_len, D]:
//   x = rms_norm(h); q, k, v = x @ [wq | wk | wv].T; q, k = rope(q, k); the cache's slots
//   start .. start + S - 1 <- k, v; a = attention(q, slots 0 .. start + S - 1);
//   h1 = h + a @ wo.T; out = h1 + down(silu(rms_norm(h1) @ gate.T) * (... @ up.T))
// Each step is the computation of the op the eager layer calls for it (leapfx_vec::rms_norm,
// these products, leapfx_cpu::rope's arithmetic, leapfx_cpu::attention itself), so the result
// equals the eager layer's bitwise; one call instead of ~10 and the Python between them.
// With starts [B] (a batch's ragged rows, runtime.rows.RowKVCache): row b's keys and values go
// to slots starts[b] .., and its query s reads slots first[b] .. starts[b] + s through
// leapfx_cpu::attention_rows, as the eager layer's attention does over such a cache; start and
// positions are then unused.
at::Tensor block_decoder_layer(
    const at::Tensor& h, const at::Tensor& norm_in, double eps_in, double offset_in,
    const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv, int64_t fmt_qkv,
    const at::Tensor& wo, int64_t fmt_o, const at::Tensor& norm_post, double eps_post,
    double offset_post, const at::Tensor& w_gate, const at::Tensor& w_up, int64_t fmt_gu,
    int64_t I, const at::Tensor& w_down, int64_t fmt_down, at::Tensor& k_cache,
    at::Tensor& v_cache, int64_t start, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, double scale, const c10::optional<at::Tensor>& starts,
    const c10::optional<at::Tensor>& first) {
  const char* op = "leapfx_cpu::block_decoder_layer";
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat && h.device().is_cpu(), op,
              ": h must be float32 [B, S, H] on the CPU, got ", h.sizes());
  const int64_t B = h.size(0), S = h.size(1), H = h.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              op, ": k_cache, v_cache must be float32 [B, Hkv, max_len, D], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(3);
  const bool ragged = starts.has_value();
  std::vector<int64_t> at_(B, start);  // each row's first new slot
  if (ragged) {
    TORCH_CHECK(first.has_value(), op, ": starts needs first (each row's first real slot)");
    for (const at::Tensor* t : {&*starts, &*first})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong &&
                      t->device().is_cpu(), op, ": starts and first must be [", B,
                  "] int64 on the CPU, got ", t->sizes());
    const at::Tensor sc = starts->contiguous();
    std::copy(sc.data_ptr<int64_t>(), sc.data_ptr<int64_t>() + B, at_.begin());
  }
  int64_t end = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(at_[b] >= 0 && at_[b] + S <= k_cache.size(2), op, ": row ", b, "'s slots ",
                at_[b], " .. ", at_[b] + S - 1, " outside the cache's ", k_cache.size(2));
    end = std::max(end, at_[b] + S);
  }
  const int64_t nq = wq.size(0), nkv = Hkv * D, Hq = nq / D;
  check(h, wq, fmt_qkv, nq, H, op);
  check(h, wk, fmt_qkv, nkv, H, op);
  check(h, wv, fmt_qkv, nkv, H, op);
  TORCH_CHECK(nq % D == 0 && D % 2 == 0 && Hq % Hkv == 0, op, ": q rows ", nq, ", ", Hkv,
              " kv heads of ", D);
  check(at::empty({1, nq}, h.options()), wo, fmt_o, H, nq, op);
  check(h, w_gate, fmt_gu, I, H, op);
  check(h, w_up, fmt_gu, I, H, op);
  check(at::empty({1, I}, h.options()), w_down, fmt_down, H, I, op);
  for (const at::Tensor* w : {&norm_in, &norm_post})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == H && w->scalar_type() == at::kFloat, op,
                ": norm weights must be float32 [", H, "]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == B &&
                  cos.size(1) == S && cos.size(2) == D && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              op, ": cos, sin [", B, ", ", S, ", ", D, "] float32 expected, got ", cos.sizes());
  const at::Tensor hc = h.contiguous(), c = cos.contiguous(), n = sin.contiguous();
  const at::Tensor nin = norm_in.contiguous(), npost = norm_post.contiguous();
  const int64_t M = B * S, nqkv = nq + 2 * nkv;
  const float* hp = hc.data_ptr<float>();
  std::vector<float> x(M * H), qkv(M * nqkv);
  for (int64_t m = 0; m < M; ++m)
    leapfx_vec::rms_norm(hp + m * H, nin.data_ptr<float>(), H, eps_in, offset_in,
                         x.data() + m * H);
  float* qp = qkv.data();
  matmul_parts(x.data(), H, M,
               {{wq.data_ptr<uint8_t>(), nq, qp}, {wk.data_ptr<uint8_t>(), nkv, qp + nq},
                {wv.data_ptr<uint8_t>(), nkv, qp + nq + nkv}},
               fmt_qkv, H, nqkv, S);
  // q [B, Hq, S, D]; k, v straight into the cache's slots start ..
  at::Tensor q = at::empty({B, Hq, S, D}, h.options());
  rope_rows(qp, nqkv, B, S, Hq, D, c.data_ptr<float>(), n.data_ptr<float>(), q.data_ptr<float>(),
            Hq * S * D, S * D, D);
  for (int64_t b = 0; b < B; ++b) {  // row b's keys and values into slots at_[b] ..
    float* kp = k_cache.data_ptr<float>() + b * k_cache.stride(0) + at_[b] * k_cache.stride(2);
    rope_rows(qp + b * S * nqkv + nq, nqkv, 1, S, Hkv, D, c.data_ptr<float>() + b * S * D,
              n.data_ptr<float>() + b * S * D, kp, 0, k_cache.stride(1), k_cache.stride(2));
    float* vp = v_cache.data_ptr<float>() + b * v_cache.stride(0) + at_[b] * v_cache.stride(2);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t g = 0; g < Hkv; ++g)
        std::memcpy(vp + g * v_cache.stride(1) + s * v_cache.stride(2),
                    qp + (b * S + s) * nqkv + nq + nkv + g * D, D * sizeof(float));
  }
  const at::Tensor keys = k_cache.narrow(2, 0, end), values = v_cache.narrow(2, 0, end);
  at::Tensor a;
  if (ragged) {
    static const auto attention_rows =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("leapfx_cpu::attention_rows", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, double)>();
    at::Tensor last = at::empty({B, S}, at::kLong);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) last.data_ptr<int64_t>()[b * S + s] = at_[b] + s;
    a = attention_rows.call(q, keys, values, *first, last, scale);
  } else {
    static const auto attention =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("leapfx_cpu::attention", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double)>();
    a = attention.call(q, keys, values, positions, scale);
  }
  a = a.contiguous();  // [B, S, Hq, D]
  at::Tensor out = at::empty({B, S, H}, h.options());
  float* op_ = out.data_ptr<float>();
  std::vector<float> o(M * H);
  matmul_blocks(a.data_ptr<float>(), nq, M, wo.data_ptr<uint8_t>(), fmt_o, nq, H, o.data(), H,
                S);
  for (int64_t i = 0; i < M * H; ++i) op_[i] = hp[i] + o[i];  // h1, the residual
  for (int64_t m = 0; m < M; ++m)
    leapfx_vec::rms_norm(op_ + m * H, npost.data_ptr<float>(), H, eps_post, offset_post,
                         x.data() + m * H);
  gated_mlp_rows(x.data(), M, H, w_gate.data_ptr<uint8_t>(), w_up.data_ptr<uint8_t>(), fmt_gu, I,
                 w_down.data_ptr<uint8_t>(), fmt_down, H, o.data(), S);
  for (int64_t i = 0; i < M * H; ++i) op_[i] = op_[i] + o[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  LEAPFX_CPU_OP(m, block_mm, "(Tensor x, Tensor w, int fmt, int n, int k) -> Tensor");
  LEAPFX_CPU_OP(m, block_gated_mlp, "(Tensor x, Tensor w_gate, Tensor w_up, int fmt_gu, int i, "
      "Tensor w_down, int fmt_down, int k_out) -> Tensor");
  LEAPFX_CPU_OP(m, block_dequantize, "(Tensor w, int fmt, int n, int k) -> Tensor");
  LEAPFX_CPU_OP(m, block_rows, "(Tensor w, int fmt, int n, int k, Tensor index) -> Tensor");
  LEAPFX_CPU_OP(m, block_decoder_layer, "(Tensor h, Tensor norm_in, float eps_in, float offset_in, "
      "Tensor wq, Tensor wk, Tensor wv, int fmt_qkv, Tensor wo, int fmt_o, Tensor norm_post, "
      "float eps_post, float offset_post, Tensor w_gate, Tensor w_up, int fmt_gu, int i, "
      "Tensor w_down, int fmt_down, Tensor(a!) k_cache, Tensor(b!) v_cache, int start, "
      "Tensor cos, Tensor sin, Tensor positions, float scale, Tensor? starts=None, "
      "Tensor? first=None) -> Tensor");
}
