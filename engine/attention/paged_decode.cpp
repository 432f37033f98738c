// sluice::paged_decode: query rows attending to their contexts where the paged KV cache holds
// them, on AVX-512.
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
// Every row's output has the bits it has in a call of its own, whatever else the call holds:
// a decode, or any token of a prefill chunk of any size (a row per token, its mask showing its
// context up to and including its own token), or the same row with its last slot passed as
// new_k / new_v instead of read from the cache. That is what lets every query row on a CPU
// attend through this one kernel. So each row's arithmetic is fixed, however the work is
// organized: a score is each 16-lane chunk of q·k fmadd-accumulated from zero in chunk order,
// the 16 lanes summed in reduce4's tree, times the scale plus the mask's value; the weights
// are exp16 of the scores less their maximum, summed per lane over the row's slots in order
// of 16 and then across lanes; the output is, per 16 dimensions, the weighted values
// fmadd-accumulated over the row's slots in order, times the inverse of that sum.
//
// Two kinds of task do it, each for one KV head and the query heads that share it (the group
// of grouped-query attention, up to 8):
//
// - A row task (a decode, or any row whose mask is not a plain prefix) reads each key and
//   value once, straight from its block: gathering the blocks first would read and write each
//   three times or more, which at 32 decodes of ~150 tokens cost the default model more than
//   a third of a decode step. Pass one takes the scores four slots at a time, pass two the
//   weighted sum of values, 16 dimensions at a time, prefetched a few slots ahead.
// - A tile task serves up to 12 query heads (rows · group) of a run: four or more
//   consecutive rows that see a prefix of the same sequence's slots (their tables agree on
//   those blocks, the mask shows slots [0, n) and hides the rest and the new token), as the
//   rows of a prefill chunk do. Attending such rows one by one reads each key and value once
//   per row; a tile reads each once for all its rows. The run's keys are staged once per KV
//   head, transposed 16 slots at a time, so that a 16-lane vector holds one dimension of 16
//   slots: lane l of every chunk then accumulates in a register as it would in the key's own
//   vector, and the reduce4 tree becomes adds of whole vectors, 16 scores at once. Its values
//   are staged in float32. Slots past a row's count score -inf and are not summed, so each
//   row gets the bits of its row task.
//
// A call of row tasks only (decodes) splits them evenly over the threads, the same rows to
// the same thread each call. A call with runs gives each thread a contiguous range of tasks of
// about equal estimated cost (the causal rows of a chunk do unequal work), and a thread that
// finishes its range early takes tasks from the others'.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd16.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
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
  return sluice::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), sluice::narrow_bf16(v));
}

// e^x of scores less their maximum (x <= 0).
using sluice::exp16;

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

// Scores `s` [slots] (slots a multiple of 16, hidden ones -inf) become unnormalized softmax
// weights in place: e^(score - max), each lane of 16 summing its slots in order. Returns the
// inverse of the sum, or 0 where nothing is seen (the row's output is then zeros).
inline float weigh(float* s, int64_t slots) {
  const float hidden = -std::numeric_limits<float>::infinity();
  __m512 most = _mm512_set1_ps(hidden);
  for (int64_t j = 0; j < slots; j += kLanes) most = _mm512_max_ps(most, _mm512_loadu_ps(s + j));
  float top = _mm512_reduce_max_ps(most);
  most = _mm512_set1_ps(top == hidden ? 0.f : top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < slots; j += kLanes) {
    __m512 x = _mm512_loadu_ps(s + j);
    __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(hidden), _CMP_NEQ_OQ);
    __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, most)));
    _mm512_storeu_ps(s + j, e);
    total = _mm512_add_ps(total, e);
  }
  float sum = _mm512_reduce_add_ps(total);
  return sum > 0.f ? 1.f / sum : 0.f;
}

// One thread's working memory for a row task: the slots a task's mask shows, padded with
// hidden ones to a multiple of 16 (a hidden slot reads zeros and scores -inf).
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

// A row task: row `row` and KV head `head`, for `G` query heads to the KV head. G is a
// template argument so that each slot's G partial sums stay in registers.
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
  for (int g = 0; g < G; ++g) inverse[g] = weigh(scores + g * slots, slots);

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

