// Expert GEMMs at few rows on the host (docs/quantization.md, "Kernels"): y = x @ W^T for an fp32, int8
// or int4 weight (quant/scheme.py's pages as they lie), the weight converted in registers and never
// written out whole in fp32, as dequantize-then-GEMM does.
//
// Every kernel is a dot product along K: a tile of MB activation rows x NB weight rows keeps MB * NB
// vector accumulators, each weight vector is loaded (and converted) once for the MB rows, and each
// accumulator is summed across its lanes once at the end. That is the layout the pages already have
// (row-major (N, K)), so nothing is repacked per call; at decode's 8-64 rows per expert the weight
// bytes, not the FLOPs, are what a dense fp32 GEMM waits on, and these kernels read each byte once.
//
//   dense_f32   fp32 weight.
//   int8_f32    int8 weight, fp32 activations: sum_k x q, times the row's scale at the end.
//   int4_f32    int4 weight, fp32 activations: each nibble to (q - 8) s + z in registers (q s + c,
//               c = z - 8 s), the columns of a byte split into even (high nibble) and odd (low) runs,
//               with the activations split alike once per call.
//   int8_i8     int8 weight, activations quantized to int8 per (row, block of 128 columns): int32 sums
//               of 4-byte products (VNNI's vpdpbusd where the CPU has it; pmaddubsw + pmaddwd on AVX2),
//               scaled by the block's activation scale, the row's weight scale at the end.
//   int4_i8     int4 weight, activations as for int8_i8: the nibbles (0..15) are the unsigned operand
//               as they are, each 128 columns' int32 sums scaled by the weight group's scale times the
//               activation block's; the zeros' share, sum_g c_g sum_{k in g} x_k, from the fp32
//               activations' group sums.
//
// Beside them, argmax_columns: the head's greedy pick over the logits as its GEMM leaves them.
//
// The fp32-activation kernels are exact (the GEMM on the dequantized weight, up to the order of the
// sums); the int8-activation ones round the activations to 8 bits per block of 128.
//
// Vectors: AVX-512 (F, BW, VL and VNNI) where the compiler targets it (-march=native on such a CPU),
// else AVX2 with FMA; without either every GEMM raises, and PyTorch's kernels run instead
// (moe_lightning/quant/kernels.py drops a kernel that raises). Threads: PyTorch's intra-op pool, over
// blocks of weight rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t ABLK = 128;  // activation columns per int8 scale (int8_i8, int4_i8)

// before each loop over a tile's rows, weight rows or vectors: unrolled whole, the accumulator arrays
// are registers (GCC keeps a loop it does not unroll and spills them to the stack, ~2x slower)
#define ML_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ML_VEC 512
const char* kIsa = "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
#define ML_VEC 256
#if defined(__AVXVNNI__)
const char* kIsa = "avx2_vnni";
#else
const char* kIsa = "avx2";
#endif
#else
const char* kIsa = "none";
#endif

