// Decode attention on CPU, an XLA FFI custom call (cpu_attention.py, beside it, builds and
// registers it): one new token per row over its prompt's live columns, its earlier generated
// tokens and itself, float32; the row's new key and value are written into the generated-token
// cache in place (the cache outputs alias the cache inputs).
//
// Shapes (B prompt groups of G rows, K kv heads of Q query heads each, H head dim, P prompt
// columns, S cache slots):
//   q    [B, G, K, Q*H]  the rows' queries (after RoPE)
//   pk   [B, K, H, P]    prompt keys (transposed); pv [B, K, P, H] prompt values
//   plo  [B]             the first live prompt column (the prompt is left-padded: live [plo, P))
//   gk   [B, K, G, H, S] generated keys (transposed); gv [B, K, G, S, H] generated values
//   nk   [B, G, K, H]    each row's new key; nv [B, G, K, H] its new value
//   at   [B, G]          each row's slot: it reads slots [0, at) and writes its new key/value at
//                        `at` (not written outside [0, S))
// Results: out [B, G, K, Q*H]; gk, gv (aliased, updated).
//
// The work items are the (group, kv head) pairs, split over XLA's intra-op thread pool in
// contiguous runs of about equal cost (the columns each reads). The arithmetic mirrors the XLA
// path (decode._attend): scores q.k scaled by 1/sqrt(H), a softmax over prompt, generated and
// own scores, outputs weighted by the normalised probabilities.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Dims {
  int64_t B, G, K, Q, H, P, S;
};

struct Args {
  Dims d;
  const float* q;
  const float* pk;
  const float* pv;
  const int32_t* plo;
  float* gk;
  float* gv;
  const float* nk;
  const float* nv;
  const int32_t* at;
  float* out;
};

// exp(x) for x <= 0 (scores minus their maximum), in a form the compiler vectorises: Cephes'
// expf (x = n ln2 + r, a degree-6 polynomial of r, 2^n from the exponent bits), within about
// 2 ulp of expf; below -87 it returns exp(-87) (a weight of 1e-38, where the XLA path's exp
// gives 0 or a denormal).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

int64_t PromptLo(const Args& a, int64_t b) {
  return std::clamp<int64_t>(a.plo[b], 0, a.d.P);
}

int64_t Slot(const Args& a, int64_t b, int64_t g) { return a.at[b * a.d.G + g]; }

int64_t GenLive(const Args& a, int64_t b, int64_t g) {
  return std::clamp<int64_t>(Slot(a, b, g), 0, a.d.S);
}

// The columns item (b, x) reads, for splitting the items over threads.
int64_t Cost(const Args& a, int64_t b) {
  int64_t c = a.d.G * a.d.Q * (a.d.P - PromptLo(a, b) + 1);
  for (int64_t g = 0; g < a.d.G; ++g) c += a.d.Q * GenLive(a, b, g);
  return c + 16;
}

constexpr int kCols = 16;  // score columns a register block holds (two AVX vectors)
constexpr int kHead = 32;  // output features a register block holds
constexpr int kQueries = 4;  // queries a register block serves

// out[m][s] = sum_h q[m][h] k[h * ldk + s] for s < n and MB queries: each loaded key column
// serves every query from registers.
template <int MB>
void ScoreBlock(const float* const* q, const float* k, int64_t ldk, int64_t H, int64_t n,
                float* const* out) {
  int64_t s = 0;
  for (; s + kCols <= n; s += kCols) {
    float acc[MB][kCols] = {};
    for (int64_t h = 0; h < H; ++h) {
      const float* kr = k + h * ldk + s;
      for (int m = 0; m < MB; ++m) {
        const float qv = q[m][h];
        for (int j = 0; j < kCols; ++j) acc[m][j] += qv * kr[j];
      }
    }
    for (int m = 0; m < MB; ++m) std::copy(acc[m], acc[m] + kCols, out[m] + s);
  }
  for (int m = 0; m < MB; ++m) {
    for (int64_t t = s; t < n; ++t) {
      float v = 0.0f;
      for (int64_t h = 0; h < H; ++h) v += q[m][h] * k[h * ldk + t];
      out[m][t] = v;
    }
  }
}