// A run's rows see the first n of the same cache slots (their tables agree on those blocks),
// with no new token; `length` is their largest n and `source` a row of that length.
struct Run {
  int64_t first, rows, length, source;
  int64_t keys, values;  // where its heads' transposed keys and float32 values are staged
};

// n where a row's mask shows slots [0, n) and hides the rest, else (a shown slot after a hidden
// one) -1.
inline int64_t prefix_of(const float* mask, int64_t context) {
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t n = context;
  int64_t pos = 0;
  for (; pos + kLanes <= context; pos += kLanes) {
    __mmask16 off = _mm512_cmp_ps_mask(_mm512_loadu_ps(mask + pos), hidden, _CMP_EQ_OQ);
    if (off != 0) {
      n = pos + __builtin_ctz(off);
      if (static_cast<uint16_t>(off >> (n - pos)) != static_cast<uint16_t>(0xffffu >> (n - pos))) {
        return -1;  // a shown slot after a hidden one
      }
      pos += kLanes;
      break;
    }
  }
  if (n == context) {  // the tail, one at a time
    for (; pos < context; ++pos) {
      if (mask[pos] == -std::numeric_limits<float>::infinity()) {
        n = pos++;
        break;
      }
    }
  }
  for (; pos + kLanes <= context; pos += kLanes) {
    if (_mm512_cmp_ps_mask(_mm512_loadu_ps(mask + pos), hidden, _CMP_EQ_OQ) != 0xffff) return -1;
  }
  for (; pos < context; ++pos) {
    if (mask[pos] != -std::numeric_limits<float>::infinity()) return -1;
  }
  return n;
}

// Σ over dims of q·k for TS query heads against 16 keys held transposed, `kt` [dim][16]:
// lane l of chunk c of each key pairs with element c·16 + l of each query, each lane summing
// its chunks in order from zero (as one key's 16-lane fmadd would), and the 16 lanes then
// sum in reduce4's tree, ((l0 + l2) + (l1 + l3)) within each quarter and
// (q0 + q2) + (q1 + q3) across quarters, so each score has the bits the row task gives it.
template <int TS, int CH>
void score16(const float* kt, const float* qf, int64_t dim, int64_t chunks, int64_t j,
             const float* const* bias, const int64_t* n, float* const* scores) {
  if constexpr (CH > 0) chunks = CH;
  auto lane = [&](int l, __m512* p) __attribute__((always_inline)) {
    for (int t = 0; t < TS; ++t) p[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 k = _mm512_loadu_ps(kt + (c * kLanes + l) * kLanes);
      for (int t = 0; t < TS; ++t) {
        p[t] = _mm512_fmadd_ps(_mm512_set1_ps(qf[t * dim + c * kLanes + l]), k, p[t]);
      }
    }
  };
  auto quarter = [&](int k, __m512* out) __attribute__((always_inline)) {
    __m512 a[TS], b[TS], x[TS];
    lane(4 * k, a);
    lane(4 * k + 2, x);
    for (int t = 0; t < TS; ++t) a[t] = _mm512_add_ps(a[t], x[t]);
    lane(4 * k + 1, b);
    lane(4 * k + 3, x);
    for (int t = 0; t < TS; ++t) b[t] = _mm512_add_ps(b[t], x[t]);
    for (int t = 0; t < TS; ++t) out[t] = _mm512_add_ps(a[t], b[t]);
  };
  __m512 m[TS], y[TS], x[TS];
  quarter(0, m);
  quarter(2, x);
  for (int t = 0; t < TS; ++t) m[t] = _mm512_add_ps(m[t], x[t]);
  quarter(1, y);
  quarter(3, x);
  for (int t = 0; t < TS; ++t) y[t] = _mm512_add_ps(y[t], x[t]);
  // Each query head's scores of slots j .. j + 15: times the scale, plus the mask's bias;
  // -inf past its row's count.
  const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(static_cast<float>(dim)));
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int t = 0; t < TS; ++t) {
    __m512 total = _mm512_add_ps(m[t], y[t]);
    int64_t shown = std::clamp<int64_t>(n[t] - j, 0, kLanes);
    __mmask16 seen = static_cast<__mmask16>((1u << shown) - 1);
    __m512 score = _mm512_fmadd_ps(total, scale, _mm512_maskz_loadu_ps(seen, bias[t] + j));
    _mm512_storeu_ps(scores[t] + j, _mm512_mask_mov_ps(hidden, seen, score));
  }
}

