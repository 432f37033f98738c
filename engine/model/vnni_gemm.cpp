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
// transposed 16 at a time, 64 inputs each.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
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

// The vpermt2b index that gathers rows 16h..16h+15 of a block, inputs k..k+3, from the
// bytes of inputs k, k+1 (first operand) and k+2, k+3 (second).
__m512i gather_index(int h) {
  alignas(64) std::array<uint8_t, 64> index;
  for (int lane = 0; lane < 16; ++lane)
    for (int j = 0; j < 4; ++j)
      index[4 * lane + j] = static_cast<uint8_t>((j / 2) * 64 + (j % 2) * 32 + 16 * h + lane);
  return _mm512_load_si512(index.data());
}

// Rows m0..m0+T-1 of y, outputs 16h..16h+15 and 32+16h..32+16h+15 of block `block`;
// `index` is gather_index(h).
template <int T>
void tile(const Activations& act, int64_t m0, int64_t K, const uint8_t* pack, const uint32_t* sz,
          int64_t N, int64_t block, int h, __m512i index, float* y) {
  const int64_t groups = K / kGroup;
  const int64_t n_low = block * kBlock + 16 * h, n_high = n_low + 32;
  const uint8_t* weights = pack + block * K * 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[T][2], finer[T][2];
    for (int t = 0; t < T; ++t)
      dot[t][0] = dot[t][1] = finer[t][0] = finer[t][1] = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4) {
      __m512i first = _mm512_loadu_si512(weights + k * 32);
      __m512i second = _mm512_loadu_si512(weights + (k + 2) * 32);
      __m512i bytes = _mm512_permutex2var_epi8(first, index, second);
      __m512i low = _mm512_and_si512(bytes, nibble);
      __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      for (int t = 0; t < T; ++t) {
        int32_t four, four_fine;
        std::memcpy(&four, act.codes + (m0 + t) * K + k, 4);
        std::memcpy(&four_fine, act.fine + (m0 + t) * K + k, 4);
        __m512i x = _mm512_set1_epi32(four), f = _mm512_set1_epi32(four_fine);
        dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], low, x);
        dot[t][1] = _mm512_dpbusd_epi32(dot[t][1], high, x);
        finer[t][0] = _mm512_dpbusd_epi32(finer[t][0], low, f);
        finer[t][1] = _mm512_dpbusd_epi32(finer[t][1], high, f);
      }
    }
    __m512 scale[2], offset[2];
    for (int j = 0; j < 2; ++j) {
      __m512i packed = _mm512_loadu_si512(sz + g * N + (j ? n_high : n_low));
      scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
      __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(packed, high_half));
      offset[j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale[j], zero);
    }
    for (int t = 0; t < T; ++t) {
      __m512 a = _mm512_set1_ps(act.scales[(m0 + t) * groups + g] / 256.f);
      __m512 sum = _mm512_set1_ps(act.sums[(m0 + t) * groups + g]);
      for (int j = 0; j < 2; ++j) {
        __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(dot[t][j], 8), finer[t][j]);
        __m512 products = _mm512_cvtepi32_ps(exact);
        acc[t][j] = _mm512_fmadd_ps(products, _mm512_mul_ps(scale[j], a), acc[t][j]);
        acc[t][j] = _mm512_fmadd_ps(offset[j], sum, acc[t][j]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    _mm512_storeu_ps(y + (m0 + t) * N + n_low, acc[t][0]);
    _mm512_storeu_ps(y + (m0 + t) * N + n_high, acc[t][1]);
  }
}

// The activations of x, quantized; the tensors own what ``view`` points at.
struct QuantizedRows {
  at::Tensor codes, fine, scales, sums;
  Activations view;
};