#if ML_VEC == 512
struct V {
  using F = __m512;
  using I = __m512i;
  static constexpr int L = 16;      // fp32 lanes
  static constexpr int BYTES = 64;  // int8 lanes
  // registers: the tiles below keep MB * NB accumulators and a few weight vectors in 32 of them
  // (5 x 5 for fp32, measured: 1.2-1.3x a 6 x 4 or 4 x 4 tile over fp32 weights at 16-32 rows, each
  // (N, 1024) and (1024, 3584) shape of the bench model's experts and its lm_head, hot or from DRAM)
  static constexpr int MB_F32 = 5, NB_F32 = 5;
  static constexpr int MB_I4F = 4, NB_I4F = 4;
  static constexpr int MB_I8 = 4, NB_I8 = 4;
  static constexpr int MB_I4 = 16;  // rows of x per R weight rows (tile_i4): 16 share a block's nibble split (0-5 % over 8)
  static F fzero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_partial(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F widen(const float* p) { return load(p); }
  static F widen(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // L bytes of nibbles -> the high and the low nibbles as int32 lanes
  static void nibbles32(const uint8_t* p, I& hi, I& lo) {
    const I v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm512_srli_epi32(v, 4);
    lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
  }
  static F to_f(I v) { return _mm512_cvtepi32_ps(v); }
  static I loadi(const void* p) { return _mm512_loadu_si512(p); }
  static I set1_8(int8_t v) { return _mm512_set1_epi8(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  // acc + per int32 lane the sum of 4 products u8 x s8 (u < 128 on every path)
  static I dot_u8s8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  // the same for s8 x s8: VNNI takes w + 128 as the unsigned side, so the sum is 128 sum(x) too much
  static constexpr bool kBiased = true;
  static I dot_s8s8(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), x); }
  // int4 x int8 (tile_i4): R weight rows a vector, row r's 16 bytes (32 columns) in 128-bit lane r
  static constexpr int R = 4;
  // the 64 bytes at rows[r] + off -> C[c]: lane r = row r's bytes [16 c, 16 c + 16), a 4 x 4 transpose
  static void row_chunks(const uint8_t* const* rows, int64_t off, I C[4]) {
    const I r0 = loadi(rows[0] + off), r1 = loadi(rows[1] + off), r2 = loadi(rows[2] + off), r3 = loadi(rows[3] + off);
    const I t0 = _mm512_shuffle_i64x2(r0, r1, 0x44), t1 = _mm512_shuffle_i64x2(r0, r1, 0xEE);
    const I t2 = _mm512_shuffle_i64x2(r2, r3, 0x44), t3 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
    C[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    C[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
    C[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    C[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
  }
  static I bcast16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F bcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
  // lane r = rows[r][g]
  static F per_row(const float* const* rows, int64_t g) {
    const __m128 v = _mm_setr_ps(rows[0][g], rows[1][g], rows[2][g], rows[3][g]);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v));
  }
  // lane r = rows[r][g, g + n), zeros after
  static F row_quads(const float* const* rows, int64_t g, int n) {
    const __mmask8 k = static_cast<__mmask8>((1u << n) - 1);
    F v = _mm512_castps128_ps512(_mm_maskz_loadu_ps(k, rows[0] + g));
    v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, rows[1] + g), 1);
    v = _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, rows[2] + g), 2);
    return _mm512_insertf32x4(v, _mm_maskz_loadu_ps(k, rows[3] + g), 3);
  }
  // y[r] = the sum of lane r, for r < n
  static void store_lanes(float* y, F acc, int n) {
    F t = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));  // pairs within each lane
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));        // halves within each lane
    const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
    _mm_mask_storeu_ps(y, static_cast<__mmask8>((1u << n) - 1), sums);
  }
};
#elif ML_VEC == 256
struct V {
  using F = __m256;
  using I = __m256i;
  static constexpr int L = 8;
  static constexpr int BYTES = 32;
  static constexpr int MB_F32 = 3, NB_F32 = 3;
  static constexpr int MB_I4F = 2, NB_I4F = 2;
  static constexpr int MB_I8 = 1, NB_I8 = 3;  // 16 registers: the rows' 4 vectors of a block are held
  static constexpr int MB_I4 = 2;
  static F fzero() { return _mm256_setzero_ps(); }
  static I izero() { return _mm256_setzero_si256(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_partial(const float* p, int n) {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, p, sizeof(float) * n);
    return _mm256_load_ps(tmp);
  }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F widen(const float* p) { return load(p); }
  static F widen(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles32(const uint8_t* p, I& hi, I& lo) {
    const I v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_srli_epi32(v, 4);
    lo = _mm256_and_si256(v, _mm256_set1_epi32(15));
  }
  static F to_f(I v) { return _mm256_cvtepi32_ps(v); }
  static I loadi(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1_8(int8_t v) { return _mm256_set1_epi8(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
#if defined(__AVXVNNI__)
  static I dot_u8s8(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
  static constexpr bool kBiased = true;
  static I dot_s8s8(I acc, I w, I x) {
    return _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x);
  }
#else
  // pmaddubsw adds two u8 x s8 products into int16 with saturation: safe for u < 128 (|u s| pairs
  // <= 2 * 127 * 128 < 32768 only if u <= 127); pmaddwd by ones then adds pairs into int32
  static I dot_u8s8(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static constexpr bool kBiased = false;
  // s8 x s8 as |w| x (x with w's sign): |w| <= 128 and |x| <= 127, so a pair stays below 32768
  static I dot_s8s8(I acc, I w, I x) { return dot_u8s8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)); }
#endif
  static constexpr int R = 2;
  static void row_chunks(const uint8_t* const* rows, int64_t off, I C[4]) {
    const I a0 = loadi(rows[0] + off), a1 = loadi(rows[1] + off);
    const I b0 = loadi(rows[0] + off + 32), b1 = loadi(rows[1] + off + 32);
    C[0] = _mm256_permute2x128_si256(a0, a1, 0x20);
    C[1] = _mm256_permute2x128_si256(a0, a1, 0x31);
    C[2] = _mm256_permute2x128_si256(b0, b1, 0x20);
    C[3] = _mm256_permute2x128_si256(b0, b1, 0x31);
  }
  static I bcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F bcast4(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
  static F per_row(const float* const* rows, int64_t g) {
    return _mm256_setr_m128(_mm_set1_ps(rows[0][g]), _mm_set1_ps(rows[1][g]));
  }
  static F row_quads(const float* const* rows, int64_t g, int n) {
    const __m128i k = _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3));
    return _mm256_setr_m128(_mm_maskload_ps(rows[0] + g, k), _mm_maskload_ps(rows[1] + g, k));
  }
  static void store_lanes(float* y, F acc, int n) {
    F t = _mm256_add_ps(acc, _mm256_permute_ps(acc, 0xB1));
    t = _mm256_add_ps(t, _mm256_permute_ps(t, 0x4E));
    y[0] = _mm256_cvtss_f32(t);
    if (n > 1) y[1] = _mm_cvtss_f32(_mm256_extractf128_ps(t, 1));
  }
};
#endif

#ifdef ML_VEC

// calls f(std::integral_constant<int, b>) for the runtime b in 1..MAX: the tiles at the edges of M and N
template <int MAX, class Fn>
inline void dispatch(int b, Fn&& f) {
  if constexpr (MAX >= 1) {
    if (b == MAX) {
      f(std::integral_constant<int, MAX>{});
      return;
    }
    dispatch<MAX - 1>(b, f);
  }
}

// f(mb, nb) as integral constants, for the runtime mb <= MB and nb <= NB: a tile's shape is fixed at
// compile time, so its accumulators stay in registers
template <int MB, int NB, class Fn>
inline void tiles(int mb, int nb, Fn&& f) {
  dispatch<MB>(mb, [&](auto mbc) { dispatch<NB>(nb, [&](auto nbc) { f(mbc, nbc); }); });
}

// Weights a decode step reads once come from DRAM, and a block of NB weight rows is a few KiB: too short for
// the hardware's stream prefetcher to find before it ends. So each thread prefetches (into L2) the rows
// PREFETCH_AHEAD bytes, or one block if that is more, ahead of the block it computes, a few lines at each step
// of the tile's loop along K: a burst at the start of a block (the first version) held the core until its
// misses came back, so it overlapped nothing for rows of 3.5 KiB or more, and it took the fp32 tile not at all;
// spread, the fp32 GEMM at (3584, 1024), 8 and 16 rows, went from 19 and 13 to 24 and 15 GB/s.
constexpr int64_t PREFETCH_AHEAD = 8192;

// A thread's prefetch cursor over its share of the weight: `tile` calls step() once per step along K, and
// each call fetches up to `quota` lines, never past `limit` (the block after the one computed, shifted
// ahead), so the cursor keeps its distance instead of running through the whole share.
struct Prefetch {
  const char* at = nullptr;
  const char* limit = nullptr;
  int quota = 0;
  inline void step() {
    // (an asm statement: GCC 12 deleted this loop, written with __builtin_prefetch or _mm_prefetch, as one
    // without effects)
    for (int i = 0; i < quota && at < limit; ++i, at += 64) asm volatile("prefetcht2 %0" : : "m"(*at));
  }
};

// weight rows [0, N) in blocks of NB, split across PyTorch's threads; `tile(n, nb, fetch)` computes them,
// calling fetch.step() at each of its `steps_per_block` steps along K (all its passes over the block's rows
// together). `w`, `row_bytes`: the weight's rows as they lie
template <class Tile>
void over_blocks(int64_t N, int64_t NB, int64_t work_per_block, const void* w, int64_t row_bytes,
                 int64_t steps_per_block, Tile&& tile) {
  const int64_t blocks = (N + NB - 1) / NB;
  // a grain of ~64K multiply-adds: a thread's share is worth waking it for
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work_per_block));
  const char* base = static_cast<const char*>(w);
  const int64_t block_bytes = NB * row_bytes;
  const int64_t ahead = (std::max(PREFETCH_AHEAD, block_bytes) + 63) / 64 * 64;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const char* first = base + b0 * block_bytes;
    const char* end = base + std::min(N, b1 * NB) * row_bytes;
    Prefetch fetch;
    fetch.at = first;
    fetch.limit = std::min(end, first + ahead);
    fetch.quota = static_cast<int>(ahead / 64);
    fetch.step();  // the first `ahead` bytes at once: nothing to overlap them with
    fetch.quota = static_cast<int>((block_bytes / 64 + steps_per_block - 1) / std::max<int64_t>(1, steps_per_block));
    for (int64_t b = b0; b < b1; ++b) {
      fetch.limit = std::min(end, base + (b + 1) * block_bytes + ahead);
      const int64_t n = b * NB;
      tile(n, std::min(NB, N - n), fetch);
    }
  });
}