// Σ_j w[t][j]·v[j] for TV query heads over CG chunks of 16 dims, slots j in order from zero;
// head t stops at its count n[t] (slots [lo, hi) are where some heads have stopped).
template <int TV, int CG>
inline void weighted16(const float* v, int64_t dim, const float* w, int64_t stride,
                       const int64_t* n, int64_t lo, int64_t hi, float* sums) {
  __m512 acc[TV][CG];
  for (int t = 0; t < TV; ++t) {
    for (int c = 0; c < CG; ++c) acc[t][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < lo; ++j) {
    __m512 vc[CG];
    for (int c = 0; c < CG; ++c) vc[c] = _mm512_loadu_ps(v + j * dim + c * kLanes);
    for (int t = 0; t < TV; ++t) {
      __m512 wt = _mm512_set1_ps(w[t * stride + j]);
      for (int c = 0; c < CG; ++c) acc[t][c] = _mm512_fmadd_ps(wt, vc[c], acc[t][c]);
    }
  }
  for (int64_t j = lo; j < hi; ++j) {
    __m512 vc[CG];
    for (int c = 0; c < CG; ++c) vc[c] = _mm512_loadu_ps(v + j * dim + c * kLanes);
    for (int t = 0; t < TV; ++t) {
      if (j >= n[t]) continue;
      __m512 wt = _mm512_set1_ps(w[t * stride + j]);
      for (int c = 0; c < CG; ++c) acc[t][c] = _mm512_fmadd_ps(wt, vc[c], acc[t][c]);
    }
  }
  for (int t = 0; t < TV; ++t) {
    for (int c = 0; c < CG; ++c) _mm512_storeu_ps(sums + (t * 4 + c) * kLanes, acc[t][c]);
  }
}

constexpr int kScoreHeads = 4;   // query heads per score16 call
constexpr int kValueHeads = 6;   // query heads per weighted16 call (with 4 chunks: 24 sums)
constexpr int kTileHeads = 12;   // about how many query heads one tile task serves: rows · group
constexpr int kMaxTileHeads = kTileHeads + kMaxGroup / 2;
constexpr int64_t kMinRun = 4;   // fewer rows than this attend as row tasks
constexpr int64_t kRowCost = 9;  // about how much a slot costs one query head: row tasks
constexpr int64_t kTileCost = 5; // and tile tasks

using ScoreFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t,
                        const float* const*, const int64_t*, float* const*);
using ValueFn = void (*)(const float*, int64_t, const float*, int64_t, const int64_t*, int64_t,
                         int64_t, float*);

// Per TS: 4 chunks (head_dim 64) unrolled, other head_dims a loop (unrolling more of them
// gains a few percent and costs seconds of compiling each).
template <int... Ts>
constexpr std::array<std::array<ScoreFn, 2>, sizeof...(Ts)> score_fns(
    std::integer_sequence<int, Ts...>) {
  return {std::array<ScoreFn, 2>{&score16<Ts + 1, 0>, &score16<Ts + 1, 4>}...};
}
template <int TV, int... Cs>
constexpr std::array<ValueFn, 4> value_row(std::integer_sequence<int, Cs...>) {
  return {&weighted16<TV, Cs + 1>...};
}
template <int... Ts>
constexpr std::array<std::array<ValueFn, 4>, sizeof...(Ts)> value_fns(
    std::integer_sequence<int, Ts...>) {
  return {value_row<Ts + 1>(std::make_integer_sequence<int, 4>())...};
}
constexpr auto kScore = score_fns(std::make_integer_sequence<int, kScoreHeads>());
constexpr auto kValue = value_fns(std::make_integer_sequence<int, kValueHeads>());

// `total` split into `parts` pieces as even as possible: piece i's start.
inline int split(int total, int parts, int i) {
  return i * (total / parts) + std::min(i, total % parts);
}