QuantizedRows quantize_rows(const at::Tensor& x, bool unsigned_codes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16");
  TORCH_CHECK(x.size(1) % kGroup == 0, "in must be a multiple of 32");
  const auto input = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = K / kGroup;
  const auto bytes = x.options().dtype(at::kChar), floats = x.options().dtype(at::kFloat);
  QuantizedRows q{at::empty({M, K}, bytes), at::empty({M, K}, bytes),
                  at::empty({M, groups}, floats), at::empty({M, groups}, floats), {}};
  const auto* xp = input.data_ptr<at::BFloat16>();
  auto* codes = q.codes.data_ptr<int8_t>();
  auto* fine = q.fine.data_ptr<int8_t>();
  auto* scales = q.scales.data_ptr<float>();
  auto* sums = q.sums.data_ptr<float>();
  const __m128i offset = _mm_set1_epi8(unsigned_codes ? static_cast<char>(0x80) : 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = m * K + g * kGroup, at = m * groups + g;
      scales[at] = quantize_group(xp + first, codes + first, fine + first, sums + at, offset);
    }
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

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& pack, const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.size(2) == 2 &&
                  scales_and_zeros.scalar_type() == at::kBFloat16,
              "scales_and_zeros: [in / 32, out, 2] bfloat16");
  const auto q = quantize_rows(x, false);
  const int64_t M = x.size(0), K = x.size(1), N = scales_and_zeros.size(1);
  TORCH_CHECK(N % kBlock == 0 && scales_and_zeros.size(0) == K / kGroup,
              "int4: out must be a multiple of 64");
  TORCH_CHECK(pack.scalar_type() == at::kByte && pack.numel() == N * K / 2, "pack: out * in / 2 bytes");
  const auto packed = pack.contiguous();
  const auto sz = scales_and_zeros.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* weights = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, 2 * (N / kBlock), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / 2;
      const int h = static_cast<int>(task % 2);
      const __m512i index = gather_index(h);
      over_tiles<kTile>(M, [&](auto rows, int64_t m0) {
        tile<decltype(rows)::value>(q.view, m0, K, weights, szp, N, block, h, index, out);
      });
    }
  });
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

// Rows m0..m0+T-1 of y, outputs n0..n0+15, from unpack8's vectors and the rows' scales; the
// activations' codes arrive unsigned, as c + 128 and f + 128.
template <int T>
void tile8(const Activations& act, int64_t m0, int64_t K, const __m512i* vectors,
           const __m512i* sums, const __m512 scale, int64_t N, int64_t n0, float* y) {
  const int64_t groups = K / kGroup;
  const __m512i correction = _mm512_set1_epi32(128 * 257);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[T], finer[T];
    for (int t = 0; t < T; ++t) dot[t] = finer[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i weights = vectors[8 * g + j];
      const int64_t k = g * kGroup + 4 * j;
      for (int t = 0; t < T; ++t) {
        int32_t four, four_fine;
        std::memcpy(&four, act.codes + (m0 + t) * K + k, 4);
        std::memcpy(&four_fine, act.fine + (m0 + t) * K + k, 4);
        dot[t] = _mm512_dpbusd_epi32(dot[t], _mm512_set1_epi32(four), weights);
        finer[t] = _mm512_dpbusd_epi32(finer[t], _mm512_set1_epi32(four_fine), weights);
      }
    }
    const __m512i taken = _mm512_mullo_epi32(sums[g], correction);
    for (int t = 0; t < T; ++t) {
      __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(dot[t], 8), finer[t]), taken);
      __m512 a = _mm512_set1_ps(act.scales[(m0 + t) * groups + g] / 256.f);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), a, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (m0 + t) * N + n0, _mm512_mul_ps(acc[t], scale));
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "weight: [out, in] int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16, "scales: [out] bfloat16");
  const auto q = quantize_rows(x, true);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && scales.size(0) == N, "weight: [out, in], scales: [out]");
  TORCH_CHECK(K % (2 * kGroup) == 0 && N % 16 == 0,
              "int8: in must be a multiple of 64 and out of 16");
  const auto w = weight.contiguous();
  const auto s = scales.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* wp = w.data_ptr<int8_t>();
  const auto* sp = s.data_ptr<at::BFloat16>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> vectors(K / 4), sums(K / kGroup);
    for (int64_t n0 = 16 * begin; n0 < 16 * end; n0 += 16) {
      unpack8(wp, K, n0, vectors.data(), sums.data());
      const __m512 scale = load_bf16(sp + n0);
      over_tiles<kTile8>(M, [&](auto rows, int64_t m0) {
        tile8<decltype(rows)::value>(q.view, m0, K, vectors.data(), sums.data(), scale, N, n0, out);
      });
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int4_gemm(Tensor x, Tensor pack, Tensor scales_and_zeros) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
}