// ---- fp32 activations: dense_f32, int8_f32 ------------------------------------------------------
// A block's weight rows are read once per tile of x's rows; over a long K (a down projection's 3584) the
// block outgrows the L1 and each tile reads it again from the L2. So K is taken in chunks of F32_KC
// columns, every tile of x over one chunk before the next (the block's chunk, 20 KiB in fp32, stays in
// the L1), each tile's accumulators kept between chunks: the sums are the same, in the same order.
// From DRAM at (1024, 3584), 16 / 24 / 33 rows: 0.95 / 1.13 / 1.34 -> 0.96 / 0.96 / 1.25 ms; chunks of
// 512 columns were slower at K = 1024 (docs/quantization.md, "Kernels").
constexpr int64_t F32_KC = 1024;

// the tile over columns [k0, k1) (k0 a multiple of V::L; k1 too, or K): the accumulators start at zero at
// k0 = 0, else from `part`; they go back to `part` unless k1 = K, where they are summed and written out
template <int MB, int NB, class W>
inline void tile_f32(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw, const float* scale,
                     float* y, int64_t ldy, Prefetch& fetch, typename V::F* part) {
  typename V::F acc[MB][NB];
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) acc[i][j] = k0 == 0 ? V::fzero() : part[i * NB + j];
  const int64_t kv = k1 == K ? K - K % V::L : k1;
  for (int64_t k = k0; k < kv; k += V::L) {
    fetch.step();
    typename V::F wv[NB];
    ML_UNROLL
    for (int j = 0; j < NB; ++j) wv[j] = V::widen(w + j * ldw + k);
    ML_UNROLL
    for (int i = 0; i < MB; ++i) {
      const typename V::F xv = V::load(x + i * K + k);
      ML_UNROLL
      for (int j = 0; j < NB; ++j) acc[i][j] = V::fma(xv, wv[j], acc[i][j]);
    }
  }
  if (k1 != K) {
    ML_UNROLL
    for (int i = 0; i < MB; ++i)
      ML_UNROLL
      for (int j = 0; j < NB; ++j) part[i * NB + j] = acc[i][j];
    return;
  }
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) {
      float s = V::hsum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s += x[i * K + k] * static_cast<float>(w[j * ldw + k]);
      y[i * ldy + j] = scale == nullptr ? s : s * scale[j];
    }
}