// One thread's working memory for tile tasks.
struct TileScratch {
  std::vector<float> q;       // [heads, dim] the tile's queries in float32
  std::vector<float> scores;  // [heads, slots]
  std::vector<int64_t> n;     // each head's row's count
};

// A tile task: rows [row0, row0 + rows) of a run, KV head `head`: each 16 keys, transposed,
// serve every query head of the tile (rows · group) from registers, and each value likewise.
template <typename Q, typename C>
void attend_tile(const Shape& s, const Inputs<Q, C>& in, const int64_t* counts,
                 const float* kt, const float* vf, int64_t row0, int64_t rows, int64_t head,
                 TileScratch& scratch) {
  const int64_t dim = s.dim, G = s.group;
  const int heads = static_cast<int>(rows * G);
  int64_t top = 0;
  for (int64_t r = row0; r < row0 + rows; ++r) top = std::max(top, counts[r]);
  const int64_t slots = (top + kLanes - 1) / kLanes * kLanes;
  scratch.q.resize(heads * dim);
  scratch.scores.resize(heads * slots);
  scratch.n.resize(heads);
  float* qf = scratch.q.data();
  float* w = scratch.scores.data();
  int64_t* n = scratch.n.data();
  const float* bias[kMaxTileHeads];
  float* rows_scores[kMaxTileHeads];
  Q* outs[kMaxTileHeads];
  for (int t = 0; t < heads; ++t) {
    int64_t row = row0 + t / G;
    const Q* q = in.q + row * s.q_row + (head * G + t % G) * dim;
    for (int64_t c = 0; c < s.chunks; ++c) {
      _mm512_storeu_ps(qf + t * dim + c * kLanes, load16(q + c * kLanes));
    }
    n[t] = counts[row];
    bias[t] = in.mask + row * s.context;
    rows_scores[t] = w + t * slots;
    outs[t] = in.out + (row * s.heads + head * G + t % G) * dim;
  }

  // Pass one: scores, 16 slots by up to kScoreHeads query heads at a time.
  const int score_parts = (heads + kScoreHeads - 1) / kScoreHeads;
  const int chunk_form = s.chunks == 4 ? 1 : 0;
  for (int64_t j = 0; j < slots; j += kLanes) {
    const float* block = kt + j * dim;
    for (int p = 0; p < score_parts; ++p) {
      int t0 = split(heads, score_parts, p), size = split(heads, score_parts, p + 1) - t0;
      kScore[size - 1][chunk_form](block, qf + t0 * dim, dim, s.chunks, j, bias + t0, n + t0,
                                   rows_scores + t0);
    }
  }

  // Softmax weights in place, each head over its row's slots.
  float inverse[kMaxTileHeads];
  for (int t = 0; t < heads; ++t) {
    inverse[t] = weigh(w + t * slots, (n[t] + kLanes - 1) / kLanes * kLanes);
  }

  // Pass two: weighted sums of values, up to kValueHeads heads by 4 chunks at a time.
  const int value_parts = (heads + kValueHeads - 1) / kValueHeads;
  for (int p = 0; p < value_parts; ++p) {
    int t0 = split(heads, value_parts, p), size = split(heads, value_parts, p + 1) - t0;
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int t = t0; t < t0 + size; ++t) {
      lo = std::min(lo, n[t]);
      hi = std::max(hi, n[t]);
    }
    for (int64_t c0 = 0; c0 < s.chunks; c0 += 4) {
      int width = static_cast<int>(std::min<int64_t>(4, s.chunks - c0));
      alignas(64) float sums[kValueHeads * 4 * kLanes];
      kValue[size - 1][width - 1](vf + c0 * kLanes, dim, w + t0 * slots, slots, n + t0, lo, hi,
                                  sums);
      for (int i = 0; i < size; ++i) {
        int t = t0 + i;
        for (int c = 0; c < width; ++c) {
          store16(outs[t] + (c0 + c) * kLanes, _mm512_mul_ps(_mm512_load_ps(sums + (i * 4 + c) * kLanes),
                                            _mm512_set1_ps(inverse[t])));
        }
      }
    }
  }
}

