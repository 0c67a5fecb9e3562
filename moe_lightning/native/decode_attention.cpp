// Decode attention over the paged host KV cache (docs/kv-cache.md, "The decode kernel").
//
// One work item is a (sequence, KV head): its G = H / K query heads attend together, so each key and
// value row of the sequence's context is read from the cache once, where its block lies (no gathered
// copy), converted to fp32 in registers and used by all G heads. The softmax is the online one, over
// runs of up to RUN tokens of one block, in fp32 (exp by a vectorised polynomial, within 2 ulp); a
// head's sink logit (GPT-OSS) joins the normaliser at the end. Items run longest first and are handed
// out one at a time from an atomic counter on PyTorch's own intra-op threads, so ragged contexts
// balance across them.
//
// Vectors are GCC's vector extensions, VW floats wide: 16 where the compiler targets AVX-512
// (-march=native on a CPU that has it), else 8 (AVX2). The head dim must be a multiple of 16.
//
// Shapes: q (B, H, Hd) fp32, already scaled by the softmax scale; k, v (NB, BS, K, Hd) in the cache's
// dtype (fp32, bf16, fp16) or int8 with k_scales / v_scales (NB, BS, K) fp32; tables (B, W) int32, a
// sequence's blocks in position order (-1 for one freed behind a sliding window: never read);
// ctx (B,) its tokens; first (B,) the first position it attends (a window's start, else 0);
// sinks (H,) fp32 or empty. Returns (B, H, Hd) fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
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
constexpr int RUN = 16;  // tokens scored before one softmax update
constexpr int MAX_G = 16;

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef int8_t vi8 __attribute__((vector_size(VW)));

inline vf splat(float x) { return vf{} + x; }

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// VW consecutive values of a cache row, as fp32
inline vf load_row(const float* p, float) { return load(p); }
inline vf load_row(const c10::BFloat16* p, float) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);  // bf16 is fp32's top half
}
inline vf load_row(const c10::Half* p, float) {
  float tmp[VW];
  for (int i = 0; i < VW; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}
inline vf load_row(const int8_t* p, float scale) {
  vi8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vf) * scale;
}

// a tree of halvings: log2(VW) shuffles and adds, where a left-to-right sum is VW - 1 dependent adds
inline float hsum(vf x) {
#if defined(__AVX512F__)
  x += __builtin_shuffle(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
  x += __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3});
  x += __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5});
  x += __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6});
#endif
  return x[0];
}

inline float hmax(vf x) {
  float s = x[0];
  for (int i = 1; i < VW; ++i) s = std::max(s, x[i]);
  return s;
}

// exp(x) for x <= 0 (a score less the running max), Cephes' expf: 2^n * P(r), |r| <= ln2 / 2
inline vf vexp(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
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
  return p * (vf)e;
}

// scores of tokens t..t+1 (or t alone) for GN heads: each key row loaded once for them
template <int GN, typename T>
inline void score_chunk(const float* q, const T* krow, int64_t row_stride, const float* ks, int n, int Hd,
                        float* p /* (GN, RUN) */) {
  int t = 0;
  for (; t + 1 < n; t += 2) {
    vf a0[GN] = {}, a1[GN] = {};
    const T* k0 = krow + t * row_stride;
    const T* k1 = k0 + row_stride;
    for (int d = 0; d < Hd; d += VW) {
      const vf x0 = load_row(k0 + d, ks[t]);
      const vf x1 = load_row(k1 + d, ks[t + 1]);
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) {
        const vf qv = load(q + g * Hd + d);
        a0[g] += qv * x0;
        a1[g] += qv * x1;
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      p[g * RUN + t] = hsum(a0[g]);
      p[g * RUN + t + 1] = hsum(a1[g]);
    }
  }
  if (t < n) {
    vf a0[GN] = {};
    const T* k0 = krow + t * row_stride;
    for (int d = 0; d < Hd; d += VW) {
      const vf x0 = load_row(k0 + d, ks[t]);
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) a0[g] += load(q + g * Hd + d) * x0;
    }
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) p[g * RUN + t] = hsum(a0[g]);
  }
}

