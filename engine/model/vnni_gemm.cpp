// y = x Wᵀ for low-bit weights on AVX-512 VNNI, the activations quantized per group of 32
// inputs to int8 with a remainder:
//
// - sluice::int4_gemm: int4 weights in PyTorch's AVX-512 CPU pack (4-bit codes, a scale and
//   a zero per group of 32 inputs);
// - sluice::int8_gemm: int8 weights [out, in] with a scale per output row (PyTorch's
//   _weight_int8pack_mm layout).
//
// PyTorch's own low-bit kernels convert every weight to float and cost as much per input
// row as a matrix-vector product. Here a group's 32 weights meet the row's 32 int8
// activations in eight vpdpbusd instructions, and each weight vector, once unpacked, serves
// every row of a tile, so many rows cost little more than one. For a group g and output n:
//
//   int4: y[m, n] = Σ_g s[g, n]·a[m, g]·Σ_k q[n, k]·x̂[m, k]  +  (z[g, n] - 8·s[g, n])·Σ_k x[m, k]
//   int8: y[m, n] = s[n]·Σ_g a[m, g]·Σ_k w[n, k]·x̂[m, k]
//
// with the int4 weight (q - 8)·s + z (q in 0..15) and the activation x = a·x̂, x̂ = c + f/256:
// c = round(x / a) in -127..127 with a = max|x| / 127 over the group, f in -128..127 the
// rounded remainder. c alone moved the default model's logprobs by up to 0.95 (an outlier
// channel leaves the rest of its group few levels); with f the activations keep about 15
// bits and Σ w·(256c + f) stays exact in int32. The int4 sum of x is taken exactly.
//
// vpdpbusd multiplies unsigned bytes by signed ones, four to a 32-bit lane. int4 codes are
// the unsigned side. For int8 weights the activations are, as c + 128 and f + 128, and the
// kernel takes 128·257·Σ_k w[n, k] back out of each group.
//
// Weight vectors hold 16 outputs, one a lane, 4 consecutive inputs each. The int4 pack keeps
// 64 outputs per block as [K][32] bytes (the low nibble of byte j is output j, the high
// nibble output j + 32); one vpermt2b gathers such a vector's bytes. int8 rows are
// transposed 16 at a time, 64 inputs each, once, when the layer is built (int8_pack).
//
// int4_gemm is batch invariant: y[m, n] has the same bits whatever the call's other rows
// hold and however many there are, so a sequence's logits do not depend on what it was
// scheduled with, and prefill and decode share the kernel at every row count. Its integer
// sums are exact in any order; the float work per row, output and group is one fixed
// sequence, in group order: acc = fma(float(Σ q·(256c + f)), s·(a / 256), acc), then
// acc = fma(z - 8 s, Σ x, acc). Two paths compute it:
//
// - below kWideFrom rows, the few-rows tiles: kTile rows, 32 outputs (one row: 64), each
//   weight vector unpacked from the pack (vpermt2b and nibble masks) for its tile, c and f
//   met in separate vpdpbusd sums. Unpacking as it goes costs little where the rows are few, and nothing is
//   written before the products start.
// - from kWideFrom rows, the many-rows tiles. A task's 48 outputs are unpacked once into
//   vpdpwssd's layout (two inputs' codes a lane as int16, s and z - 8 s as floats) and each
//   row's 256 c + f stored as int16 pairs, so one vpdpwssd takes a pair of inputs for 16
//   outputs: as many instructions as PyTorch's bfloat16 GEMM spends in vdpbf16ps, and the
//   inner loop is nothing else. A tile of 4 rows by 48 outputs keeps its 12 integer sums and
//   12 float accumulators in registers across all groups; it is written in asm because
//   GCC 12 spills such accumulators or copies them between registers every step. Tasks are
//   (48 outputs) x (32 rows), panel-major, so each thread unpacks a panel once and both
//   threads share the work however few panels there are. The per-group epilogue (cvt, mul,
//   two fma per 16 outputs) shares the FMA pipes with vpdpwssd, which puts the floor about
//   3/16 above the bfloat16 GEMM. The activations are quantized 16 groups at a time, with
//   each group's operations unchanged (the reductions pair lanes as _mm512_reduce_max_ps and
//   _mm512_reduce_add_ps do). 256 c + f leaves int16 only for c = -128, which a non-finite
//   group or one of subnormal inputs makes; such rows are recomputed on the few-rows path,
//   as they are when alone.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <cpuid.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // inputs per scale, in the weights and the activations
constexpr int64_t kBlock = 64;  // output rows per block of the pack
constexpr int kTile = 4;        // int4: input rows that share each unpacked weight vector
constexpr int kTile8 = 8;       // int8: the same, with half the accumulators a row

struct Activations {
  const int8_t* codes;  // [M, K]: c
  const int8_t* fine;   // [M, K]: f
  const float* scales;  // [M, K / 32]
  const float* sums;    // [M, K / 32]
};

__m512 load_bf16(const at::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Quantizes one group of 32 activations; returns its scale a and stores its exact sum. With
// `offset` set to 0x80 the codes are stored as unsigned bytes, c + 128 and f + 128.
float quantize_group(const at::BFloat16* x, int8_t* codes, int8_t* fine, float* sum,
                     __m128i offset) {
  __m512 lo = load_bf16(x), hi = load_bf16(x + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m512 step = _mm512_set1_ps(256.f);
  for (__m512 half : {lo, hi}) {
    __m512 scaled = _mm512_mul_ps(half, inverse);  // x / a
    __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT);
    __m512i remainder = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), step));
    __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded));
    __m128i f = _mm512_cvtsepi32_epi8(remainder);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_xor_si128(c, offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(fine), _mm_xor_si128(f, offset));
    codes += 16;
    fine += 16;
  }
  return amax / 127.f;
}