// r[i] becomes lane i of each r[l]: a 16 × 16 transpose.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// A run's keys for KV head `head`, slots [from, to) (multiples of 16 but `to` may pass its
// length): transposed by 16 slots, `kt` [slots / 16][dim][16], zeros past the length; and its
// values in float32, `vf` [length][dim].
template <typename C>
void stage(const Shape& s, const C* k_blocks, const C* v_blocks, const int64_t* table,
           int64_t length, int64_t head, int64_t from, int64_t to, float* kt, float* vf) {
  const int64_t dim = s.dim;
  for (int64_t j0 = from; j0 < to; j0 += kLanes) {
    const C* keys[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      int64_t pos = j0 + i;
      if (pos >= length) {
        keys[i] = nullptr;
        continue;
      }
      int64_t at = table[pos / s.block_size] * s.block_size + pos % s.block_size;
      keys[i] = k_blocks + (at * s.kv_heads + head) * dim;
      const C* value = v_blocks + (at * s.kv_heads + head) * dim;
      for (int64_t c = 0; c < s.chunks; ++c) {
        _mm512_storeu_ps(vf + pos * dim + c * kLanes, load16(value + c * kLanes));
      }
    }
    float* block = kt + j0 * dim;
    for (int64_t c = 0; c < s.chunks; ++c) {
      __m512 r[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        r[i] = keys[i] ? load16(keys[i] + c * kLanes) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int l = 0; l < kLanes; ++l) _mm512_storeu_ps(block + (c * kLanes + l) * kLanes, r[l]);
    }
  }
}

// A row task (run -1: row `row`) or a tile task (rows [row, row + rows) of run `run`), for KV
// head `head`; cost estimates its work.
struct Task {
  int64_t cost;
  int64_t run;
  int64_t row, rows, head;
};

template <typename Q, typename C, int... Gs>
constexpr auto row_fns(std::integer_sequence<int, Gs...>) {
  using Fn = void (*)(const Shape&, const Inputs<Q, C>&, int64_t, int64_t, Scratch<C>&);
  return std::array<Fn, sizeof...(Gs)>{&attend<Gs + 1, Q, C>...};
}

