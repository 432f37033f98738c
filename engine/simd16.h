// AVX-512 helpers the engine's kernels share: 16 float32 lanes at a time.
#pragma once

#include <immintrin.h>

namespace sluice {

// bfloat16 → float32 of 16 values (the lanes a mask leaves out read as zero).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// float32 → bfloat16 of 16 values, rounded to nearest even as PyTorch rounds, NaN kept NaN.
inline __m256i narrow_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  __m512i nan = _mm512_set1_epi32(0x7fc00000);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// e^x to about 2 ulp over float32's range: x = n·ln2 + r, e^r by its Taylor polynomial on
// |r| <= ln2/2, then scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

}  // namespace sluice