// _mm512_reduce_max_ps or _mm512_reduce_add_ps of each of v[0..15] (as `op` says), lane j
// the reduction of v[j], each with the same operations in the same order: its upper 256
// bits with its lower, then upper 128 with lower, then lane i with lane i + 2, then lane 0
// with lane 1. The 16 reductions share each step's instructions.
template <typename Op>
__m512 reduce_sixteen(const __m512 v[16], Op op) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int p = 0; p < 8; ++p)  // group 2p in 128-bit blocks 0-1, group 2p + 1 in 2-3
    halves[p] = op(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE),
                   _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44));
  for (int q = 0; q < 4; ++q)  // group 4q + b in block b
    quarters[q] = op(_mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], 0xDD),
                     _mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], 0x88));
  for (int r = 0; r < 2; ++r)  // block b: groups 8r + b, 8r + 4 + b, lanes i and i + 2
    pairs[r] = op(_mm512_shuffle_ps(quarters[2 * r], quarters[2 * r + 1], 0x44),
                  _mm512_shuffle_ps(quarters[2 * r], quarters[2 * r + 1], 0xEE));
  // block b, lane l: group 4l + b
  __m512 last = op(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                   _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, last);
}

// quantize_group for 16 consecutive groups of x, for the many-rows tiles: their scales a and
// exact sums, and 256 c + f of each input pair as two int16 in `pairs` (16 a group). Returns
// a bit for each group with a code c = -128, which 256 c + f cannot hold in int16.
uint32_t quantize_sixteen_groups(const at::BFloat16* x, float* scales, float* sums,
                                 int32_t* pairs) {
  __m512 largest[16], total[16];
  for (int j = 0; j < 16; ++j) {
    __m512 lo = load_bf16(x + kGroup * j), hi = load_bf16(x + kGroup * j + 16);
    largest[j] = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
    total[j] = _mm512_add_ps(lo, hi);
  }
  const __m512 amax = reduce_sixteen(largest, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  _mm512_storeu_ps(sums, reduce_sixteen(total, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
  const __mmask16 positive = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  alignas(64) float inverses[16];
  _mm512_store_ps(inverses, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.f), amax));
  _mm512_storeu_ps(scales, _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
  const __m512i lowest = _mm512_set1_epi32(-128), highest = _mm512_set1_epi32(127);
  uint32_t unrepresented = 0;
  for (int j = 0; j < 16; ++j) {
    const __m512 inverse = _mm512_set1_ps(inverses[j]);
    for (int h = 0; h < 2; ++h) {
      // quantize_group's operations, its int8 saturation as a clamp in int32
      __m512 scaled = _mm512_mul_ps(load_bf16(x + kGroup * j + 16 * h), inverse);
      __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT);
      __m512i remainder =
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(256.f)));
      __m512i c = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(rounded), lowest), highest);
      __m512i f = _mm512_min_epi32(_mm512_max_epi32(remainder, lowest), highest);
      if (_mm512_cmpeq_epi32_mask(c, lowest)) unrepresented |= 1u << j;
      __m256i wide = _mm512_cvtepi32_epi16(_mm512_add_epi32(_mm512_slli_epi32(c, 8), f));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 16 * j + 8 * h), wide);
    }
  }
  return unrepresented;
}

// The vpermt2b index that gathers rows 16h..16h+15 of a block, inputs k..k+3, from the
// bytes of inputs k, k+1 (first operand) and k+2, k+3 (second).
__m512i gather_index(int h) {
  alignas(64) std::array<uint8_t, 64> index;
  for (int lane = 0; lane < 16; ++lane)
    for (int j = 0; j < 4; ++j)
      index[4 * lane + j] = static_cast<uint8_t>((j / 2) * 64 + (j % 2) * 32 + 16 * h + lane);
  return _mm512_load_si512(index.data());
}

