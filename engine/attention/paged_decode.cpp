// sluice::paged_decode: one query token per sequence attending to its context where the
// paged KV cache holds it, on AVX-512.
//
//   paged_decode(q [rows, heads, dim], k_blocks, v_blocks [blocks, block_size, kv_heads, dim],
//                tables [rows, width], mask [rows, 1, 1, width * block_size (+ 1)],
//                new_k?, new_v? [rows, kv_heads, dim]) -> [rows, heads, dim]
//
// Row r's context is the slots of the blocks tables[r] names, in order, then (when given)
// its own new key and value; mask is added to the scores, and a slot whose mask is -inf is
// not read at all. This is scaled_dot_product_attention with scale 1/sqrt(dim) over that
// context, computed in float32 and returned in q's dtype.
//
// Gathering the blocks into one tensor per row and then attending reads and writes each key
// and value three times or more; at 32 rows of ~150 tokens that cost the default model more
// than a third of a decode step. Here each key and value is read once, straight from its
// block. A task is one row and one KV head, so the query heads that share that head (the
// group of grouped-query attention, a template argument up to 8) use each key and value as
// it is loaded, their partial sums in registers: pass one takes the scores, four slots at a
// time, pass two the weighted sum of values, 16 dimensions at a time, with the values
// prefetched a few slots ahead.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kMaxChunks = 16;  // head_dim up to 256
constexpr int kMaxGroup = 8;    // query heads per KV head

constexpr int64_t kAhead = 12;  // slots read ahead of use

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T0);
  }
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {  // rounds to nearest even, as PyTorch does
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  __m512i nan = _mm512_set1_epi32(0x7fc00000);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// e^x for x <= 0 (scores less their maximum), to about 2 ulp: x = n·ln2 + r, e^r by its
// Taylor polynomial on |r| <= ln2/2, then scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
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

// Σ of each of a, b, c and d's lanes, in that order.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], and the same of c and d.
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
  __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab2, cd2)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(ab2, cd2)));
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

struct Shape {
  int64_t rows, heads, kv_heads, group, dim, chunks, block_size, width, context, padded;
  int64_t q_row, new_k_row, new_v_row;  // strides between rows: q, new_k and new_v may be views
  bool has_new;
};

template <typename Q, typename C>
struct Inputs {
  const Q* q;
  const C *k_blocks, *v_blocks, *new_k, *new_v;
  const int64_t* tables;
  const float* mask;
  Q* out;
};

// One thread's working memory: the slots a task's mask shows, padded with hidden ones to a
// multiple of 16 (a hidden slot reads zeros and scores -inf).
template <typename C>
struct Scratch {
  explicit Scratch(const Shape& s)
      : keys(s.padded), values(s.padded), bias(s.padded), scores(s.group * s.padded),
        zeros(s.dim, C(0.f)) {}
  std::vector<const C*> keys, values;
  std::vector<float> bias;    // the mask's value of each slot
  std::vector<float> scores;  // [group, slots]: scores, then unnormalized weights
  std::vector<C> zeros;
};