// acc (GN, Hd) += p (GN, RUN) @ the run's value rows: each loaded once for the GN heads
template <int GN, typename T>
inline void pv_chunk(const float* p, const T* vrow, int64_t row_stride, const float* vs, int n, int Hd, float* acc) {
  for (int d = 0; d < Hd; d += 2 * VW) {
    const bool two = d + VW < Hd;
    vf a0[GN], a1[GN];
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      a0[g] = load(acc + g * Hd + d);
      a1[g] = two ? load(acc + g * Hd + d + VW) : vf{};
    }
    for (int t = 0; t < n; ++t) {
      const T* vr = vrow + t * row_stride;
      const vf x0 = load_row(vr + d, vs[t]);
      const vf x1 = two ? load_row(vr + d + VW, vs[t]) : vf{};
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) {
        const float w = p[g * RUN + t];
        a0[g] += w * x0;
        a1[g] += w * x1;
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      store(acc + g * Hd + d, a0[g]);
      if (two) store(acc + g * Hd + d + VW, a1[g]);
    }
  }
}

template <typename T>
struct Item {
  const float* q;       // (H, Hd) the sequence's query heads
  const T* k;           // the cache
  const T* v;
  const float* k_scales;
  const float* v_scales;
  const int32_t* table;
  int ctx, first, h0, h1, G, K, Hd, BS;  // KV heads h0..h1-1 of the sequence
  const float* sinks;   // (H,) or null
  float* out;           // (H, Hd)
};

// Scratch of one thread: acc (heads, G, Hd), m and l (heads, G).
struct Scratch {
  std::vector<float> acc, m, l;
};