// Rows m0..m0+T-1 of y, outputs 16h..16h+15 and 32+16h..32+16h+15 of block `block` for h in
// h0..h0+H-1; `index[h]` is gather_index(h). H = 2 shares each step's loads and broadcasts
// between the halves; each (row, output) takes the same steps either way.
template <int T, int H>
void tile(const Activations& act, int64_t m0, int64_t K, const uint8_t* pack, const uint32_t* sz,
          int64_t N, int64_t block, int h0, const __m512i* index, float* y) {
  const int64_t groups = K / kGroup;
  const uint8_t* weights = pack + block * K * 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t n[H][2];
  for (int h = 0; h < H; ++h) {
    n[h][0] = block * kBlock + 16 * (h0 + h);
    n[h][1] = n[h][0] + 32;
  }
  __m512 acc[T][H][2];
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) acc[t][h][0] = acc[t][h][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[T][H][2], finer[T][H][2];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        dot[t][h][0] = dot[t][h][1] = finer[t][h][0] = finer[t][h][1] = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4) {
      const __m512i first = _mm512_loadu_si512(weights + k * 32);
      const __m512i second = _mm512_loadu_si512(weights + (k + 2) * 32);
      __m512i low[H], high[H];
      for (int h = 0; h < H; ++h) {
        const __m512i bytes = _mm512_permutex2var_epi8(first, index[h0 + h], second);
        low[h] = _mm512_and_si512(bytes, nibble);
        high[h] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      }
      for (int t = 0; t < T; ++t) {
        int32_t four, four_fine;
        std::memcpy(&four, act.codes + (m0 + t) * K + k, 4);
        std::memcpy(&four_fine, act.fine + (m0 + t) * K + k, 4);
        const __m512i x = _mm512_set1_epi32(four), f = _mm512_set1_epi32(four_fine);
        for (int h = 0; h < H; ++h) {
          dot[t][h][0] = _mm512_dpbusd_epi32(dot[t][h][0], low[h], x);
          dot[t][h][1] = _mm512_dpbusd_epi32(dot[t][h][1], high[h], x);
          finer[t][h][0] = _mm512_dpbusd_epi32(finer[t][h][0], low[h], f);
          finer[t][h][1] = _mm512_dpbusd_epi32(finer[t][h][1], high[h], f);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      __m512 scale[2], offset[2];
      for (int j = 0; j < 2; ++j) {
        __m512i packed = _mm512_loadu_si512(sz + g * N + n[h][j]);
        scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
        __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(packed, high_half));
        offset[j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale[j], zero);
      }
      for (int t = 0; t < T; ++t) {
        __m512 a = _mm512_set1_ps(act.scales[(m0 + t) * groups + g] / 256.f);
        __m512 sum = _mm512_set1_ps(act.sums[(m0 + t) * groups + g]);
        for (int j = 0; j < 2; ++j) {
          __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(dot[t][h][j], 8), finer[t][h][j]);
          __m512 products = _mm512_cvtepi32_ps(exact);
          acc[t][h][j] = _mm512_fmadd_ps(products, _mm512_mul_ps(scale[j], a), acc[t][h][j]);
          acc[t][h][j] = _mm512_fmadd_ps(offset[j], sum, acc[t][h][j]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 2; ++j) _mm512_storeu_ps(y + (m0 + t) * N + n[h][j], acc[t][h][j]);
}

// The activations of x, quantized; the tensors own what ``view`` points at.
struct QuantizedRows {
  at::Tensor codes, fine, scales, sums;
  Activations view;
};

QuantizedRows quantize_rows(const at::Tensor& x, bool unsigned_codes, int64_t padded = 0) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16");
  TORCH_CHECK(x.size(1) % kGroup == 0, "in must be a multiple of 32");
  const auto input = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = K / kGroup, rows = std::max(M, padded);
  const auto bytes = x.options().dtype(at::kChar), floats = x.options().dtype(at::kFloat);
  auto make = [&](at::TensorOptions options, int64_t columns) {  // rows past M are zeros
    auto t = at::empty({rows, columns}, options);
    t.slice(0, M).zero_();
    return t;
  };
  QuantizedRows q{make(bytes, K), make(bytes, K), make(floats, groups), make(floats, groups), {}};
  const auto* xp = input.data_ptr<at::BFloat16>();
  auto* codes = q.codes.data_ptr<int8_t>();
  auto* fine = q.fine.data_ptr<int8_t>();
  auto* scales = q.scales.data_ptr<float>();
  auto* sums = q.sums.data_ptr<float>();
  const __m128i offset = _mm_set1_epi8(unsigned_codes ? static_cast<char>(0x80) : 0);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / groups), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = m * K + g * kGroup, at = m * groups + g;
        scales[at] = quantize_group(xp + first, codes + first, fine + first, sums + at, offset);
      }
  });
  q.view = Activations{codes, fine, scales, sums};
  return q;
}

// Calls tile_of(T, m0) for the last `rows` rows, T = rows (at most Max).
template <int Max, typename Tile>
void last_tile(int64_t rows, int64_t m0, const Tile& tile_of) {
  if constexpr (Max > 0) {
    if (rows == Max) return tile_of(std::integral_constant<int, Max>{}, m0);
    last_tile<Max - 1>(rows, m0, tile_of);
  }
}

// Calls tile_of(T, m0) over M rows in tiles of T = Max rows, then the rest.
template <int Max, typename Tile>
void over_tiles(int64_t M, const Tile& tile_of) {
  int64_t m0 = 0;
  for (; m0 + Max <= M; m0 += Max) tile_of(std::integral_constant<int, Max>{}, m0);
  if (m0 < M) last_tile<Max - 1>(M - m0, m0, tile_of);
}

// Outputs 16 n16 .. 16 (n16 + V) - 1 as the wide tiles take them: w[(k / 2) V + v] holds,
// lane i, the codes of output 16 (n16 + v) + i for inputs k and k + 1 as two int16, and
// so[(2 g) V + v], so[(2 g + 1) V + v] that vector's s and z - 8 s in group g.
template <int V>
void unpack_panel(const uint8_t* pack, const uint32_t* sz, int64_t K, int64_t N, int64_t n16,
                  __m512i* w, __m512* so) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int v = 0; v < V; ++v) {
    const int64_t n = 16 * (n16 + v), block = n / kBlock, r = n % kBlock;
    // Inputs k and k + 1 are 64 adjacent bytes; byte 4 i of the vector is input k's code of
    // output n + i, byte 4 i + 2 input k + 1's, the odd bytes zeros.
    alignas(64) std::array<uint8_t, 64> at;
    for (int i = 0; i < 16; ++i) {
      at[4 * i] = static_cast<uint8_t>(r % 32 + i);
      at[4 * i + 2] = static_cast<uint8_t>(32 + r % 32 + i);
      at[4 * i + 1] = at[4 * i + 3] = 0;
    }
    const __m512i index = _mm512_load_si512(at.data());
    const int shift = r >= 32 ? 4 : 0;
    const uint8_t* bytes = pack + block * K * 32;
    for (int64_t k = 0; k < K; k += 2) {
      __m512i two = _mm512_loadu_si512(bytes + k * 32);
      __m512i codes = _mm512_and_si512(_mm512_srli_epi16(two, shift), nibble);
      w[(k / 2) * V + v] = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, index, codes);
    }
    for (int64_t g = 0; g < K / kGroup; ++g) {
      __m512i packed = _mm512_loadu_si512(sz + g * N + n);
      __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
      __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(packed, high_half));
      so[2 * g * V + v] = scale;
      so[(2 * g + 1) * V + v] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);
    }
  }
}