// out[m][h] += sum_s w[m][s] v[s * ldv + h] for s < n, h < H and MB queries: each loaded value
// row serves every query from registers.
template <int MB>
void WeightBlock(const float* const* w, const float* v, int64_t ldv, int64_t H, int64_t n,
                 float* const* out) {
  int64_t h0 = 0;
  for (; h0 + kHead <= H; h0 += kHead) {
    float acc[MB][kHead] = {};
    for (int64_t s = 0; s < n; ++s) {
      const float* vr = v + s * ldv + h0;
      for (int m = 0; m < MB; ++m) {
        const float wv = w[m][s];
        for (int j = 0; j < kHead; ++j) acc[m][j] += wv * vr[j];
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < kHead; ++j) out[m][h0 + j] += acc[m][j];
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t s = 0; s < n; ++s)
      for (int64_t h = h0; h < H; ++h) out[m][h] += w[m][s] * v[s * ldv + h];
}

// The blocks above over any number of queries, kQueries at a time.
template <void (*Block1)(const float* const*, const float*, int64_t, int64_t, int64_t,
                         float* const*),
          void (*Block2)(const float* const*, const float*, int64_t, int64_t, int64_t,
                         float* const*),
          void (*Block3)(const float* const*, const float*, int64_t, int64_t, int64_t,
                         float* const*),
          void (*Block4)(const float* const*, const float*, int64_t, int64_t, int64_t,
                         float* const*)>
void Blocked(const std::vector<const float*>& in, const float* mat, int64_t ld, int64_t H,
             int64_t n, const std::vector<float*>& out) {
  const int64_t m = static_cast<int64_t>(in.size());
  for (int64_t m0 = 0; m0 < m; m0 += kQueries) {
    const float* const* i = in.data() + m0;
    float* const* o = out.data() + m0;
    switch (std::min<int64_t>(kQueries, m - m0)) {
      case 1: Block1(i, mat, ld, H, n, o); break;
      case 2: Block2(i, mat, ld, H, n, o); break;
      case 3: Block3(i, mat, ld, H, n, o); break;
      default: Block4(i, mat, ld, H, n, o); break;
    }
  }
}

constexpr auto Scores = Blocked<ScoreBlock<1>, ScoreBlock<2>, ScoreBlock<3>, ScoreBlock<4>>;
constexpr auto Weighted = Blocked<WeightBlock<1>, WeightBlock<2>, WeightBlock<3>,
                                  WeightBlock<4>>;

struct Scratch {
  std::vector<float> scores;
  std::vector<const float*> in;
  std::vector<float*> out;
};

// Group b, kv head x: every row's queries of that head over the prompt, its generated slots
// and its own new token; then the rows' new keys/values into their slots.
void Item(const Args& a, int64_t b, int64_t x, Scratch& w) {
  const Dims& d = a.d;
  const int64_t H = d.H, P = d.P, S = d.S, G = d.G, Q = d.Q, K = d.K, M = G * Q;
  const int64_t lo = PromptLo(a, b), lp = P - lo;
  int64_t lg_max = 0;
  for (int64_t g = 0; g < G; ++g) lg_max = std::max(lg_max, GenLive(a, b, g));
  const int64_t stride = lp + lg_max + 1;  // per query: prompt scores, generated, own
  w.scores.resize(M * stride);
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  auto query = [&](int64_t m) {  // query m = (row g, head qi) of the group
    return a.q + (((b * G + m / Q) * K + x) * Q + m % Q) * H;
  };
  auto output = [&](int64_t m) { return a.out + (((b * G + m / Q) * K + x) * Q + m % Q) * H; };
  auto scores = [&](int64_t m) { return w.scores.data() + m * stride; };
  const float* pk = a.pk + (b * K + x) * H * P;
  const float* pv = a.pv + (b * K + x) * P * H;

  // prompt scores of all M queries (the rows of a group share the prompt)
  w.in.resize(M);
  w.out.resize(M);
  for (int64_t m = 0; m < M; ++m) w.in[m] = query(m), w.out[m] = scores(m);
  Scores(w.in, pk + lo, P, H, lp, w.out);
  // generated and own scores, row by row
  w.in.resize(Q);
  w.out.resize(Q);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t lg = GenLive(a, b, g);
    const float* nk = a.nk + ((b * G + g) * K + x) * H;
    for (int64_t qi = 0; qi < Q; ++qi) w.in[qi] = query(g * Q + qi), w.out[qi] = scores(g * Q + qi) + lp;
    Scores(w.in, a.gk + ((b * K + x) * G + g) * H * S, S, H, lg, w.out);
    for (int64_t qi = 0; qi < Q; ++qi) {
      const float* qq = w.in[qi];
      float own = 0.0f;
      for (int64_t h = 0; h < H; ++h) own += qq[h] * nk[h];
      w.out[qi][lg] = own;
    }
  }
  // softmax over [prompt, generated, own] of each query: probabilities in place
  for (int64_t m = 0; m < M; ++m) {
    const int64_t len = lp + GenLive(a, b, m / Q) + 1;
    float* sc = scores(m);
    for (int64_t s = 0; s < len; ++s) sc[s] *= scale;
    float mx = sc[0];
    for (int64_t s = 1; s < len; ++s) mx = std::max(mx, sc[s]);
    for (int64_t s = 0; s < len; ++s) sc[s] = ExpNonPositive(sc[s] - mx);
    float total = 0.0f;
    for (int64_t s = 0; s < len; ++s) total += sc[s];
    const float inv = 1.0f / total;
    for (int64_t s = 0; s < len; ++s) sc[s] *= inv;
  }
  // outputs: the prompt's values weighted for all M queries, then each row's generated values
  // and its own
  w.in.resize(M);
  w.out.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    w.in[m] = scores(m), w.out[m] = output(m);
    std::fill(w.out[m], w.out[m] + H, 0.0f);
  }
  Weighted(w.in, pv + lo * H, H, H, lp, w.out);
  w.in.resize(Q);
  w.out.resize(Q);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t lg = GenLive(a, b, g);
    const float* nv = a.nv + ((b * G + g) * K + x) * H;
    for (int64_t qi = 0; qi < Q; ++qi) w.in[qi] = scores(g * Q + qi) + lp, w.out[qi] = output(g * Q + qi);
    Weighted(w.in, a.gv + ((b * K + x) * G + g) * S * H, H, H, lg, w.out);
    for (int64_t qi = 0; qi < Q; ++qi) {
      const float wv = w.in[qi][lg];
      for (int64_t h = 0; h < H; ++h) w.out[qi][h] += wv * nv[h];
    }
  }
  // the new keys/values into their slots (slot `at` was not read above)
  for (int64_t g = 0; g < G; ++g) {
    const int64_t t = Slot(a, b, g);
    if (t < 0 || t >= S) continue;
    float* gk = a.gk + ((b * K + x) * G + g) * H * S;
    float* gv = a.gv + ((b * K + x) * G + g) * S * H;
    const float* nk = a.nk + ((b * G + g) * K + x) * H;
    const float* nv = a.nv + ((b * G + g) * K + x) * H;
    for (int64_t h = 0; h < H; ++h) gk[h * S + t] = nk[h];
    std::copy(nv, nv + H, gv + t * H);
  }
}