template <class W>
torch::Tensor gemm_f32(const torch::Tensor& x, const W* w, int64_t N, const float* scale) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t mtiles = (M + V::MB_F32 - 1) / V::MB_F32;
  const int64_t steps = mtiles * (K / V::L);
  // one tile of x reads the block once anyway: chunks only where there are several
  const int64_t kc = mtiles > 1 && K > F32_KC ? F32_KC : K;
  constexpr int64_t TILE = V::MB_F32 * V::NB_F32;
  over_blocks(N, V::NB_F32, M * K * V::NB_F32, w, K * static_cast<int64_t>(sizeof(W)), steps, [&](int64_t n, int64_t nb, Prefetch& fetch) {
    thread_local std::vector<typename V::F> part;  // the tiles' accumulators between chunks, kept for the next call
    if (kc < K && part.size() < static_cast<size_t>(mtiles * TILE)) part.resize(mtiles * TILE);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t k1 = std::min(K, k0 + kc);
      for (int64_t m = 0; m < M; m += V::MB_F32) {
        const int mb = static_cast<int>(std::min<int64_t>(V::MB_F32, M - m));
        typename V::F* p = kc < K ? part.data() + m / V::MB_F32 * TILE : nullptr;
        tiles<V::MB_F32, V::NB_F32>(mb, static_cast<int>(nb), [&](auto mbc, auto nbc) {
          tile_f32<decltype(mbc)::value, decltype(nbc)::value>(xp + m * K, K, k0, k1, w + n * K, K, scale == nullptr ? nullptr : scale + n, yp + m * N + n, N, fetch, p);
        });
      }
    }
  });
  return y;
}

// ---- int4, fp32 activations ----------------------------------------------------------------------
// x: (M, K) with each run of 2L columns reordered as its L even columns, then its L odd ones (the
// high and the low nibbles of L bytes)
torch::Tensor split_even_odd(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += 2 * V::L)
      ML_UNROLL
      for (int l = 0; l < V::L; ++l) {
        dst[m * K + k0 + l] = src[m * K + k0 + 2 * l];
        dst[m * K + k0 + V::L + l] = src[m * K + k0 + 2 * l + 1];
      }
  return out;
}

template <int MB, int NB>
inline void tile_i4f(const float* x, int64_t K, const uint8_t* q, const float* s, const float* z, int64_t G,
                     float* y, int64_t ldy, Prefetch& fetch) {
  const int64_t groups = K / G, half = K / 2;
  typename V::F acc[MB][NB], sv[NB], cv[NB];
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) acc[i][j] = V::fzero();
  for (int64_t k = 0; k < K; k += 2 * V::L) {
    fetch.step();
    if (k % G == 0) {  // a new group: w = q s + (z - 8 s)
      const int64_t g = k / G;
      ML_UNROLL
      for (int j = 0; j < NB; ++j) {
        const float sj = s[j * groups + g];
        sv[j] = V::set1(sj);
        cv[j] = V::set1(z[j * groups + g] - 8.0f * sj);
      }
    }
    typename V::F we[NB], wo[NB];
    ML_UNROLL
    for (int j = 0; j < NB; ++j) {
      typename V::I hi, lo;
      V::nibbles32(q + j * half + k / 2, hi, lo);
      we[j] = V::fma(V::to_f(hi), sv[j], cv[j]);
      wo[j] = V::fma(V::to_f(lo), sv[j], cv[j]);
    }
    ML_UNROLL
    for (int i = 0; i < MB; ++i) {
      const typename V::F xe = V::load(x + i * K + k), xo = V::load(x + i * K + k + V::L);
      ML_UNROLL
      for (int j = 0; j < NB; ++j) acc[i][j] = V::fma(xo, wo[j], V::fma(xe, we[j], acc[i][j]));
    }
  }
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = V::hsum(acc[i][j]);
}

// ---- int8 activations: int8_i8, int4_i8 -----------------------------------------------------------
struct QuantizedActivations {
  torch::Tensor q;      // (M, K) int8, columns in the kernel's order
  torch::Tensor scale;  // (M, K / ABLK) fp32
  torch::Tensor total;  // (M,) fp32: sum of the dequantized activations (the biased VNNI sum's excess)
  torch::Tensor gsum;   // (M, K / G rounded up to 4) fp32: the same per group of G columns (int4's zeros)
};