// Register roles in wide_tile: zmm(3 t + v) the integer sums of row t, vector v; zmm(12 + 3 t
// + v) its float accumulator; zmm24-26 the step's weight vectors, zmm27 the row's broadcast
// input pair; zmm28-31 the epilogue's a, Σx, s·a and float(sums).
#define SLUICE_IF(cond) ".if " cond "\n\t"
#define SLUICE_ENDIF ".endif\n\t"

// Row t of one input pair: its pair broadcast, times the V weight vectors.
#define SLUICE_WIDE_ROW(t, d0, d1, d2, address)                                 \
  SLUICE_IF("%c[rows] > " #t)                                                    \
  "vpbroadcastd " address ", %%zmm27\n\t"                                        \
  "vpdpwssd %%zmm24, %%zmm27, %%zmm" #d0 "\n\t"                                  \
  SLUICE_IF("%c[vecs] > 1") "vpdpwssd %%zmm25, %%zmm27, %%zmm" #d1 "\n\t" SLUICE_ENDIF \
  SLUICE_IF("%c[vecs] > 2") "vpdpwssd %%zmm26, %%zmm27, %%zmm" #d2 "\n\t" SLUICE_ENDIF \
  SLUICE_ENDIF

// One input pair for every row: x at byte `dx` past the rows' pointers, w at `dw` vectors.
#define SLUICE_WIDE_STEP(dx, dw)                                                \
  "vmovdqu64 64*" dw "(%[w]), %%zmm24\n\t"                                       \
  SLUICE_IF("%c[vecs] > 1") "vmovdqu64 64*" dw "+64(%[w]), %%zmm25\n\t" SLUICE_ENDIF \
  SLUICE_IF("%c[vecs] > 2") "vmovdqu64 64*" dw "+128(%[w]), %%zmm26\n\t" SLUICE_ENDIF \
  SLUICE_WIDE_ROW(0, 0, 1, 2, dx "(%[x0])")                                      \
  SLUICE_WIDE_ROW(1, 3, 4, 5, dx "(%[x0],%[stride],1)")                          \
  SLUICE_WIDE_ROW(2, 6, 7, 8, dx "(%[x0],%[stride],2)")                          \
  SLUICE_WIDE_ROW(3, 9, 10, 11, dx "(%[x1])")

// Vector v of row t after a group: acc = fma(float(sum), s·a, acc); acc = fma(z - 8 s, Σx, acc).
#define SLUICE_WIDE_EPILOGUE_VECTOR(v, dot, acc)                                \
  SLUICE_IF("%c[vecs] > " #v)                                                    \
  "vmulps " #v "*64(%[so]), %%zmm28, %%zmm30\n\t"                                \
  "vcvtdq2ps %%zmm" #dot ", %%zmm31\n\t"                                         \
  "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #acc "\n\t"                              \
  "vfmadd231ps %c[vecs]*64+" #v "*64(%[so]), %%zmm29, %%zmm" #acc "\n\t"        \
  SLUICE_ENDIF

#define SLUICE_WIDE_EPILOGUE_ROW(t, d0, d1, d2, a0, a1, a2)                     \
  SLUICE_IF("%c[rows] > " #t)                                                    \
  "vbroadcastss 4*" #t "(%[a]), %%zmm28\n\t"                                     \
  "vbroadcastss 4*" #t "(%[sum]), %%zmm29\n\t"                                   \
  SLUICE_WIDE_EPILOGUE_VECTOR(0, d0, a0)                                         \
  SLUICE_WIDE_EPILOGUE_VECTOR(1, d1, a1)                                         \
  SLUICE_WIDE_EPILOGUE_VECTOR(2, d2, a2)                                         \
  SLUICE_ENDIF

// The accumulator of row t, vector v to acc[t][v].
#define SLUICE_WIDE_STORE(t, v, reg)                                            \
  SLUICE_IF("%c[rows] > " #t " && %c[vecs] > " #v)                               \
  "vmovups %%zmm" #reg ", 64*(" #t "*%c[vecs]+" #v ")(%[acc])\n\t"             \
  SLUICE_ENDIF

// T <= 4 rows times 16 V <= 48 outputs over all groups, every sum and accumulator held in
// registers. x: the first row's input pairs (256 c + f of inputs k, k + 1 as two int16), a
// row every `stride` bytes; a, sum: the rows' a / 256 and Σx of group 0, the next group
// `group_stride` bytes on; w, so: unpack_panel's vectors; acc: [T][V][16] out.
// Written in asm: GCC 12 keeps so many vpdpwssd accumulators in registers only by spilling
// them or copying them between registers every step, which costs more than the products.
template <int T, int V>
void wide_tile(const int32_t* x, int64_t stride, const float* a, const float* sum,
               int64_t group_stride, const __m512i* w, const __m512* so, int64_t groups,
               float* acc) {
  static_assert(T >= 1 && T <= 4 && V >= 1 && V <= 3);
  uintptr_t x0 = reinterpret_cast<uintptr_t>(x), x1 = x0 + 3 * stride;  // x1 read if T = 4
  int64_t steps = 0;
  asm volatile(
      ".irp r, 12,13,14,15,16,17,18,19,20,21,22,23\n\t"
      "vpxord %%zmm\\r, %%zmm\\r, %%zmm\\r\n\t"
      ".endr\n\t"
      "2:\n\t"
      ".irp r, 0,1,2,3,4,5,6,7,8,9,10,11\n\t"
      "vpxord %%zmm\\r, %%zmm\\r, %%zmm\\r\n\t"
      ".endr\n\t"
      "mov $8, %[steps]\n\t"
      "1:\n\t"
      SLUICE_WIDE_STEP("0", "0")
      SLUICE_WIDE_STEP("4", "%c[vecs]")
      "add $8, %[x0]\n\t"
      "add $8, %[x1]\n\t"
      "add $128*%c[vecs], %[w]\n\t"
      "dec %[steps]\n\t"
      "jnz 1b\n\t"
      SLUICE_WIDE_EPILOGUE_ROW(0, 0, 1, 2, 12, 13, 14)
      SLUICE_WIDE_EPILOGUE_ROW(1, 3, 4, 5, 15, 16, 17)
      SLUICE_WIDE_EPILOGUE_ROW(2, 6, 7, 8, 18, 19, 20)
      SLUICE_WIDE_EPILOGUE_ROW(3, 9, 10, 11, 21, 22, 23)
      "add %[group_stride], %[a]\n\t"
      "add %[group_stride], %[sum]\n\t"
      "add $128*%c[vecs], %[so]\n\t"
      "dec %[groups]\n\t"
      "jnz 2b\n\t"
      SLUICE_WIDE_STORE(0, 0, 12) SLUICE_WIDE_STORE(0, 1, 13) SLUICE_WIDE_STORE(0, 2, 14)
      SLUICE_WIDE_STORE(1, 0, 15) SLUICE_WIDE_STORE(1, 1, 16) SLUICE_WIDE_STORE(1, 2, 17)
      SLUICE_WIDE_STORE(2, 0, 18) SLUICE_WIDE_STORE(2, 1, 19) SLUICE_WIDE_STORE(2, 2, 20)
      SLUICE_WIDE_STORE(3, 0, 21) SLUICE_WIDE_STORE(3, 1, 22) SLUICE_WIDE_STORE(3, 2, 23)
      : [x0] "+r"(x0), [x1] "+r"(x1), [w] "+r"(w), [so] "+r"(so), [a] "+r"(a), [sum] "+r"(sum),
        [groups] "+r"(groups), [steps] "+r"(steps)
      : [stride] "r"(stride), [group_stride] "r"(group_stride), [acc] "r"(acc), [rows] "i"(T),
        [vecs] "i"(V)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",
        "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30",
        "xmm31", "cc", "memory");
}

#undef SLUICE_WIDE_STORE
#undef SLUICE_WIDE_EPILOGUE_ROW
#undef SLUICE_WIDE_EPILOGUE_VECTOR
#undef SLUICE_WIDE_STEP
#undef SLUICE_WIDE_ROW
#undef SLUICE_ENDIF
#undef SLUICE_IF

constexpr int kWideRows = 4;       // rows of a wide tile
constexpr int kWideVectors = 3;    // vectors of 16 outputs in a wide tile
constexpr int64_t kWideFrom = 32;  // rows from which int4_gemm takes the wide tiles
constexpr int64_t kChunk = 32;     // rows of a task: a panel's outputs for that many rows

// int4_gemm's arithmetic for the rows of `act` with few rows: each weight vector unpacked
// with a vpermt2b per tile of kTile rows, 32 outputs at a time. One row takes a block's 64
// outputs a task, so each step's loads and broadcasts serve twice the products.
void int4_narrow(const Activations& act, int64_t M, int64_t K, const uint8_t* weights,
                 const uint32_t* szp, int64_t N, float* out) {
  const std::array<__m512i, 2> index{gather_index(0), gather_index(1)};
  const int64_t blocks = N / kBlock;
  if (M == 1) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block)
        tile<1, 2>(act, 0, K, weights, szp, N, block, 0, index.data(), out);
    });
    return;
  }
  at::parallel_for(0, 2 * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / 2;
      const int h = static_cast<int>(task % 2);
      over_tiles<kTile>(M, [&](auto rows, int64_t m0) {
        tile<decltype(rows)::value, 1>(act, m0, K, weights, szp, N, block, h, index.data(), out);
      });
    }
  });
}

