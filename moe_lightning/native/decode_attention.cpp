// Decode attention over the paged host KV cache (docs/kv-cache.md, "The decode kernel").
//
// One work item is a (sequence, KV heads h0..h1): its G = H / K query heads attend together, so each key
// and value row of the sequence's context is read from the cache once, where its block lies (no gathered
// copy), converted to fp32 in registers and used by all G heads. The context goes by runs of up to RUN
// tokens (their rows found block by block); per run and KV head: the G x RUN scores, the online softmax's
// update (fp32, exp by a vectorised polynomial within 2 ulp), then P @ V. A head's sink logit (GPT-OSS)
// joins the normaliser at the end. Items run longest first and are handed out one at a time from an
// atomic counter on PyTorch's own intra-op threads, so ragged contexts balance across them.
//
// Where the time goes (decode reads each cached byte once, so the kernel must keep up with memory): per
// token and KV head, 2 * G * Hd multiply-adds in fp32, which at G = 4 is one vector FMA per 8 bytes of a
// bf16 cache; everything else is kept off that count:
//  - scores take tokens into vector lanes only at the end: GN heads x TN tokens (GN * TN = VW) dot
//    products accumulate in VW independent registers (enough to hide the FMA latency) and one transposing
//    reduce() sums all of them, VW - 1 shuffle pairs for VW scores, where a horizontal sum per score
//    takes log2(VW);
//  - a bf16 row is widened 2 * VW values at a time, the even dims by a shift and the odd ones by a mask
//    (one operation each, where a widening load takes two): q and the accumulators are kept in that lane
//    order (`paired`), and the output put back in the head dim's order;
//  - the softmax works on the scores in that layout (its max and sums per lane, spread over a head's
//    lanes), its sums stay in vector lanes until the end, and the rescaling of the accumulators rides on
//    P @ V's loads of them;
//  - the next run's rows are prefetched while this one computes, a few lines per step of the scores and of
//    P @ V alike: blocks lie anywhere, so the hardware prefetcher loses the stream at every block boundary
//    (the prefetch took the 2-thread rate over a DRAM-sized cache from ~13 to ~23 GB/s on an EPYC; issuing
//    it during P @ V too, not in bursts during the scores alone, added ~10 % on a Xeon).
//
// Vectors are GCC's vector extensions, VW floats wide: 16 where the compiler targets AVX-512
// (-march=native on a CPU that has it), else 8 (AVX2); the cross-lane shuffles use the ISA's intrinsics.
// The head dim must be a multiple of 16.
//
// Shapes: q (B, H, Hd) fp32, already scaled by the softmax scale; k, v (NB, BS, K, Hd) in the cache's
// dtype (fp32, bf16, fp16) or int8 with k_scales / v_scales (NB, BS, K) fp32; tables (B, W) int32, a
// sequence's blocks in position order (-1 for one freed behind a sliding window: never read);
// ctx (B,) its tokens; first (B,) the first position it attends (a window's start, else 0);
// sinks (H,) fp32 or empty. Returns (B, H, Hd) fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;
const char* kIsa = "avx512";
#elif defined(__AVX2__)
constexpr int VW = 8;
const char* kIsa = "avx2";
#else
constexpr int VW = 8;
const char* kIsa = "generic";
#endif
constexpr int RUN = 64;  // tokens scored before one softmax update, across blocks: amortises its per-head work
constexpr int MAX_G = 16;
constexpr int WEIGH_STEP = 8;  // P @ V's tokens per prefetch step
constexpr int REGS = VW == 16 ? 16 : 8;  // accumulators that stay in registers beside the rows they read
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef int8_t vi8 __attribute__((vector_size(VW)));

inline vf splat(float x) {  // (vf{} + x would be a scalar add, then a broadcast: 0 + -0 is not -0)
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
}

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// VW consecutive values of a cache row, as fp32 (int8 unscaled: its scales weigh the scores and weights)
inline vf load_row(const float* p) { return load(p); }
inline vf load_row(const c10::BFloat16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);  // bf16 is fp32's top half
}
inline vf load_row(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float tmp[VW];
  for (int i = 0; i < VW; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
#endif
}
inline vf load_row(const int8_t* p) {
  vi8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vf);
}

