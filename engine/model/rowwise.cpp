// The model's per-row bfloat16 operations that reduce or round in an order of their own, on
// AVX-512:
//
//   sluice::rms_norm(x [rows, size], weight [size], eps) -> [rows, size]
//       x / sqrt(mean(x²) + eps) · weight
//   sluice::silu_mul(x [rows, 2n]) -> [rows, n]
//       silu(x[:, :n]) · x[:, n:]
//   sluice::dense_linear(x [rows, in], weight [out, in], bias? [out]) -> [rows, out]
//       ATen's linear, as an eager step runs it: oneDNN's bfloat16 GEMM, whose rounding of a
//       row does not depend on the number of rows; inside a compiled graph inductor would
//       otherwise lower the product of a one-row graph its own way.
//
// Each computes in float32 and rounds to bfloat16 once, and each row's result depends on that
// row alone: the sum of squares runs over 16 lanes in input order and then one fixed tree of
// lanes, whatever the number of rows, and rows are split between threads whole. Eager steps
// and the compiled decode graphs call these very kernels, where PyTorch's and inductor's own
// versions of the same formulas round differently from each other (inductor fuses the
// product into the norm and computes its own exp), so a token's hidden state is the same
// whether it is decoded or prefilled, alone or beside other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd16.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

__mmask16 first(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << count) - 1);
}

__m512 load16(const at::BFloat16* p, __mmask16 mask) {
  return sluice::widen_bf16(_mm256_maskz_loadu_epi16(mask, p));
}

void store16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, sluice::narrow_bf16(v));
}

at::Tensor rows_of(const at::Tensor& x, int64_t size) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == size, "x's last dimension must be ", size);
  return x.contiguous().view({-1, size});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kBFloat16, "weight: [size] bfloat16");
  const int64_t size = weight.size(0);
  const at::Tensor rows = rows_of(x, size), w = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  const auto* xp = rows.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* in = xp + row * size;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < size; i += kLanes) {
        __m512 v = load16(in + i, first(size - i));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(size);
      const __m512 inverse = _mm512_set1_ps(1.f / std::sqrt(mean + epsilon));
      for (int64_t i = 0; i < size; i += kLanes) {
        const __mmask16 mask = first(size - i);
        __m512 normed = _mm512_mul_ps(load16(in + i, mask), inverse);
        store16(op + row * size + i, _mm512_mul_ps(normed, load16(wp + i, mask)), mask);
      }
    }
  });
  return out.view(x.sizes());
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "x's last dimension must be even");
  const int64_t width = x.size(-1), half = width / 2;
  const at::Tensor rows = rows_of(x, width);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = half;
  at::Tensor out = at::empty({rows.size(0), half}, x.options());
  const auto* xp = rows.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* gate = xp + row * width;
      for (int64_t i = 0; i < half; i += kLanes) {
        const __mmask16 mask = first(half - i);
        __m512 g = load16(gate + i, mask), u = load16(gate + half + i, mask);
        __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, sluice::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(op + row * half + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u), mask);
      }
    }
  });
  return out.view(shape);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  return at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("dense_linear", &dense_linear);
}