// int4_gemm for many rows: the same integers and the same float epilogue, from weights
// unpacked once per panel of 48 outputs into vpdpwssd's layout.
void int4_wide(const at::Tensor& x, const uint8_t* weights, const uint32_t* szp, int64_t N,
               float* out) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / kGroup, half = K / 2;
  const auto input = x.contiguous();
  const auto* xp = input.data_ptr<at::BFloat16>();
  auto pairs_t = at::empty({M, half}, x.options().dtype(at::kInt));
  auto a_t = at::empty({groups, M}, x.options().dtype(at::kFloat));
  auto sums_t = at::empty({groups, M}, x.options().dtype(at::kFloat));
  std::vector<uint8_t> unrepresented(M * groups, 0);  // by group, as threads write them
  auto* pairs = pairs_t.data_ptr<int32_t>();
  auto* a = a_t.data_ptr<float>();
  auto* sums = sums_t.data_ptr<float>();
  // 16 groups at a time, the flat [M, K / 32] groups in order, then the last few alone
  const int64_t all = M * groups, batches = all / 16;
  auto mark = [&](int64_t group) { unrepresented[group] = 1; };
  auto place = [&](int64_t group, float scale, float sum) {
    const int64_t m = group / groups, g = group % groups;
    a[g * M + m] = scale / 256.f;
    sums[g * M + m] = sum;
  };
  at::parallel_for(0, batches + 1, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float scale[16], sum[16];
    alignas(64) int8_t codes[kGroup], fine[kGroup];
    for (int64_t batch = begin; batch < end; ++batch) {
      if (batch < batches) {
        const int64_t first = 16 * batch;
        uint32_t bad = quantize_sixteen_groups(xp + first * kGroup, scale, sum,
                                               pairs + first * (kGroup / 2));
        for (int64_t j = 0, m = first / groups, g = first % groups; j < 16; ++j) {
          a[g * M + m] = scale[j] / 256.f;
          sums[g * M + m] = sum[j];
          if (++g == groups) g = 0, ++m;
        }
        for (; bad; bad &= bad - 1) mark(first + __builtin_ctz(bad));
        continue;
      }
      for (int64_t group = 16 * batches; group < all; ++group) {
        float total;
        const float s = quantize_group(xp + group * kGroup, codes, fine, &total, _mm_setzero_si128());
        place(group, s, total);
        const __m256i c8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
        const __m256i f8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(fine));
        if (_mm256_cmpeq_epi8_mask(c8, _mm256_set1_epi8(-128))) mark(group);
        const __m512i c = _mm512_cvtepi8_epi16(c8), f = _mm512_cvtepi8_epi16(f8);
        _mm512_storeu_si512(pairs + group * (kGroup / 2),
                            _mm512_add_epi16(_mm512_slli_epi16(c, 8), f));
      }
    }
  });
  constexpr int T = kWideRows, V = kWideVectors;
  const int64_t vectors = N / 16, panels = (vectors + V - 1) / V;
  const int64_t chunks = (M + kChunk - 1) / kChunk;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> w(half * V);
    std::vector<__m512> so(2 * groups * V);
    alignas(64) float acc[T * V * 16];
    int64_t unpacked = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task / chunks, first = (task % chunks) * kChunk;
      const int64_t last = std::min(M, first + kChunk);
      const int64_t n16 = panel * V, n0 = 16 * n16;
      const int width = static_cast<int>(std::min<int64_t>(V, vectors - n16));
      auto run = [&](auto vecs) {
        constexpr int W = decltype(vecs)::value;
        if (panel != unpacked) unpack_panel<W>(weights, szp, K, N, n16, w.data(), so.data());
        unpacked = panel;
        auto tile_of = [&](auto rows, int64_t m0) {
          constexpr int R = decltype(rows)::value;
          wide_tile<R, W>(pairs + m0 * half, 4 * half, a + m0, sums + m0, 4 * M, w.data(),
                          so.data(), groups, acc);
          for (int t = 0; t < R; ++t)
            std::memcpy(out + (m0 + t) * N + n0, acc + t * W * 16, W * 16 * sizeof(float));
        };
        int64_t m0 = first;
        for (; m0 + T <= last; m0 += T) tile_of(std::integral_constant<int, T>{}, m0);
        if (m0 < last) last_tile<T - 1>(last - m0, m0, tile_of);
      };
      if (width == 3) run(std::integral_constant<int, 3>{});
      else if (width == 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    }
  });
  // Rows whose 256 c + f does not fit int16 take the narrow tiles' path, as when alone.
  for (int64_t m = 0; m < M; ++m) {
    const auto* flags = unrepresented.data() + m * groups;
    if (std::find(flags, flags + groups, 1) != flags + groups) {
      const auto q = quantize_rows(x.slice(0, m, m + 1), false);
      int4_narrow(q.view, 1, K, weights, szp, N, out + m * N);
    }
  }
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& pack, const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.size(2) == 2 &&
                  scales_and_zeros.scalar_type() == at::kBFloat16,
              "scales_and_zeros: [in / 32, out, 2] bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16");
  TORCH_CHECK(x.size(1) % kGroup == 0, "in must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = scales_and_zeros.size(1);
  TORCH_CHECK(N % kBlock == 0 && scales_and_zeros.size(0) == K / kGroup,
              "int4: out must be a multiple of 64");
  TORCH_CHECK(pack.scalar_type() == at::kByte && pack.numel() == N * K / 2, "pack: out * in / 2 bytes");
  const auto packed = pack.contiguous();
  const auto sz = scales_and_zeros.contiguous();
  const auto* weights = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (K == 0) return y.zero_();
  if (M >= kWideFrom) {
    int4_wide(x, weights, szp, N, y.data_ptr<float>());
  } else {
    const auto q = quantize_rows(x, false);
    int4_narrow(q.view, M, K, weights, szp, N, y.data_ptr<float>());
  }
  return y;
}