// One task: row `row` and KV head `head`, for `G` query heads to the KV head. G is a template
// argument so that each slot's G partial sums stay in registers.
template <int G, typename Q, typename C>
void attend(const Shape& s, const Inputs<Q, C>& in, int64_t row, int64_t head,
            Scratch<C>& scratch) {
  const float hidden = -std::numeric_limits<float>::infinity();
  const int64_t chunks = s.chunks, bytes = s.dim * static_cast<int64_t>(sizeof(C));
  const C** keys = scratch.keys.data();
  const C** values = scratch.values.data();
  float* bias = scratch.bias.data();
  float* scores = scratch.scores.data();

  // The slots the mask shows, in order: the row's blocks, then its new token.
  const float* mask = in.mask + row * s.context;
  const int64_t* table = in.tables + row * s.width;
  const int64_t own = head * s.dim;
  int64_t count = 0;
  for (int64_t pos = 0; pos < s.context; ++pos) {
    if (mask[pos] == hidden) continue;
    if (pos == s.width * s.block_size) {
      keys[count] = in.new_k + row * s.new_k_row + own;
      values[count] = in.new_v + row * s.new_v_row + own;
    } else {
      int64_t at = table[pos / s.block_size] * s.block_size + pos % s.block_size;
      keys[count] = in.k_blocks + at * s.kv_heads * s.dim + head * s.dim;
      values[count] = in.v_blocks + at * s.kv_heads * s.dim + head * s.dim;
    }
    bias[count++] = mask[pos];
  }
  const int64_t slots = (count + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = count; j < slots; ++j) {
    keys[j] = values[j] = scratch.zeros.data();
    bias[j] = hidden;
  }

  // Pass one: scores, four slots at a time so that one shuffle tree sums four dot products.
  const Q* q = in.q + row * s.q_row + head * G * s.dim;
  const __m128 scale = _mm_set1_ps(1.f / std::sqrt(static_cast<float>(s.dim)));
  for (int64_t j = 0; j < slots; j += 4) {
    __m512 sum[4][G];
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < G; ++g) sum[i][g] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < chunks; ++c) {
      for (int i = 0; i < 4; ++i) {
        __m512 kc = load16(keys[j + i] + c * kLanes);
        for (int g = 0; g < G; ++g) {
          sum[i][g] = _mm512_fmadd_ps(load16(q + g * s.dim + c * kLanes), kc, sum[i][g]);
        }
      }
    }
    __m128 b = _mm_loadu_ps(bias + j);
    for (int g = 0; g < G; ++g) {
      __m128 four = reduce4(sum[0][g], sum[1][g], sum[2][g], sum[3][g]);
      _mm_storeu_ps(scores + g * slots + j, _mm_fmadd_ps(four, scale, b));
    }
  }

  // Softmax weights in place, unnormalized; their sums divide the output.
  for (int64_t j = 0; j < std::min<int64_t>(kAhead, count); ++j) prefetch(values[j], bytes);
  float inverse[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * slots;
    __m512 most = _mm512_set1_ps(hidden);
    for (int64_t j = 0; j < slots; j += kLanes) most = _mm512_max_ps(most, _mm512_loadu_ps(sg + j));
    float top = _mm512_reduce_max_ps(most);
    most = _mm512_set1_ps(top == hidden ? 0.f : top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < slots; j += kLanes) {
      __m512 x = _mm512_loadu_ps(sg + j);
      __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(hidden), _CMP_NEQ_OQ);
      __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, most)));
      _mm512_storeu_ps(sg + j, e);
      total = _mm512_add_ps(total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    inverse[g] = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees nothing gets zeros
  }

  // Pass two: the weighted sum of values, 16 dimensions at a time, G of them in registers.
  Q* out = in.out + (row * s.heads + head * G) * s.dim;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 sum[G];
    for (int g = 0; g < G; ++g) sum[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      if (c == 0 && j + kAhead < count) prefetch(values[j + kAhead], bytes);
      __m512 vc = load16(values[j] + c * kLanes);
      for (int g = 0; g < G; ++g) {
        sum[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * slots + j]), vc, sum[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      store16(out + g * s.dim + c * kLanes, _mm512_mul_ps(sum[g], _mm512_set1_ps(inverse[g])));
    }
  }
}

template <int G, typename Q, typename C>
void run(const Shape& s, const Inputs<Q, C>& in) {
  at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch<C> scratch(s);
    for (int64_t task = begin; task < end; ++task) {
      attend<G>(s, in, task / s.kv_heads, task % s.kv_heads, scratch);
    }
  });
}

template <typename Q, typename C, int... Gs>
void run_group(const Shape& s, const Inputs<Q, C>& in, std::integer_sequence<int, Gs...>) {
  ((s.group == Gs + 1 ? run<Gs + 1>(s, in) : void()), ...);
}

template <typename Q, typename C>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k_blocks,
         const at::Tensor& v_blocks, const at::Tensor& tables, const at::Tensor& mask,
         const std::optional<at::Tensor>& new_k, const std::optional<at::Tensor>& new_v,
         at::Tensor& out) {
  Inputs<Q, C> in{q.data_ptr<Q>(),
                  k_blocks.data_ptr<C>(),
                  v_blocks.data_ptr<C>(),
                  s.has_new ? new_k->data_ptr<C>() : nullptr,
                  s.has_new ? new_v->data_ptr<C>() : nullptr,
                  tables.data_ptr<int64_t>(),
                  mask.data_ptr<float>(),
                  out.data_ptr<Q>()};
  run_group(s, in, std::make_integer_sequence<int, kMaxGroup>());
}