// per (row, block of ABLK columns): scale = max|x| / 127, q = round(x / scale); with `run` > 0 each run
// of 2 run columns is reordered even columns first (the high nibbles' columns, then the low ones'). The sums are
// of the dequantized activations, so that a weight's offset (int4's zero) multiplies the same
// activations its scaled part does: the rounding error is then sum (x - x') w, with w centred on 0,
// not sum (x - x') q with q in 0..15 (twice the error, measured).
QuantizedActivations quantize_rows(const torch::Tensor& x, int64_t run, int64_t G) {
  // vectors of GCC's extensions, a block's 128 columns in 8 or 16 of them: the compiler splits them into the
  // ISA's widths (the per-element rint and index arithmetic of a scalar loop took a third of a 64-row
  // int4 GEMM's time at the w2 shape)
  typedef float v16f __attribute__((vector_size(64)));
  typedef int32_t v16i __attribute__((vector_size(64)));
  constexpr int VN = 16, NV = ABLK / VN;
  TORCH_CHECK(run == 0 || run == 16, "quantize_rows: runs of 0 or 16 columns");
  const int64_t M = x.size(0), K = x.size(1), blk = ABLK, blocks = K / blk, groups = G > 0 ? K / G : 0;
  QuantizedActivations a{torch::empty({M, K}, x.options().dtype(torch::kInt8)),
                         torch::empty({M, blocks}, x.options()), torch::empty({M}, x.options()),
                         torch::zeros({M, (groups + 3) / 4 * 4}, x.options())};  // 4 groups a load
  const float* src = x.data_ptr<float>();
  int8_t* q = a.q.data_ptr<int8_t>();
  float* sc = a.scale.data_ptr<float>();
  float* tot = a.total.data_ptr<float>();
  float* gs = a.gsum.data_ptr<float>();
  const int64_t gstride = a.gsum.size(1);
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    alignas(64) int32_t qi[ABLK];
    for (int64_t m = m0; m < m1; ++m) {
      float total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = src + m * K + b * blk;
        v16f xv[NV];
        std::memcpy(xv, xb, sizeof(xv));
        v16f amax{};
        for (int c = 0; c < NV; ++c) {
          const v16f ax = xv[c] < 0.0f ? -xv[c] : xv[c];
          amax = ax > amax ? ax : amax;
        }
        float top = 0.0f;
        for (int l = 0; l < VN; ++l) top = std::max(top, amax[l]);
        const float scale = top > 0.0f ? top / 127.0f : 1.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        sc[m * blocks + b] = scale;
        for (int c = 0; c < NV; ++c) {  // rounded as nearbyint rounds (the current mode: to nearest even)
          const v16f p = xv[c] * inv;
          v16i r;
#if defined(__AVX512F__)
          r = (v16i)_mm512_cvtps_epi32((__m512)p);
#else
          for (int h = 0; h < 2; ++h) {
            const __m256i half = _mm256_cvtps_epi32(_mm256_loadu_ps(reinterpret_cast<const float*>(&p) + 8 * h));
            std::memcpy(reinterpret_cast<int32_t*>(&r) + 8 * h, &half, sizeof(half));
          }
#endif
          std::memcpy(qi + c * VN, &r, sizeof(r));
        }
        int8_t* qb = q + m * K + b * blk;
        if (run > 0) {  // each run of 32 columns: its 16 even columns, then its 16 odd ones
          for (int64_t r0 = 0; r0 < blk; r0 += 32)
            for (int j = 0; j < 16; ++j) {
              qb[r0 + j] = static_cast<int8_t>(qi[r0 + 2 * j]);
              qb[r0 + 16 + j] = static_cast<int8_t>(qi[r0 + 2 * j + 1]);
            }
        } else {
          for (int64_t k = 0; k < blk; ++k) qb[k] = static_cast<int8_t>(qi[k]);
        }
        int32_t sum = 0;
        if (groups) {  // a group is whole runs of 32 columns: its part in this block, summed as integers
          int32_t group_sum = 0;
          int64_t g = b * blk / G;
          for (int64_t r0 = 0; r0 < blk; r0 += 32) {
            int32_t s32 = 0;
            for (int k = 0; k < 32; ++k) s32 += qi[r0 + k];
            const int64_t rg = (b * blk + r0) / G;
            if (rg != g) {
              gs[m * gstride + g] += scale * static_cast<float>(group_sum);
              group_sum = 0;
              g = rg;
            }
            group_sum += s32;
            sum += s32;
          }
          gs[m * gstride + g] += scale * static_cast<float>(group_sum);
        } else {
          for (int64_t k = 0; k < blk; ++k) sum += qi[k];
        }
        total += scale * static_cast<float>(sum);
      }
      tot[m] = total;
    }
  });
  return a;
}