template <typename Q, typename C>
void run(const Shape& s, const Inputs<Q, C>& in) {
  // Each row's shown prefix, or -1: only rows among kMinRun or more in a row whose tables
  // start with the same block can join a run, and only their masks are read here.
  std::vector<int64_t> counts(s.rows, -1);
  const int64_t cache_slots = s.width * s.block_size;
  std::vector<char> scan(s.rows, 0);
  for (int64_t r = 0; r < s.rows && s.width > 0;) {
    int64_t end = r + 1;
    while (end < s.rows && in.tables[end * s.width] == in.tables[r * s.width]) ++end;
    if (end - r >= kMinRun) std::fill(scan.begin() + r, scan.begin() + end, 1);
    r = end;
  }
  static constexpr auto kRow = row_fns<Q, C>(std::make_integer_sequence<int, kMaxGroup>());
  const auto attend_one = kRow[s.group - 1];
  if (std::find(scan.begin(), scan.end(), 1) == scan.end()) {  // row tasks only: decodes
    at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch<C> scratch(s);
      for (int64_t task = begin; task < end; ++task) {
        attend_one(s, in, task / s.kv_heads, task % s.kv_heads, scratch);
      }
    });
    return;
  }
  at::parallel_for(0, s.rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, s.context)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       if (!scan[r]) continue;
                       int64_t n = prefix_of(in.mask + r * s.context, s.context);
                       counts[r] = n >= 1 && n <= cache_slots ? n : -1;
                     }
                   });

  // Runs of rows that read one sequence's prefix; the other rows are row tasks.
  std::vector<Run> runs;
  std::vector<Task> tasks;
  const int64_t per_tile = std::max<int64_t>(1, (kTileHeads + s.group / 2) / s.group);
  int64_t staged = 0;
  for (int64_t r = 0; r < s.rows;) {
    int64_t first = r, source = r;
    if (counts[r] >= 1) {
      for (++r; r < s.rows && counts[r] >= 1; ++r) {
        int64_t shared = (std::min(counts[r], counts[source]) + s.block_size - 1) / s.block_size;
        const int64_t* a = in.tables + r * s.width;
        const int64_t* b = in.tables + source * s.width;
        if (!std::equal(a, a + shared, b)) break;
        if (counts[r] > counts[source]) source = r;
      }
    } else {
      ++r;
    }
    if (r - first >= kMinRun) {
      Run run{first, r - first, counts[source], source, 0, 0};
      int64_t padded = (run.length + kLanes - 1) / kLanes * kLanes;
      run.keys = staged;
      run.values = staged + s.kv_heads * padded * s.dim;
      staged = run.values + s.kv_heads * run.length * s.dim;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        for (int64_t row0 = first; row0 < r; row0 += per_tile) {
          int64_t rows = std::min(per_tile, r - row0), top = 0;
          for (int64_t i = row0; i < row0 + rows; ++i) top = std::max(top, counts[i]);
          int64_t cost = (top + kLanes) * rows * s.group * kTileCost / kRowCost;
          tasks.push_back({cost, static_cast<int64_t>(runs.size()), row0, rows, h});
        }
      }
      runs.push_back(run);
    } else {
      for (int64_t row = first; row < r; ++row) {
        int64_t cost = counts[row] >= 1 ? counts[row] : s.context;
        for (int64_t h = 0; h < s.kv_heads; ++h) tasks.push_back({cost * s.group, -1, row, 1, h});
      }
    }
  }

  // Stage each run's keys (transposed) and values (float32), in pieces of 512 slots.
  std::unique_ptr<float[]> staging(new float[staged]);  // every element is written
  float* buffer = staging.get();
  if (!runs.empty()) {
    constexpr int64_t kPiece = 512;
    std::vector<std::array<int64_t, 3>> pieces;  // run, head, first slot
    for (size_t i = 0; i < runs.size(); ++i) {
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        for (int64_t j = 0; j < runs[i].length; j += kPiece) pieces.push_back({int64_t(i), h, j});
      }
    }
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Run& run = runs[pieces[i][0]];
        int64_t h = pieces[i][1], from = pieces[i][2];
        int64_t padded = (run.length + kLanes - 1) / kLanes * kLanes;
        float* kt = buffer + run.keys + h * padded * s.dim;
        float* vf = buffer + run.values + h * run.length * s.dim;
        stage(s, in.k_blocks, in.v_blocks, in.tables + run.source * s.width, run.length, h, from,
              std::min(from + kPiece, padded), kt, vf);
      }
    });
  }

  // Each thread owns a contiguous range of tasks of about equal cost, the same rows each call
  // as a static schedule gives; one that finishes early takes tasks from the others' ranges.
  const int64_t total = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), total);
  int64_t work = 0;
  for (const Task& task : tasks) work += task.cost;
  std::vector<int64_t> bounds(workers + 1, total);
  bounds[0] = 0;
  for (int64_t i = 0, w = 1, sum = 0; i < total && w < workers; ++i) {
    sum += tasks[i].cost;
    while (w < workers && sum * workers >= work * w) bounds[w++] = i + 1;
  }
  struct alignas(64) Next {
    std::atomic<int64_t> task;
  };
  std::vector<Next> next(workers);
  for (int64_t w = 0; w < workers; ++w) next[w].task.store(bounds[w], std::memory_order_relaxed);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::optional<Scratch<C>> scratch;
    TileScratch tile;
    for (int64_t k = 0; k < workers; ++k) {  // its own ranges first, then the others'
      int64_t w = (first + k) % workers;
      for (int64_t i = next[w].task.fetch_add(1, std::memory_order_relaxed); i < bounds[w + 1];
           i = next[w].task.fetch_add(1, std::memory_order_relaxed)) {
        const Task& task = tasks[i];
        if (task.run < 0) {
          if (!scratch) scratch.emplace(s);
          attend_one(s, in, task.row, task.head, *scratch);
        } else {
          const Run& run = runs[task.run];
          int64_t padded = (run.length + kLanes - 1) / kLanes * kLanes;
          attend_tile(s, in, counts.data(), buffer + run.keys + task.head * padded * s.dim,
                      buffer + run.values + task.head * run.length * s.dim, task.row,
                      task.rows, task.head, tile);
        }
      }
    }
    (void)last;
  });
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
  run(s, in);
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