void Run(const Args& a, int64_t first, int64_t last) {
  Scratch w;
  for (int64_t i = first; i < last; ++i) Item(a, i / a.d.K, i % a.d.K, w);
}

ffi::Future Failed(const char* message) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, message));
  return future;
}

ffi::Future DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> pk, ffi::Buffer<ffi::F32> pv,
                            ffi::Buffer<ffi::S32> plo, ffi::Buffer<ffi::F32> gk,
                            ffi::Buffer<ffi::F32> gv, ffi::Buffer<ffi::F32> nk,
                            ffi::Buffer<ffi::F32> nv, ffi::Buffer<ffi::S32> at,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> gk_out,
                            ffi::ResultBuffer<ffi::F32> gv_out) {
  auto qd = q.dimensions(), pkd = pk.dimensions(), gkd = gk.dimensions();
  if (qd.size() != 4 || pkd.size() != 4 || gkd.size() != 5) return Failed("bad ranks");
  Dims d{pkd[0], gkd[2], pkd[1], 0, pkd[2], pkd[3], gkd[4]};
  if (d.K * d.H == 0 || qd[3] % d.H != 0) return Failed("bad head dims");
  d.Q = qd[3] / d.H;
  if (qd[0] != d.B || qd[1] != d.G || qd[2] != d.K || gkd[0] != d.B || gkd[1] != d.K ||
      gkd[3] != d.H || plo.element_count() != d.B || at.element_count() != d.B * d.G ||
      nk.element_count() != d.B * d.G * d.K * d.H || pv.element_count() != pk.element_count() ||
      gv.element_count() != gk.element_count())
    return Failed("inconsistent shapes");
  // The cache results alias the cache inputs (XLA copies an input in first where it cannot
  // alias), so the kernel reads and writes the results' buffers.
  Args a{d, q.typed_data(), pk.typed_data(), pv.typed_data(), plo.typed_data(),
         gk_out->typed_data(), gv_out->typed_data(), nk.typed_data(), nv.typed_data(),
         at.typed_data(), out->typed_data()};
  const int64_t items = d.B * d.K;
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
  if (threads <= 1) {
    Run(a, 0, items);
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }
  // contiguous runs of items of about equal cost, one task each
  std::vector<int64_t> bounds{0};
  int64_t total = 0;
  for (int64_t i = 0; i < items; ++i) total += Cost(a, i / d.K);
  int64_t acc = 0;
  for (int64_t i = 0; i < items; ++i) {
    acc += Cost(a, i / d.K);
    if (acc * threads >= total * static_cast<int64_t>(bounds.size()) &&
        static_cast<int64_t>(bounds.size()) < threads)
      bounds.push_back(i + 1);
  }
  if (bounds.back() != items) bounds.push_back(items);
  const int64_t tasks = static_cast<int64_t>(bounds.size()) - 1;
  ffi::CountDownPromise done(tasks);
  ffi::Future future(done);
  for (int64_t t = 0; t < tasks; ++t) {
    pool.Schedule([a, first = bounds[t], last = bounds[t + 1], done]() mutable {
      Run(a, first, last);
      done.CountDown();
    });
  }
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SageDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pv
                                  .Arg<ffi::Buffer<ffi::S32>>()  // plo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // nk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // nv
                                  .Arg<ffi::Buffer<ffi::S32>>()  // at
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // gk (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // gv (aliased)