template <int MB, int NB>
inline void tile_i8(const QuantizedActivations& a, int64_t m, int64_t K, const int8_t* w, const float* ws, float* y,
                    int64_t ldy, Prefetch& fetch) {
  const int64_t blocks = K / ABLK;
  const int8_t* xq = a.q.data_ptr<int8_t>() + m * K;
  const float* xs = a.scale.data_ptr<float>() + m * blocks;
  constexpr int C = ABLK / V::BYTES;  // vectors in a block
  typename V::F acc[MB][NB];
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) acc[i][j] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    fetch.step();
    typename V::I xv[MB][C];  // the rows' activations, loaded once for the NB weight rows
    ML_UNROLL
    for (int i = 0; i < MB; ++i)
      ML_UNROLL
      for (int c = 0; c < C; ++c) xv[i][c] = V::loadi(xq + i * K + b * ABLK + c * V::BYTES);
    ML_UNROLL
    for (int j = 0; j < NB; ++j) {
      typename V::I wv[C];
      ML_UNROLL
      for (int c = 0; c < C; ++c) wv[c] = V::loadi(w + j * K + b * ABLK + c * V::BYTES);
      ML_UNROLL
      for (int i = 0; i < MB; ++i) {
        typename V::I d = V::izero();
        ML_UNROLL
        for (int c = 0; c < C; ++c) d = V::dot_s8s8(d, wv[c], xv[i][c]);
        acc[i][j] = V::fma(V::to_f(d), V::set1(xs[i * blocks + b]), acc[i][j]);
      }
    }
  }
  const float* total = a.total.data_ptr<float>() + m;
  ML_UNROLL
  for (int i = 0; i < MB; ++i)
    ML_UNROLL
    for (int j = 0; j < NB; ++j) {
      const float sum = V::hsum(acc[i][j]) - (V::kBiased ? 128.0f * total[i] : 0.0f);
      y[i * ldy + j] = sum * ws[j];
    }
}

// R weight rows at once (a 128-bit lane each), for groups of G = 128 / GPB columns or more: a block of
// 128 columns is 8 VNNI per row (high and low nibbles of 4 chunks of 16 bytes), its int32 sums scaled
// once per group for the R rows together, where the dot layout of tile_i8 scales each row's vector.
// Rows past N repeat the last one and are not stored.
template <int MB, int GPB>
inline void tile_i4(const QuantizedActivations& a, int64_t m, int64_t K, const uint8_t* q, const float* s,
                    const float* z, int64_t G, int64_t n0, int64_t N, float* y, int64_t ldy, Prefetch& fetch) {
  constexpr int R = V::R, CPG = 4 / GPB;  // chunks of 16 bytes per group within a block
  const int64_t groups = K / G, half = K / 2, blocks = K / ABLK, gstride = a.gsum.size(1);
  const int nr = static_cast<int>(std::min<int64_t>(R, N - n0));
  const uint8_t* rows[R];
  const float *srow[R], *zrow[R];
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + std::min(r, nr - 1);
    rows[r] = q + n * half;
    srow[r] = s + n * groups;
    zrow[r] = z + n * groups;
  }
  const int8_t* xq = a.q.data_ptr<int8_t>() + m * K;
  const float* xs = a.scale.data_ptr<float>() + m * blocks;
  typename V::F acc[MB];
  ML_UNROLL
  for (int i = 0; i < MB; ++i) acc[i] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    fetch.step();
    typename V::I hi[4], lo[4];
    V::row_chunks(rows, b * (ABLK / 2), hi);
    ML_UNROLL
    for (int c = 0; c < 4; ++c) {
      const typename V::I m15 = V::set1_8(15);
      lo[c] = V::and_(hi[c], m15);
      hi[c] = V::and_(V::srli16(hi[c], 4), m15);
    }
    typename V::F sv[GPB];
    ML_UNROLL
    for (int gi = 0; gi < GPB; ++gi) sv[gi] = V::per_row(srow, b * ABLK / G + gi);
    ML_UNROLL
    for (int i = 0; i < MB; ++i) {
      const int8_t* xb = xq + i * K + b * ABLK;  // 4 chunks of 32 columns: 16 even, then 16 odd
      typename V::F t = V::fzero();
      ML_UNROLL
      for (int gi = 0; gi < GPB; ++gi) {
        typename V::I d = V::izero();
        ML_UNROLL
        for (int c = gi * CPG; c < (gi + 1) * CPG; ++c) {
          d = V::dot_u8s8(d, hi[c], V::bcast16(xb + 32 * c));
          d = V::dot_u8s8(d, lo[c], V::bcast16(xb + 32 * c + 16));
        }
        t = GPB == 1 ? V::mul(V::to_f(d), sv[0]) : V::fma(V::to_f(d), sv[gi], t);
      }
      acc[i] = V::fma(t, V::set1(xs[i * blocks + b]), acc[i]);
    }
  }
  // the zeros' share: sum_g (z - 8 s)[n, g] * (the group's activations' sum), 4 groups per lane at a time
  for (int64_t g = 0; g < groups; g += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, groups - g));
    const typename V::F c = V::fma(V::row_quads(srow, g, n), V::set1(-8.0f), V::row_quads(zrow, g, n));
    const float* gs = a.gsum.data_ptr<float>() + m * gstride + g;
    ML_UNROLL
    for (int i = 0; i < MB; ++i) acc[i] = V::fma(c, V::bcast4(gs + i * gstride), acc[i]);
  }
  ML_UNROLL
  for (int i = 0; i < MB; ++i) V::store_lanes(y + i * ldy + n0, acc[i], nr);
}

#endif  // ML_VEC

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "x: contiguous (M, K) fp32 on the CPU");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

void check_available() {
#ifndef ML_VEC
  TORCH_CHECK(false, "expert_gemm was built without AVX2/AVX-512 (", kIsa, "): no native expert kernels");
#endif
}