// `t` [rows, heads, dim] as it is where each row's heads are contiguous (a slice of the fused
// projection's output is), else a contiguous copy.
at::Tensor rows_of(const at::Tensor& t) {
  bool packed = t.stride(2) == 1 && t.stride(1) == t.size(2);
  return packed ? t : t.contiguous();
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_blocks,
                        const at::Tensor& v_blocks, const at::Tensor& tables,
                        const at::Tensor& mask, const std::optional<at::Tensor>& new_k,
                        const std::optional<at::Tensor>& new_v) {
  TORCH_CHECK(q.dim() == 3 && k_blocks.dim() == 4, "q [rows, heads, dim] and blocks 4-D");
  TORCH_CHECK(k_blocks.sizes() == v_blocks.sizes(), "keys and values differ in shape");
  TORCH_CHECK(new_k.has_value() == new_v.has_value(), "new_k and new_v come together");
  Shape s{};
  s.rows = q.size(0);
  s.heads = q.size(1);
  s.dim = q.size(2);
  s.block_size = k_blocks.size(1);
  s.kv_heads = k_blocks.size(2);
  s.width = tables.size(1);
  s.has_new = new_k.has_value();
  s.context = s.width * s.block_size + (s.has_new ? 1 : 0);
  s.padded = (s.context + kLanes - 1) / kLanes * kLanes;
  s.group = s.kv_heads > 0 ? s.heads / s.kv_heads : 0;
  s.chunks = s.dim / kLanes;
  TORCH_CHECK(k_blocks.size(3) == s.dim && s.dim % kLanes == 0 && s.chunks <= kMaxChunks,
              "head_dim must match and be a multiple of 16 up to 256");
  TORCH_CHECK(s.group * s.kv_heads == s.heads && s.group >= 1 && s.group <= kMaxGroup,
              "heads must be a multiple of kv_heads, at most 8 to one");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == s.rows && tables.scalar_type() == at::kLong,
              "tables must be int64 [rows, width]");
  TORCH_CHECK(mask.scalar_type() == at::kFloat && mask.numel() == s.rows * s.context,
              "mask must be float32 [rows, 1, 1, width * block_size (+ 1 with new_k)]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(k_blocks.scalar_type() == at::kFloat || k_blocks.scalar_type() == at::kBFloat16,
              "the cache must be float32 or bfloat16");
  TORCH_CHECK(k_blocks.scalar_type() == v_blocks.scalar_type(), "keys and values differ in dtype");
  if (s.has_new) {
    TORCH_CHECK(new_k->scalar_type() == k_blocks.scalar_type() &&
                    new_v->scalar_type() == k_blocks.scalar_type(),
                "new_k and new_v must have the cache's dtype");
    const std::vector<int64_t> shape{s.rows, s.kv_heads, s.dim};
    TORCH_CHECK(new_k->sizes() == shape && new_v->sizes() == shape,
                "new_k and new_v must be [rows, kv_heads, dim]");
  }
  at::Tensor qc = rows_of(q), kc = k_blocks.contiguous(), vc = v_blocks.contiguous();
  at::Tensor tc = tables.contiguous(), mc = mask.contiguous();
  std::optional<at::Tensor> nk, nv;
  s.q_row = qc.stride(0);
  if (s.has_new) {
    nk = rows_of(*new_k);
    nv = rows_of(*new_v);
    s.new_k_row = nk->stride(0);
    s.new_v_row = nv->stride(0);
  }
  at::Tensor out = at::empty({s.rows, s.heads, s.dim}, q.options());
  bool bf16_q = q.scalar_type() == at::kBFloat16;
  bool bf16_cache = k_blocks.scalar_type() == at::kBFloat16;
  if (bf16_q && bf16_cache) {
    run<at::BFloat16, at::BFloat16>(s, qc, kc, vc, tc, mc, nk, nv, out);
  } else if (bf16_q) {
    run<at::BFloat16, float>(s, qc, kc, vc, tc, mc, nk, nv, out);
  } else if (bf16_cache) {
    run<float, at::BFloat16>(s, qc, kc, vc, tc, mc, nk, nv, out);
  } else {
    run<float, float>(s, qc, kc, vc, tc, mc, nk, nv, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_blocks, Tensor v_blocks, Tensor tables, Tensor mask, "
      "Tensor? new_k, Tensor? new_v) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("paged_decode", &paged_decode); }