// Transposes 16 rows of 16 dwords: afterwards v[j] holds dword j of every row, one a lane.
void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, interleaved dword by dword
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)  // 4 rows of one dword in each 128-bit lane
    for (int j = 0; j < 2; ++j) {
      v[i + j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
      v[i + j + 2] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, a 4 x 4 transpose
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
  for (int i = 0; i < 16; i += 4) std::swap(v[i + 1], v[i + 2]);  // the 64-bit step's order
}

// Outputs n0..n0+15 of int8 rows w [N, K] as vpdpbusd takes them: vector K/4 * g + j holds
// inputs 4j..4j+3 of group g, and sums[g] each output's Σ_k w over group g.
void unpack8(const int8_t* w, int64_t K, int64_t n0, __m512i* vectors, __m512i* sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t k0 = 0; k0 < K; k0 += 2 * kGroup) {
    __m512i* v = vectors + k0 / 4;
    for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(w + (n0 + r) * K + k0);
    transpose16(v);
    for (int half = 0; half < 2; ++half) {
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) sum = _mm512_dpbusd_epi32(sum, ones, v[8 * half + j]);
      sums[k0 / kGroup + half] = sum;
    }
  }
}

// int8 weights w [N, K] as int8_gemm takes them: pack [N/16, K/4, 64] bytes, unpack8's
// vectors for each 16 outputs, and sums [N/16, K/32, 16], their Σ_k w over each group. The
// pack holds the codes once, as w does; a layer keeps it in w's place.
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "weight: [out, in] int8");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % (2 * kGroup) == 0 && N % 16 == 0,
              "int8: in must be a multiple of 64 and out of 16");
  const auto w = weight.contiguous();
  auto pack = at::empty({N / 16, K / 4, 64}, weight.options());
  auto sums = at::empty({N / 16, K / kGroup, 16}, weight.options().dtype(at::kInt));
  const auto* wp = w.data_ptr<int8_t>();
  auto* packed = reinterpret_cast<__m512i*>(pack.data_ptr<int8_t>());  // 64-byte aligned
  auto* summed = reinterpret_cast<__m512i*>(sums.data_ptr<int32_t>());
  at::parallel_for(0, N / 16, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      unpack8(wp, K, 16 * b, packed + b * (K / 4), summed + b * (K / kGroup));
    }
  });
  return {pack, sums};
}