void check_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "qweight: contiguous (N, K) int8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == q.size(0),
              "scales: (N,) fp32");
  check_x(x, q.size(1));
}

void check_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& z) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.is_contiguous(), "qweight: contiguous (N, K/2) uint8");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  check_x(x, K);
  TORCH_CHECK(s.dtype() == torch::kFloat32 && z.dtype() == torch::kFloat32 && s.is_contiguous() && z.is_contiguous() &&
                  s.dim() == 2 && s.size(0) == N && z.sizes() == s.sizes() && K % s.size(1) == 0,
              "scales, zeros: contiguous (N, K/G) fp32");
}

}  // namespace

// Writes a tensor's lines back and drops them from every cache level. The kernel race (quant/kernels.py)
// times each call over a weight evicted so: a decode step reads each expert once, after gigabytes of the
// others, so from DRAM, and a weight the race had just read sat in the L3 (docs/quantization.md,
// "Kernels"). Plain clflush where the build has no clflushopt: slower, the same effect.
void evict(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "evict: a contiguous tensor on the CPU");
  const auto* p = static_cast<const char*>(t.data_ptr());
  const char* end = p + t.numel() * t.element_size();
  for (auto* q = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}); q < end; q += 64) {
#ifdef __CLFLUSHOPT__
    _mm_clflushopt(const_cast<char*>(q));
#else
    _mm_clflush(q);
#endif
  }
  _mm_sfence();
}

torch::Tensor dense_f32(const torch::Tensor& x, const torch::Tensor& w) {
  check_available();
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous(), "w: contiguous (N, K) fp32");
  check_x(x, w.size(1));
#ifdef ML_VEC
  return gemm_f32(x, w.data_ptr<float>(), w.size(0), nullptr);
#else
  return {};
#endif
}

torch::Tensor int8_f32(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  check_available();
  check_int8(x, q, scales);
#ifdef ML_VEC
  return gemm_f32(x, q.data_ptr<int8_t>(), q.size(0), scales.data_ptr<float>());
#else
  return {};
#endif
}

torch::Tensor int4_f32(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& z) {
  check_available();
  check_int4(x, q, s, z);
#ifdef ML_VEC
  const int64_t M = x.size(0), N = q.size(0), K = x.size(1), G = K / s.size(1);
  TORCH_CHECK(G % (2 * V::L) == 0, "int4_f32 takes groups of a multiple of ", 2 * V::L, " columns, not ", G);
  const auto xe = split_even_odd(x);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xe.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *zp = z.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = s.size(1);
  const int64_t steps = (M + V::MB_I4F - 1) / V::MB_I4F * (K / (2 * V::L));
  over_blocks(N, V::NB_I4F, M * K * V::NB_I4F, qp, K / 2, steps, [&](int64_t n, int64_t nb, Prefetch& fetch) {
    for (int64_t m = 0; m < M; m += V::MB_I4F) {
      const int mb = static_cast<int>(std::min<int64_t>(V::MB_I4F, M - m));
      tiles<V::MB_I4F, V::NB_I4F>(mb, static_cast<int>(nb), [&](auto mbc, auto nbc) {
        tile_i4f<decltype(mbc)::value, decltype(nbc)::value>(xp + m * K, K, qp + n * (K / 2), sp + n * groups, zp + n * groups, G, yp + m * N + n, N, fetch);
      });
    }
  });
  return y;
#else
  return {};
#endif
}

torch::Tensor int8_i8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  check_available();
  check_int8(x, q, scales);
#ifdef ML_VEC
  const int64_t M = x.size(0), N = q.size(0), K = x.size(1);
  TORCH_CHECK(K % ABLK == 0, "int8_i8 takes a multiple of ", ABLK, " columns, not ", K);
  const auto a = quantize_rows(x, 0, 0);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t steps = (M + V::MB_I8 - 1) / V::MB_I8 * (K / ABLK);
  over_blocks(N, V::NB_I8, M * K * V::NB_I8 / 4, qp, K, steps, [&](int64_t n, int64_t nb, Prefetch& fetch) {
    for (int64_t m = 0; m < M; m += V::MB_I8) {
      const int mb = static_cast<int>(std::min<int64_t>(V::MB_I8, M - m));
      tiles<V::MB_I8, V::NB_I8>(mb, static_cast<int>(nb), [&](auto mbc, auto nbc) {
        tile_i8<decltype(mbc)::value, decltype(nbc)::value>(a, m, K, qp + n * K, sp + n, yp + m * N + n, N, fetch);
      });
    }
  });
  return y;
#else
  return {};
#endif
}

