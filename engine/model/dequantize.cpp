// sluice::int4_dequantize: an int4 layer's weight from PyTorch's AVX-512 int4 pack, dense and
// transposed, on AVX-512.
//
//   int4_dequantize(pack [out, in / 2] uint8, scales_and_zeros [in / 32, out, 2] bfloat16,
//                   dtype) -> [in, out] in dtype (float32 or bfloat16)
//
// Element (i, o) is q * s + (z - 8 s), where q is row o's 4-bit code for input i and (s, z)
// the scale and zero of row o's group i / 32: each product and sum rounded to float32, then
// the result rounded to dtype, nearest even. That is, bit for bit, what the same formula
// gives in PyTorch's elementwise ops.
//
// The pack keeps rows in blocks of 64: for block b and input i, 32 bytes at (b * in + i) * 32,
// byte j holding row 64 b + j in its low nibble and row 64 b + 32 + j in its high one. So one
// load gives 64 consecutive outputs of row i of the result. A task is one group of 32 inputs
// and one block: its 64 scales and zeros are read once, for 32 inputs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kBlock = 64;  // rows per block of the pack
constexpr int64_t kGroup = 32;  // inputs per scale and zero

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {  // rounds to nearest even, as PyTorch does
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

inline __m512 codes16(__m128i bytes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// One task: inputs [group * 32, group * 32 + 32) of the rows of block `block`.
template <typename T>
void dequantize_task(const uint8_t* pack, const at::BFloat16* scales_and_zeros, T* out,
                     int64_t in, int64_t rows, int64_t group, int64_t block) {
  __m512 scale[4], offset[4];
  const __m512 eight = _mm512_set1_ps(8.0f);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // Each 32-bit word holds one row's (scale, zero): the scale in its low half.
  const auto* pairs = reinterpret_cast<const int32_t*>(scales_and_zeros) + group * rows +
                      block * kBlock;
  for (int k = 0; k < 4; ++k) {
    __m512i words = _mm512_loadu_si512(pairs + 16 * k);
    scale[k] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words, high_half));
    offset[k] = _mm512_sub_ps(zero, _mm512_mul_ps(eight, scale[k]));
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t i = group * kGroup; i < (group + 1) * kGroup; ++i) {
    __m256i bytes =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pack + (block * in + i) * 32));
    __m256i low = _mm256_and_si256(bytes, nibble);
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    __m512 q[4] = {
        codes16(_mm256_castsi256_si128(low)), codes16(_mm256_extracti128_si256(low, 1)),
        codes16(_mm256_castsi256_si128(high)), codes16(_mm256_extracti128_si256(high, 1))};
    T* row = out + i * rows + block * kBlock;
    for (int k = 0; k < 4; ++k) {
      store16(row + 16 * k, _mm512_add_ps(_mm512_mul_ps(q[k], scale[k]), offset[k]));
    }
  }
}

template <typename T>
void dequantize(const at::Tensor& pack, const at::Tensor& scales_and_zeros, at::Tensor& out) {
  const int64_t rows = out.size(1), in = out.size(0);
  const int64_t blocks = rows / kBlock, groups = in / kGroup;
  const auto* codes = pack.data_ptr<uint8_t>();
  const auto* pairs = scales_and_zeros.data_ptr<at::BFloat16>();
  T* result = out.data_ptr<T>();
  at::parallel_for(0, groups * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      dequantize_task(codes, pairs, result, in, rows, task / blocks, task % blocks);
    }
  });
}

at::Tensor int4_dequantize(const at::Tensor& pack, const at::Tensor& scales_and_zeros,
                           at::ScalarType dtype) {
  TORCH_CHECK(pack.dim() == 2 && pack.scalar_type() == at::kByte && pack.is_contiguous(),
              "pack must be a contiguous [out, in / 2] uint8 tensor");
  const int64_t rows = pack.size(0), in = pack.size(1) * 2;
  TORCH_CHECK(rows % kBlock == 0 && in % kGroup == 0,
              "int4_dequantize needs rows in 64s and inputs in 32s");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.sizes() == at::IntArrayRef({in / kGroup, rows, 2}),
              "scales_and_zeros must be a contiguous [in / 32, out, 2] bfloat16 tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int4_dequantize returns float32 or bfloat16");
  at::Tensor out = at::empty({in, rows}, pack.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize<float>(pack, scales_and_zeros, out);
  } else {
    dequantize<at::BFloat16>(pack, scales_and_zeros, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int4_dequantize(Tensor pack, Tensor scales_and_zeros, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int4_dequantize", &int4_dequantize); }