// Rows m0..m0+T-1 of y, outputs n0..n0+16U-1, from the pack's U blocks of 16 outputs there;
// the activations' codes arrive unsigned, as c + 128 and f + 128. Each (row, output) takes
// the same integer sums and float steps whatever T and U are.
template <int T, int U>
void tile8(const Activations& act, int64_t m0, int64_t K, const __m512i* vectors,
           const __m512i* sums, const at::BFloat16* scales, int64_t N, int64_t n0, float* y) {
  const int64_t groups = K / kGroup, stride = K / 4;  // vectors of one block of 16 outputs
  const __m512i correction = _mm512_set1_epi32(128 * 257);
  __m512 acc[T][U];
  for (int t = 0; t < T; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[T][U], finer[T][U];
    for (int t = 0; t < T; ++t)
      for (int u = 0; u < U; ++u) dot[t][u] = finer[t][u] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i weights[U];
      for (int u = 0; u < U; ++u) weights[u] = _mm512_load_si512(vectors + u * stride + 8 * g + j);
      const int64_t k = g * kGroup + 4 * j;
      for (int t = 0; t < T; ++t) {
        int32_t four, four_fine;
        std::memcpy(&four, act.codes + (m0 + t) * K + k, 4);
        std::memcpy(&four_fine, act.fine + (m0 + t) * K + k, 4);
        const __m512i x = _mm512_set1_epi32(four), f = _mm512_set1_epi32(four_fine);
        for (int u = 0; u < U; ++u) {
          dot[t][u] = _mm512_dpbusd_epi32(dot[t][u], x, weights[u]);
          finer[t][u] = _mm512_dpbusd_epi32(finer[t][u], f, weights[u]);
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      const __m512i taken = _mm512_mullo_epi32(sums[u * groups + g], correction);
      for (int t = 0; t < T; ++t) {
        __m512i exact = _mm512_sub_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(dot[t][u], 8), finer[t][u]), taken);
        __m512 a = _mm512_set1_ps(act.scales[(m0 + t) * groups + g] / 256.f);
        acc[t][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), a, acc[t][u]);
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const __m512 scale = load_bf16(scales + n0 + 16 * u);
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(y + (m0 + t) * N + n0 + 16 * u, _mm512_mul_ps(acc[t][u], scale));
  }
}

// Rows m0..m0+T-1 of blocks [begin, end) of 16 outputs, U blocks a tile and then one.
template <int T, int U>
void tiles8(const Activations& act, int64_t m0, int64_t K, const __m512i* pack,
            const __m512i* sums, const at::BFloat16* scales, int64_t N, int64_t begin,
            int64_t end, float* y) {
  const int64_t stride = K / 4, groups = K / kGroup;
  int64_t b = begin;
  for (; b + U <= end; b += U)
    tile8<T, U>(act, m0, K, pack + b * stride, sums + b * groups, scales, N, 16 * b, y);
  for (; b < end; ++b)
    tile8<T, 1>(act, m0, K, pack + b * stride, sums + b * groups, scales, N, 16 * b, y);
}

// int8_gemm on AMX: the same integer sums from tile instructions, 16 rows by 16 outputs by
// one group of 32 inputs, and tile8's float epilogue, one group at a time in group order, so
// a row gets the bits the VNNI tiles give it. A tile's sums are stored to memory for every
// group (the epilogue is per group), which bounds what AMX gains: from kAmxFrom rows it
// takes about 0.7 of the VNNI tiles' time, below that more. The activations' codes are
// signed here (tdpbssd) and the pack's vectors are tiles as they are (16 outputs a row, 4
// inputs each). Tiles: 2 and 3 a group's c and f of 16 rows; 4 and 7 its weights; 0-1 and
// 5-6 the sums of c and of f, groups alternating between the two pairs.
constexpr int64_t kAmxRows = 16;   // rows of a tile
constexpr int64_t kAmxFrom = 32;   // rows from which the AMX tiles serve, where the CPU has them
constexpr int64_t kAmxChunk = 64;  // rows of a task
constexpr int64_t kAmxSums = 2 * kAmxRows * 16;  // a group's int32 sums of c, then of f

// Whether this process may run AMX's int8 tiles: the CPU has AMX-INT8, and PyTorch's
// init_amx (as engine.compiled calls it) has Linux grant the tile state.
bool amx_runs() {
  static const bool runs = [] {
    unsigned a, b, c, d;
    const bool int8 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
    return int8 && at::cpu::init_amx();
  }();
  return runs;
}

// The tiles' shapes (LDTILECFG's 64 bytes), a constant: GCC 12 does not see that
// _tile_loadconfig reads its operand, and drops the stores that would fill a local one.
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};  // per row
  uint8_t rows[16] = {};
  constexpr TileShapes() {
    for (int t : {0, 1, 5, 6}) bytes[t] = 64, rows[t] = kAmxRows;  // int32 sums
    for (int t : {2, 3}) bytes[t] = kGroup, rows[t] = kAmxRows;    // int8 rows
    for (int t : {4, 7}) bytes[t] = 64, rows[t] = kGroup / 4;      // 16 outputs x 4 inputs
  }
};
constexpr TileShapes kTileShapes;