// S vectors of a row from dim d on (S = 2 where paired, else 1), in the kernel's lane order
template <bool PAIRED, typename T>
inline void load_chunks(const T* row, int d, vf* x) {
  if constexpr (PAIRED) {  // 2 * VW bf16 values as VW 32-bit words: even dims in their low halves
    vu w;
    std::memcpy(&w, row + d, sizeof(w));
    x[0] = (vf)(w << 16);
    x[1] = (vf)(w & 0xFFFF0000u);
  } else {
    x[0] = load_row(row + d);
  }
}
template <bool PAIRED>
constexpr int S = PAIRED ? 2 : 1;

// the lane of the kernel's order that holds dim d of the head
template <bool PAIRED>
inline int lane_of(int d) {
  if constexpr (PAIRED) return (d & ~(2 * VW - 1)) + (d & 1) * VW + (d & (2 * VW - 1)) / 2;
  return d;
}

// VW vectors -> one vector of their VW sums, lane i = sum of a[i]. Each level adds pairs of halves of two
// vectors into one (256-bit, 128-bit, 64-bit, 32-bit halves): VW - 1 adds and 2 (VW - 1) shuffles in all.
// The levels leave the sums in a permuted lane order, PERM (its own inverse), so the inputs go in permuted.
inline vf reduce(const vf* a) {
#if defined(__AVX512F__)
  constexpr int PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 v[8], w[4], x[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: a[PERM[i]]'s 8 partial sums, 8-15: a[PERM[i + 8]]'s
    const __m512 p = (__m512)a[PERM[i]], q = (__m512)a[PERM[i + 8]];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // quarters: PERM[i], PERM[i + 8], PERM[i + 4], PERM[i + 12]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // pairs of lanes
    const __m512d p = (__m512d)w[i], q = (__m512d)w[i + 2];
    x[i] = _mm512_add_ps((__m512)_mm512_unpacklo_pd(p, q), (__m512)_mm512_unpackhi_pd(p, q));
  }
  return (vf)_mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
#elif defined(__AVX2__)
  constexpr int PERM[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  __m256 v[4], x[2];
  for (int i = 0; i < 4; ++i) {  // lanes 0-3: a[PERM[i]]'s 4 partial sums, 4-7: a[PERM[i + 4]]'s
    const __m256 p = (__m256)a[PERM[i]], q = (__m256)a[PERM[i + 4]];
    v[i] = _mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d p = (__m256d)v[i], q = (__m256d)v[i + 2];
    x[i] = _mm256_add_ps((__m256)_mm256_unpacklo_pd(p, q), (__m256)_mm256_unpackhi_pd(p, q));
  }
  return (vf)_mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
#else
  vf r;
  for (int i = 0; i < VW; ++i) {
    float s = 0.0f;
    for (int j = 0; j < VW; ++j) s += a[i][j];
    r[i] = s;
  }
  return r;
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp(x) for x <= 0 (a score less the running max), Cephes' expf: 2^n * P(r), |r| <= ln2 / 2
inline vf vexp(vf x) {
  const auto under = x < -87.0f;  // 0 there (where fp32 goes subnormal): -inf, a masked score, gives 0
  x = under ? splat(-87.0f) : x;
  const vf n = ((x * 1.44269504088896341f) + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return under ? vf{} : p * (vf)e;
}

// The next run's rows of the item's heads (after its last run: the next item's first), fetched into the
// cache while this run computes, a few lines per step in address order (a burst would overrun the
// core's outstanding misses): blocks lie anywhere, so the hardware prefetcher loses the stream at every
// block boundary
struct Prefetch {
  const char* k = nullptr;  // the item's first head in the cache, in bytes
  const char* v = nullptr;
  const int64_t* rows = nullptr;  // the next run's slot offsets (elements), n of them
  int64_t elem = 0;               // bytes per element
  int n = 0, lines = 0;           // tokens, and lines per token (its row of the item's heads)
  int t = 0, line = 0;            // the cursor
  int quota = 0;                  // lines per step()

  void start(const int64_t* next, int nn) {
    rows = next;
    n = nn;
    t = line = 0;
  }
  void step(int count) {
    for (int i = 0; i < count && t < n; ++i) {
      const int64_t at = rows[t] * elem + line * 64;
      __builtin_prefetch(k + at, 0, 1);  // not into L1 (measured slower: it evicts the run being computed)
      __builtin_prefetch(v + at, 0, 1);
      if (++line == lines) {
        line = 0;
        ++t;
      }
    }
  }
  void step() { step(quota); }
};

// One chunk of GN query heads of a KV head over a run of n tokens (rows: their slots' offsets in the
// cache, n..RUN - 1 repeating the last), TN = VW / GN tokens at a time. The scores of GN heads x TN tokens
// are one vector, lane g * TN + t (see score()); the softmax works in that layout: its max and sums are
// per lane, the max spread over a head's TN lanes (m, l: the chunk's running max and sums in VW lanes),
// and p holds the run's weights, vector j for tokens j * TN.. .
template <int GN, bool PAIRED, typename T>
struct Chunk {
  static constexpr int TN = VW / GN;
  static constexpr bool SCALED = std::is_same_v<T, int8_t>;  // ks, vs: an int8 cache's scales per token

  // p[j] = the scores of tokens j * TN.., lane g * TN + t: their GN x TN dot products accumulate in VW
  // registers (over the head dim in lanes) and one reduce() sums them all
  static void score(const float* q, const T* k, const int64_t* rows, const float* ks, int n, int Hd, vf* p,
                    Prefetch& fetch) {
    for (int j = 0; j * TN < n; ++j) {
      fetch.step();
      const T* kr[TN];
#pragma GCC unroll 16
      for (int t = 0; t < TN; ++t) kr[t] = k + rows[j * TN + t];
      vf acc[VW] = {};
      for (int d = 0; d < Hd; d += S<PAIRED> * VW) {
        vf x[TN][S<PAIRED>];
#pragma GCC unroll 16
        for (int t = 0; t < TN; ++t) load_chunks<PAIRED>(kr[t], d, x[t]);
#pragma GCC unroll 2
        for (int c = 0; c < S<PAIRED>; ++c)
#pragma GCC unroll 16
          for (int g = 0; g < GN; ++g) {
            const vf qv = load(q + g * Hd + d + c * VW);
#pragma GCC unroll 16
            for (int t = 0; t < TN; ++t) acc[g * TN + t] += qv * x[t][c];
          }
      }
      p[j] = reduce(acc);
      if constexpr (SCALED) {
        vf s;
        for (int i = 0; i < VW; ++i) s[i] = ks[j * TN + i % TN];
        p[j] *= s;
      }
    }
  }

  // the largest lane of each group of TN (a head's), in all of them: butterflies within the group
  static vf group_max(vf x) {
    for (int s = 1; s < TN; s *= 2) {
      vi flip;
      for (int i = 0; i < VW; ++i) flip[i] = i ^ s;
      x = vmax(x, __builtin_shuffle(x, flip));
    }
    return x;
  }

  // the online softmax's update: p's scores become weights; returns alpha, by which the sums so far
  // shrink (exp(old max - new max), 1 where the max held)
  static vf softmax(vf* p, int n, float* m, float* l) {
    const int J = (n + TN - 1) / TN;
    vi token;  // lane -> its token in vector 0
    for (int i = 0; i < VW; ++i) token[i] = i % TN;
    p[J - 1] = token + (J - 1) * TN < n ? p[J - 1] : splat(NEG_INF);
    vf top = p[0];
    for (int j = 1; j < J; ++j) top = vmax(top, p[j]);
    const vf old = load(m);
    const vf best = vmax(old, group_max(top));
    const vf alpha = vexp(old - best);  // 0 on the first run (old = -inf)
    vf total = load(l) * alpha;
    for (int j = 0; j < J; ++j) {
      const vf e = vexp(p[j] - best);
      total += e;
      p[j] = e;
    }
    store(m, best);
    store(l, total);
    return alpha;
  }

  // acc[g] (GN rows of Hd) = acc[g] * alpha[g] + sum over the run's n tokens of w[g][t] * v[t], DC vectors
  // of the head dim from d on: each value row read once for the GN heads, the sums in registers
  template <int DC>
  static void weigh(const float* w, const float* alpha, const T* v, const int64_t* rows, const float* vs, int n,
                    int d, int Hd, float* acc, Prefetch& fetch) {
    vf a[GN][DC];
#pragma GCC unroll 16
    for (int g = 0; g < GN; ++g) {
      const vf s = splat(alpha[g * TN]);
#pragma GCC unroll 16
      for (int c = 0; c < DC; ++c) a[g][c] = load(acc + g * Hd + d + c * VW) * s;
    }
    for (int t = 0; t < n; ++t) {
      if (t % WEIGH_STEP == 0) fetch.step();
      const T* vr = v + rows[t];
      vf x[DC];
#pragma GCC unroll 16
      for (int c = 0; c < DC; c += S<PAIRED>) load_chunks<PAIRED>(vr, d + c * VW, x + c);
      const float* wt = w + (t / TN) * VW + t % TN;
#pragma GCC unroll 16
      for (int g = 0; g < GN; ++g) {
        const vf wg = splat(SCALED ? wt[g * TN] * vs[t] : wt[g * TN]);
#pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) a[g][c] += wg * x[c];
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < GN; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < DC; ++c) store(acc + g * Hd + d + c * VW, a[g][c]);
  }

  static void attend(const float* q, const T* k, const T* v, const int64_t* rows, const float* ks, const float* vs,
                     int n, int Hd, float* acc, float* m, float* l, Prefetch& fetch) {
    alignas(64) vf p[RUN];
    alignas(64) float alpha[VW];
    score(q, k, rows, ks, n, Hd, p, fetch);
    store(alpha, softmax(p, n, m, l));
    const float* w = reinterpret_cast<const float*>(p);
    constexpr int DC = std::max(S<PAIRED>, REGS / GN);
    int d = 0;
    for (; d + DC * VW <= Hd; d += DC * VW) weigh<DC>(w, alpha, v, rows, vs, n, d, Hd, acc, fetch);
    for (; d < Hd; d += S<PAIRED> * VW) weigh<S<PAIRED>>(w, alpha, v, rows, vs, n, d, Hd, acc, fetch);
  }
};

// a KV head's query heads go in chunks of a power of two, the widest first: the one from head g0 on
inline int chunk_width(int G, int g0) {
  int gn = std::min(MAX_G, VW);
  while (gn > G - g0) gn /= 2;
  return gn;
}

// one KV head's G query heads over a run, chunk by chunk
template <bool PAIRED, typename T>
inline void attend_heads(const float* q, const T* k, const T* v, const int64_t* rows, const float* ks,
                         const float* vs, int n, int G, int Hd, float* acc, float* m, float* l, Prefetch& fetch) {
  for (int g0 = 0, gn; g0 < G; g0 += gn) {
    gn = chunk_width(G, g0);
    const float* qg = q + g0 * Hd;
    float* ag = acc + g0 * Hd;
    float* mg = m + g0 * VW;
    float* lg = l + g0 * VW;
    switch (gn) {
      case 16:
        if constexpr (VW >= 16) Chunk<16, PAIRED, T>::attend(qg, k, v, rows, ks, vs, n, Hd, ag, mg, lg, fetch);
        break;
      case 8: Chunk<8, PAIRED, T>::attend(qg, k, v, rows, ks, vs, n, Hd, ag, mg, lg, fetch); break;
      case 4: Chunk<4, PAIRED, T>::attend(qg, k, v, rows, ks, vs, n, Hd, ag, mg, lg, fetch); break;
      case 2: Chunk<2, PAIRED, T>::attend(qg, k, v, rows, ks, vs, n, Hd, ag, mg, lg, fetch); break;
      default: Chunk<1, PAIRED, T>::attend(qg, k, v, rows, ks, vs, n, Hd, ag, mg, lg, fetch);
    }
  }
}

template <typename T>
struct Item {
  const float* q;  // (H, Hd) the sequence's query heads
  const T* k;      // the cache
  const T* v;
  const float* k_scales;  // (NB, BS, K), or null
  const float* v_scales;
  const int32_t* table;
  int ctx, first, h0, h1, G, K, Hd, BS;  // KV heads h0..h1-1 of the sequence
  const float* sinks;                    // (H,) or null
  float* out;                            // (H, Hd)
};

// Scratch of one thread, per query head of the item: q and acc (Hd, in the kernel's lane order), and VW
// lanes of the running max m and the softmax's sums l (a chunk's lanes start at its first head's)
struct Scratch {
  std::vector<float> q, acc, m, l;
};

// the cache offsets (elements) of the slot rows of positions start..start+n-1, then the last one repeated
inline void run_rows(const int32_t* table, int start, int n, int BS, int64_t stride, int64_t* rows) {
  for (int t = 0; t < n; ++t) {
    const int pos = start + t;
    rows[t] = (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * stride;
  }
  for (int t = n; t < RUN && n > 0; ++t) rows[t] = rows[n - 1];
}

// `after`: the item this thread does next, whose first run the last run prefetches (an item is a few runs,
// so a first run fetched cold cost ~1/7 of a 450-token one); `fetched`: this one's was, by the one before
template <bool PAIRED, typename T>
void attend_item(const Item<T>& it, const Item<T>* after, bool fetched, Scratch& sc) {
  constexpr bool SCALED = std::is_same_v<T, int8_t>;
  const int G = it.G, Hd = it.Hd, K = it.K, BS = it.BS;
  const int heads = it.h1 - it.h0;
  const int rows_n = heads * G;  // the item's query heads
  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int i = 0; i < rows_n; ++i)
    for (int d = 0; d < Hd; ++d) q[i * Hd + lane_of<PAIRED>(d)] = it.q[(static_cast<int64_t>(it.h0) * G + i) * Hd + d];
  std::fill(acc, acc + rows_n * Hd, 0.0f);
  std::fill(m, m + rows_n * VW, NEG_INF);
  std::fill(l, l + rows_n * VW, 0.0f);
  const int64_t stride = static_cast<int64_t>(K) * Hd;  // between token slots
  const int64_t row_bytes = Hd * static_cast<int64_t>(sizeof(T));
  alignas(64) int64_t rows_a[RUN], rows_b[RUN];
  int64_t* rows = rows_a;
  int64_t* next_rows = rows_b;
  alignas(64) float ks[RUN], vs[RUN];  // (int8) the run's scales of one head
  int n = std::min(RUN, it.ctx - it.first);
  run_rows(it.table, it.first, n, BS, stride, rows);
  Prefetch fetch;
  fetch.elem = sizeof(T);
  auto aim = [&](const Item<T>& x) {  // the cursor, at x's heads
    fetch.k = reinterpret_cast<const char*>(x.k + static_cast<int64_t>(x.h0) * Hd);
    fetch.v = reinterpret_cast<const char*>(x.v + static_cast<int64_t>(x.h0) * Hd);
    fetch.lines = static_cast<int>(((x.h1 - x.h0) * row_bytes + 63) / 64);
  };
  aim(it);
  if (!fetched) {
    fetch.start(rows, n);
    fetch.step(n * fetch.lines);  // the first run at once: there is nothing to overlap it with
  }
  alignas(64) int64_t after_rows[RUN];
  for (int start = it.first; start < it.ctx;) {
    const int next = start + n;
    const int nn = std::min(RUN, it.ctx - next);
    if (nn > 0) {
      run_rows(it.table, next, nn, BS, stride, next_rows);
      fetch.start(next_rows, nn);
    } else if (after) {  // the last run: the next item's first
      const int an = std::min(RUN, after->ctx - after->first);
      run_rows(after->table, after->first, an, BS, stride, after_rows);
      aim(*after);
      fetch.start(after_rows, an);
    } else {
      fetch.start(next_rows, 0);
    }
    // prefetch steps in this run, per KV head and chunk of gn heads: a score step per VW / gn tokens, and a
    // weigh step per WEIGH_STEP tokens of each pass over the head dim (rounded down where the last pass is
    // narrower: the run's lines are all asked for before it ends)
    int per_head = 0;
    for (int g0 = 0, gn; g0 < G; g0 += gn) {
      gn = chunk_width(G, g0);
      const int pass = std::max(S<PAIRED>, REGS / gn) * VW;
      per_head += (n + VW / gn - 1) / (VW / gn) + (n + WEIGH_STEP - 1) / WEIGH_STEP * std::max(1, Hd / pass);
    }
    const int steps = heads * per_head;
    fetch.quota = (fetch.n * fetch.lines + steps - 1) / steps;
    for (int h = it.h0; h < it.h1; ++h) {
      const int64_t head = static_cast<int64_t>(h) * Hd;
      const int i0 = (h - it.h0) * G;
      if constexpr (SCALED) {
        for (int t = 0; t < RUN; ++t) {  // (past n: the last token's again)
          const int64_t at = rows[t] / Hd + h;  // its slot * K + h
          ks[t] = it.k_scales[at];
          vs[t] = it.v_scales[at];
        }
      }
      attend_heads<PAIRED>(q + i0 * Hd, it.k + head, it.v + head, rows, ks, vs, n, G, Hd,
                           acc + i0 * Hd, m + i0 * VW, l + i0 * VW, fetch);
    }
    start = next;
    n = nn;
    std::swap(rows, next_rows);
  }
  for (int i0 = 0; i0 < rows_n; i0 += G) {  // each KV head's query heads, chunk by chunk
    for (int g0 = 0, gn; g0 < G; g0 += gn) {
      gn = chunk_width(G, g0);
      const int TN = VW / gn;
      for (int g = g0; g < g0 + gn; ++g) {
        const int i = i0 + g;                              // the item's query head
        const int lane = (i0 + g0) * VW + (g - g0) * TN;   // its chunk's lanes of it
        const int h = it.h0 * G + i;                       // the sequence's
        const float mi = m[lane];
        float norm = 0.0f;
        for (int j = 0; j < TN; ++j) norm += l[lane + j];
        float alpha = 1.0f;
        if (it.sinks) {  // the sink joins the softmax's normaliser, and no value
          const float s = it.sinks[h];
          const float best = std::max(mi, s);
          alpha = std::exp(mi - best);
          norm = norm * alpha + std::exp(s - best);
        }
        const float scale = alpha / norm;
        const float* ai = acc + static_cast<int64_t>(i) * Hd;
        float* oi = it.out + static_cast<int64_t>(h) * Hd;
        for (int d = 0; d < Hd; ++d) oi[d] = ai[lane_of<PAIRED>(d)] * scale;
      }
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const float* k_scales,
         const float* v_scales, const torch::Tensor& tables, const torch::Tensor& ctx, const torch::Tensor& first,
         const float* sinks, torch::Tensor& out) {
  const int B = q.size(0), H = q.size(1), Hd = q.size(2);
  const int BS = k.size(1), K = k.size(2);
  const int G = H / K;
  const int W = tables.size(1);
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* cl = ctx.data_ptr<int32_t>();
  const int32_t* fp = first.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  float* op = out.data_ptr<float>();
  // the bf16 rows widened in pairs where the head dim holds whole pairs of vectors
  constexpr bool BF16 = std::is_same_v<T, c10::BFloat16>;
  const bool paired = BF16 && Hd % (2 * VW) == 0;
  // a sequence's KV heads in one item (its token rows stream through memory), split into `splits`
  // items when there are too few sequences to keep every thread busy; longest first, handed out one
  // at a time: the last items to start are the shortest
  const int64_t threads = std::max(1, at::get_num_threads());
  const int splits = static_cast<int>(std::min<int64_t>(K, std::max<int64_t>(1, (4 * threads + B - 1) / B)));
  const int per = (K + splits - 1) / splits;
  std::vector<int64_t> order(static_cast<size_t>(B) * splits);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cl[a / splits] - fp[a / splits] > cl[b / splits] - fp[b / splits];
  });
  std::atomic<int64_t> next{0};
  const int64_t items = static_cast<int64_t>(order.size());
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    const size_t rows = static_cast<size_t>(per) * G;
    Scratch sc{std::vector<float>(rows * Hd), std::vector<float>(rows * Hd), std::vector<float>(rows * VW),
               std::vector<float>(rows * VW)};
    auto item_at = [&](int64_t i) {  // KV heads h0..h1 of sequence b; none for a split past K
      const int64_t item = order[i];
      const int b = static_cast<int>(item / splits), part = static_cast<int>(item % splits);
      const int h0 = std::min(K, part * per), h1 = std::min(K, h0 + per);
      const int64_t q_off = static_cast<int64_t>(b) * H * Hd;
      return Item<T>{qp + q_off, kp, vp, k_scales, v_scales, tab + static_cast<int64_t>(b) * W,
                     cl[b], fp[b], h0, h1, G, K, Hd, BS, sinks, op + q_off};
    };
    bool fetched = false;
    for (int64_t i = next.fetch_add(1); i < items;) {
      const int64_t j = next.fetch_add(1);  // claimed now, so that this item's last run prefetches its first
      const Item<T> it = item_at(i);
      const Item<T> after = item_at(std::min(j, items - 1));
      const Item<T>* then = j < items && after.h0 < after.h1 ? &after : nullptr;
      if (it.h0 < it.h1) {
        if (paired) {
          if constexpr (BF16) attend_item<true>(it, then, fetched, sc);
        } else {
          attend_item<false>(it, then, fetched, sc);
        }
      }
      fetched = then != nullptr && it.h0 < it.h1;
      i = j;
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scales,
                               torch::Tensor v_scales, torch::Tensor tables, torch::Tensor ctx, torch::Tensor first,
                               torch::Tensor sinks) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q: contiguous (B, H, Hd) fp32");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "k, v: contiguous (NB, BS, K, Hd) of one shape");
  TORCH_CHECK(k.size(3) == q.size(2) && q.size(2) % 16 == 0, "the head dim must match q's and be a multiple of 16");
  TORCH_CHECK(q.size(1) % k.size(2) == 0 && q.size(1) / k.size(2) <= MAX_G, "at most 16 query heads per KV head");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && ctx.dtype() == torch::kInt32 && first.dtype() == torch::kInt32,
              "tables, ctx, first: int32");
  TORCH_CHECK(tables.is_contiguous() && tables.size(0) == q.size(0), "tables: contiguous (B, W)");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.numel() == q.size(1) && sinks.dtype() == torch::kFloat32),
              "sinks: (H,) fp32 or empty");
  auto out = torch::empty_like(q);
  const float* sp = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  if (k.scalar_type() == torch::kChar) {
    TORCH_CHECK(k_scales.numel() && v_scales.numel(), "an int8 cache needs its scales");
    run<int8_t>(q, k, v, k_scales.data_ptr<float>(), v_scales.data_ptr<float>(), tables, ctx, first, sp, out);
  } else if (k.scalar_type() == torch::kFloat32) {
    run<float>(q, k, v, nullptr, nullptr, tables, ctx, first, sp, out);
  } else if (k.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(q, k, v, nullptr, nullptr, tables, ctx, first, sp, out);
  } else if (k.scalar_type() == torch::kHalf) {
    run<c10::Half>(q, k, v, nullptr, nullptr, tables, ctx, first, sp, out);
  } else {
    TORCH_CHECK(false, "the cache's dtype must be fp32, bf16, fp16 or int8");
  }
  return out;
}

}  // namespace

// The GIL is released for the call, as PyTorch's own operators release it (the service's heartbeat and
// gRPC threads keep running beside a long batch).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "GQA decode attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.attr("isa") = kIsa;
}