torch::Tensor int4_i8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& z) {
  check_available();
  check_int4(x, q, s, z);
#ifdef ML_VEC
  const int64_t M = x.size(0), N = q.size(0), K = x.size(1), groups = s.size(1), G = K / groups;
  TORCH_CHECK(K % ABLK == 0, "int4_i8 takes a multiple of ", ABLK, " columns, not ", K);
  TORCH_CHECK(G % 32 == 0, "int4_i8 takes groups of a multiple of 32 columns, not ", G);
  const auto a = quantize_rows(x, 16, G);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *zp = z.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int gpb = G >= ABLK ? 1 : static_cast<int>(ABLK / G);  // groups per block of 128 columns: 1, 2 or 4
  // passes of MB_I4 rows, then of up to MB_I4 / 2: a tile per width and group count, 27 instances where
  // every width to MB_I4 would make 48 (their build time is most of the extension's), at the same speed
  // for a remainder as a tile of MB_I4 / 2 rows had
  constexpr int HALF = std::max(1, V::MB_I4 / 2);
  auto width = [&](int64_t left) { return left >= V::MB_I4 ? V::MB_I4 : static_cast<int>(std::min<int64_t>(HALF, left)); };
  int64_t passes = 0;
  for (int64_t m = 0; m < M; m += width(M - m)) ++passes;
  over_blocks(N, V::R, M * K * V::R / 4, qp, K / 2, passes * (K / ABLK), [&](int64_t n, int64_t, Prefetch& fetch) {
    for (int64_t m = 0, mb; m < M; m += mb) {
      mb = width(M - m);
      auto run = [&](auto mbc) {
        dispatch<4>(gpb, [&](auto gpbc) {
          constexpr int GPB = decltype(gpbc)::value;
          if constexpr (GPB != 3) {
            tile_i4<decltype(mbc)::value, GPB>(a, m, K, qp, sp, zp, G, n, N, yp + m * N, N, fetch);
          }
        });
      };
      if (mb == V::MB_I4) {
        run(std::integral_constant<int, V::MB_I4>{});
      } else {
        dispatch<HALF>(static_cast<int>(mb), run);
      }
    }
  });
  return y;
#else
  return {};
#endif
}

// ---- the head's greedy pick ------------------------------------------------------------------------
// Each column's first maximum of a contiguous (R, C) fp32 tensor, NaN counting as the maximum (torch.argmax's
// rule). The head's GEMM at many rows is MKL's weight-major one (quant/kernels.py), which leaves the logits
// as a (V, B) tensor viewed as (B, V): torch's argmax over that view's strided last dim took 22 ms for
// 256 x 32000 logits here, a quarter of the head's time; this reads the (V, B) rows as they lie, each
// thread a run of them with its running maxima across B (vectorized), in 0.65 ms (docs/quantization.md).
torch::Tensor argmax_columns(const torch::Tensor& t) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous() && t.device().is_cpu() && t.size(0) > 0,
              "argmax_columns: a contiguous (R, C) fp32 tensor on the CPU with R > 0");
  const int64_t R = t.size(0), C = t.size(1);
  const float* p = t.data_ptr<float>();
  // runs of at least 256 rows: fewer are not worth a thread
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), R / 256));
  std::vector<float> best(runs * C);
  std::vector<int64_t> where(runs * C);
  auto take = [](float v, float b) { return v > b || (v != v && b == b); };
  at::parallel_for(0, runs, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int32_t> row(C);  // int32 beside the fp32 maxima: both vectorize at the same width
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r0 = R * u / runs, r1 = R * (u + 1) / runs;
      float* b = best.data() + u * C;
      std::copy(p + r0 * C, p + (r0 + 1) * C, b);
      std::fill(row.begin(), row.end(), 0);
      for (int64_t r = r0 + 1; r < r1; ++r) {
        const float* v = p + r * C;
        const auto rr = static_cast<int32_t>(r - r0);
        for (int64_t j = 0; j < C; ++j) {
          const bool hit = take(v[j], b[j]);
          b[j] = hit ? v[j] : b[j];
          row[j] = hit ? rr : row[j];
        }
      }
      for (int64_t j = 0; j < C; ++j) where[u * C + j] = r0 + row[j];
    }
  });
  auto out = torch::empty({C}, t.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t j = 0; j < C; ++j) {  // the runs in row order: an equal maximum of a later run loses
    float bj = best[j];
    int64_t wj = where[j];
    for (int64_t u = 1; u < runs; ++u)
      if (take(best[u * C + j], bj)) bj = best[u * C + j], wj = where[u * C + j];
    o[j] = wj;
  }
  return out;
}

// The GIL is released for the call, as PyTorch's own operators release it: a service's other threads
// (the shared-memory heartbeat, gRPC) keep running beside a long GEMM, or its peer would judge it dead.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("dense_f32", &dense_f32, "x (M, K) fp32, w (N, K) fp32 -> x @ w^T", nogil());
  m.def("int8_f32", &int8_f32, "x (M, K) fp32, qweight (N, K) int8, scales (N,) -> x @ (q s)^T", nogil());
  m.def("int4_f32", &int4_f32, "x (M, K) fp32, qweight (N, K/2) uint8, scales, zeros (N, K/G) -> x @ deq^T", nogil());
  m.def("int8_i8", &int8_i8, "int8_f32 with x quantized to int8 per (row, 128 columns)", nogil());
  m.def("int4_i8", &int4_i8, "int4_f32 with x quantized to int8 per (row, 128 columns)", nogil());
  m.def("argmax_columns", &argmax_columns, "t (R, C) fp32 -> each column's first maximum (C,) int64", nogil());
  m.def("evict", &evict, "drops a contiguous host tensor's bytes from the caches", nogil());
  m.attr("isa") = kIsa;  // the vector instructions this build uses
}