template <typename T>
void attend_item(const Item<T>& it, Scratch& sc) {
  const int G = it.G, Hd = it.Hd, K = it.K, BS = it.BS;
  const int heads = it.h1 - it.h0;
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  alignas(64) float p[MAX_G * RUN];
  std::fill(acc, acc + heads * G * Hd, 0.0f);
  std::fill(m, m + heads * G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads * G, 0.0f);
  const int64_t row_stride = static_cast<int64_t>(K) * Hd;  // between token slots
  // the run's token rows of all the item's heads are contiguous: one stream through the context
  for (int start = it.first; start < it.ctx;) {
    const int blk = start / BS;
    const int off = start % BS;
    const int n = std::min({RUN, BS - off, it.ctx - start});  // this run's tokens, all in one block
    const int64_t slot0 = static_cast<int64_t>(it.table[blk]) * BS + off;
    {  // the next run's rows, fetched while this one computes: blocks lie anywhere, so the
       // hardware prefetcher loses the stream at every block boundary
      const int nstart = start + n;
      if (nstart < it.ctx) {
        const int nn = std::min({RUN, BS - nstart % BS, it.ctx - nstart});
        const int64_t nslot = static_cast<int64_t>(it.table[nstart / BS]) * BS + nstart % BS;
        const char* kn = reinterpret_cast<const char*>(it.k + nslot * row_stride + static_cast<int64_t>(it.h0) * Hd);
        const char* vn = reinterpret_cast<const char*>(it.v + nslot * row_stride + static_cast<int64_t>(it.h0) * Hd);
        const int64_t span = ((nn - 1) * row_stride + static_cast<int64_t>(it.h1 - it.h0) * Hd) * sizeof(T);
        for (int64_t b = 0; b < span; b += 64) {
          __builtin_prefetch(kn + b);
          __builtin_prefetch(vn + b);
        }
      }
    }
    for (int h = it.h0; h < it.h1; ++h) {
      const float* qh = it.q + static_cast<int64_t>(h) * G * Hd;
      float* acch = acc + static_cast<int64_t>(h - it.h0) * G * Hd;
      float* mh = m + (h - it.h0) * G;
      float* lh = l + (h - it.h0) * G;
      const T* krow = it.k + slot0 * row_stride + static_cast<int64_t>(h) * Hd;
      const T* vrow = it.v + slot0 * row_stride + static_cast<int64_t>(h) * Hd;
      float ks[RUN], vs[RUN];
      for (int t = 0; t < n; ++t) {
        ks[t] = it.k_scales ? it.k_scales[(slot0 + t) * K + h] : 1.0f;
        vs[t] = it.v_scales ? it.v_scales[(slot0 + t) * K + h] : 1.0f;
      }
      // scores: each key row loaded once for the G heads (four at a time)
      for (int g0 = 0; g0 < G;) {
        const float* qg = qh + g0 * Hd;
        float* pg = p + g0 * RUN;
        if (G - g0 >= 4) {
          score_chunk<4>(qg, krow, row_stride, ks, n, Hd, pg);
          g0 += 4;
        } else if (G - g0 >= 2) {
          score_chunk<2>(qg, krow, row_stride, ks, n, Hd, pg);
          g0 += 2;
        } else {
          score_chunk<1>(qg, krow, row_stride, ks, n, Hd, pg);
          g0 += 1;
        }
      }
      // the online softmax's update, a run at a time
      for (int g = 0; g < G; ++g) {
        float* pg = p + g * RUN;
        for (int t = n; t < RUN; ++t) pg[t] = -std::numeric_limits<float>::infinity();  // (zeroed below)
        vf top = load(pg);
        for (int t = VW; t < RUN; t += VW) top = top > load(pg + t) ? top : load(pg + t);
        const float best = std::max(mh[g], hmax(top));
        vf total{};
        for (int t = 0; t < RUN; t += VW) {
          const vf x = load(pg + t);
          const vf e = x == -std::numeric_limits<float>::infinity() ? vf{} : vexp(x - best);
          store(pg + t, e);
          total += e;
        }
        const float sum = hsum(total);
        const float alpha = mh[g] == best ? 1.0f : std::exp(mh[g] - best);  // 0 on the first run
        lh[g] = lh[g] * alpha + sum;
        mh[g] = best;
        if (alpha != 1.0f) {
          float* ag = acch + g * Hd;
          for (int d = 0; d < Hd; d += VW) store(ag + d, load(ag + d) * alpha);
        }
      }
      // P @ V: each value row loaded once for the G heads (four at a time)
      for (int g0 = 0; g0 < G;) {
        const float* pg = p + g0 * RUN;
        float* ag = acch + g0 * Hd;
        if (G - g0 >= 4) {
          pv_chunk<4>(pg, vrow, row_stride, vs, n, Hd, ag);
          g0 += 4;
        } else if (G - g0 >= 2) {
          pv_chunk<2>(pg, vrow, row_stride, vs, n, Hd, ag);
          g0 += 2;
        } else {
          pv_chunk<1>(pg, vrow, row_stride, vs, n, Hd, ag);
          g0 += 1;
        }
      }
    }
    start += n;
  }
  for (int h = it.h0; h < it.h1; ++h) {
    for (int g = 0; g < G; ++g) {
      const int i = (h - it.h0) * G + g;
      float norm = l[i];
      float alpha = 1.0f;
      if (it.sinks) {  // the sink joins the softmax's normaliser, and no value
        const float s = it.sinks[h * G + g];
        const float best = std::max(m[i], s);
        alpha = std::exp(m[i] - best);
        norm = l[i] * alpha + std::exp(s - best);
      }
      const float scale = alpha / norm;
      const float* ai = acc + static_cast<int64_t>(i) * Hd;
      float* oi = it.out + (static_cast<int64_t>(h) * G + g) * Hd;
      for (int d = 0; d < Hd; d += VW) store(oi + d, load(ai + d) * scale);
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
    Scratch sc{std::vector<float>(static_cast<size_t>(per) * G * Hd), std::vector<float>(per * G),
               std::vector<float>(per * G)};
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t item = order[i];
      const int b = static_cast<int>(item / splits), part = static_cast<int>(item % splits);
      const int h0 = part * per, h1 = std::min(K, h0 + per);
      if (h0 >= h1) continue;
      const int64_t q_off = static_cast<int64_t>(b) * H * Hd;
      const Item<T> it{qp + q_off, kp, vp, k_scales, v_scales, tab + static_cast<int64_t>(b) * W,
                       cl[b], fp[b], h0, h1, G, K, Hd, BS, sinks, op + q_off};
      attend_item<T>(it, sc);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "GQA decode attention over a paged KV cache");
  m.attr("isa") = kIsa;
}