// Group g's rows (tiles 2, 3) times its weights (tile b) into tiles c and f. The tile
// intrinsics take literal tile numbers, hence a macro.
#define SLUICE_AMX_PRODUCTS(c, f, b, g)                       \
  do {                                                        \
    _tile_loadd(2, act.codes + r0 * K + (g) * kGroup, K);     \
    _tile_loadd(3, act.fine + r0 * K + (g) * kGroup, K);      \
    _tile_loadd(b, vectors + 8 * (g), 64);                    \
    _tile_zero(c);                                            \
    _tile_zero(f);                                            \
    _tile_dpbssd(c, 2, b);                                    \
    _tile_dpbssd(f, 3, b);                                    \
  } while (0)

// Rows r0..r0+15 of act times the 16 outputs whose pack `vectors` holds: sums[g kAmxSums ...]
// Σ_k w·c of each row and output in group g, then Σ_k w·f. A group's sums are stored after
// the next group's products are issued, so the stores overlap them.
void amx_sums(const Activations& act, int64_t r0, int64_t K, const __m512i* vectors,
              int32_t* sums) {
  const int64_t groups = K / kGroup;
  SLUICE_AMX_PRODUCTS(0, 1, 4, 0);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t* at = sums + g * kAmxSums;
    if (g % 2 == 0) {
      if (g + 1 < groups) SLUICE_AMX_PRODUCTS(5, 6, 7, g + 1);
      _tile_stored(0, at, 64);
      _tile_stored(1, at + kAmxSums / 2, 64);
    } else {
      if (g + 1 < groups) SLUICE_AMX_PRODUCTS(0, 1, 4, g + 1);
      _tile_stored(5, at, 64);
      _tile_stored(6, at + kAmxSums / 2, 64);
    }
  }
}

#undef SLUICE_AMX_PRODUCTS

// Rows m0..m0+rows-1, outputs n0..n0+15: tile8's epilogue, row by row, on amx_sums' sums.
void amx_epilogue(const Activations& act, int64_t m0, int64_t rows, int64_t K,
                  const int32_t* sums, const at::BFloat16* scales, int64_t N, int64_t n0,
                  float* y) {
  const int64_t groups = K / kGroup;
  __m512 acc[kAmxRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, sums += kAmxSums)
    for (int t = 0; t < kAmxRows; ++t) {
      const __m512i c = _mm512_load_si512(sums + 16 * t);
      const __m512i f = _mm512_load_si512(sums + kAmxSums / 2 + 16 * t);
      const __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(c, 8), f);
      const __m512 a = _mm512_set1_ps(act.scales[(m0 + t) * groups + g] / 256.f);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), a, acc[t]);
    }
  const __m512 scale = load_bf16(scales + n0);
  for (int64_t t = 0; t < rows; ++t)
    _mm512_storeu_ps(y + (m0 + t) * N + n0, _mm512_mul_ps(acc[t], scale));
}

// int8_gemm where AMX runs: tasks of 16 outputs by kAmxChunk rows, the rows padded with
// zeros to whole tiles.
void int8_amx(const at::Tensor& x, const __m512i* pack, const at::BFloat16* scales, int64_t N,
              float* out) {
  const int64_t M = x.size(0), K = x.size(1), blocks = N / 16;
  const auto q = quantize_rows(x, false, (M + kAmxRows - 1) / kAmxRows * kAmxRows);
  const int64_t chunks = (M + kAmxChunk - 1) / kAmxChunk;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&kTileShapes);  // each thread's own
    const auto sums = at::empty({K / kGroup * kAmxSums}, at::kInt);  // 64-byte aligned
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, first = (task % chunks) * kAmxChunk;
      for (int64_t m0 = first; m0 < std::min(M, first + kAmxChunk); m0 += kAmxRows) {
        amx_sums(q.view, m0, K, pack + b * (K / 4), sums.data_ptr<int32_t>());
        amx_epilogue(q.view, m0, std::min(kAmxRows, M - m0), K, sums.data_ptr<int32_t>(),
                     scales, N, 16 * b, out);
      }
    }
    _tile_release();
  });
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& pack, const at::Tensor& sums,
                     const at::Tensor& scales) {
  TORCH_CHECK(pack.dim() == 3 && pack.scalar_type() == at::kChar && pack.size(2) == 64 &&
                  pack.is_contiguous(),
              "pack: int8_pack's [out/16, in/4, 64] int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16, "scales: [out] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = 16 * pack.size(0);
  TORCH_CHECK(K % (2 * kGroup) == 0, "int8: in must be a multiple of 64");
  TORCH_CHECK(pack.size(1) == K / 4 && scales.size(0) == N, "pack: [out/16, in/4, 64], scales: [out]");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.is_contiguous() &&
                  sums.sizes() == at::IntArrayRef({N / 16, K / kGroup, 16}),
              "sums: int8_pack's [out/16, in/32, 16] int32");
  const auto s = scales.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* packed = reinterpret_cast<const __m512i*>(pack.data_ptr<int8_t>());
  const auto* summed = reinterpret_cast<const __m512i*>(sums.data_ptr<int32_t>());
  const auto* sp = s.data_ptr<at::BFloat16>();
  float* out = y.data_ptr<float>();
  if (M >= kAmxFrom && amx_runs()) {
    int8_amx(x, packed, sp, N, out);
    return y;
  }
  const auto q = quantize_rows(x, true);
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    // one row reads 4 blocks' weights per activation it broadcasts; more rows share each
    if (M == 1) return tiles8<1, 4>(q.view, 0, K, packed, summed, sp, N, begin, end, out);
    over_tiles<kTile8>(M, [&](auto rows, int64_t m0) {
      tiles8<decltype(rows)::value, 1>(q.view, m0, K, packed, summed, sp, N, begin, end, out);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int4_gemm(Tensor x, Tensor pack, Tensor scales_and_zeros) -> Tensor");
  m.def("int8_pack(Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_gemm(Tensor x, Tensor pack, Tensor sums, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_gemm", &int8_gemm);
}
