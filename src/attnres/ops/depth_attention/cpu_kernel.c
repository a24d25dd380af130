/* The CPU implementation of the depth-attention operations (report §4.2), as passes over
 * the tokens: attnres/ops/depth_attention/cpu_kernel.py binds it to the custom operators.
 *
 * - merge: one sublayer's input from known logits - softmax over depth, the weighted sum of
 *   the sources, Block AttnRes' partial-sum logit, the next sublayer's RMSNorm - and the
 *   backward of all of it;
 * - phase1: Phase 1 of a group's queries over their shared sources (weighted sums and
 *   log-sum-exp);
 * - logits: a completed source's logits against its later queries.
 * Each computes what torch_impl.py computes, with the same saved statistics and the same
 * backward decomposition (tests compare the two, forward and every gradient, and gradcheck
 * this kernel in double precision).
 *
 * Why a kernel: in eager PyTorch every (sublayer, source) pair costs about twelve passes
 * over a [tokens, d] tensor (a multiply-add in the forward; a product, a sum, a scaled copy
 * in the backward), each a separate operation. Here the loop runs over tokens and, per
 * token, over the sources: a token's rows of all sources stay in the L1 cache, so each
 * source is read once in the forward and once in the backward, and its gradient written
 * once.
 *
 * Layout: every [tokens, d] tensor is contiguous (row t at t * d); the logits z and the
 * weights alpha are [tokens, n] and [tokens, m] with m = n + has_partial.
 *
 * Binding: every exported function's parameters are declared once, in the *_PARAMS macros
 * below. The definitions expand them with the element type, and attnres_signatures()
 * returns them as text (element type "scalar_t", pointers that may be NULL marked
 * "nullable"), from which the Python side builds its ctypes declarations and checks every
 * call by parameter name; attnres_abi_version() guards against a stale library. Plain C:
 * no Python or PyTorch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the exported functions' parameters, declared once (see the header) ---- */
#define ATTNRES_ABI_VERSION 3
#define PLAIN(x) x
#define MERGE_FORWARD_PARAMS(T, OPT)                                                           \
    int64_t tokens, int64_t d, int64_t n, const T *const *src, const T *z,                     \
    OPT(const T *) partial, OPT(const T *) qg, double eps, OPT(const T *) norm_w,               \
    double norm_eps, T *out, T *alpha, OPT(T *) rb, OPT(T *) zb, OPT(T *) rstd, int threads
#define MERGE_BACKWARD_PARAMS(T, OPT)                                                          \
    int64_t tokens, int64_t d, int64_t n, const T *const *src, OPT(const T *) partial,          \
    OPT(const T *) qg, OPT(const T *) norm_w, const T *alpha, OPT(const T *) rb,                \
    OPT(const T *) zb, OPT(const T *) rstd, const T *g,                                        \
    OPT(T *) const *gsrc, OPT(T *) gz, OPT(T *) gpartial, OPT(T *) gqg_part,                    \
    OPT(T *) gw_part, int threads
#define PHASE1_FORWARD_PARAMS(T, OPT)                                                          \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *z,          \
    T *const *out, T *lse, int threads
#define PHASE1_BACKWARD_PARAMS(T, OPT)                                                         \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *z,          \
    const T *lse, OPT(const T *) const *gout, OPT(const T *) glse, OPT(T *) gz,                 \
    OPT(T *) const *gsrc, int threads
#define LOGITS_FORWARD_PARAMS(T, OPT)                                                          \
    int64_t tokens, int64_t d, int64_t K, const T *x, const T *q, double eps, T *z, T *r,      \
    int threads
#define LOGITS_BACKWARD_PARAMS(T, OPT)                                                         \
    int64_t tokens, int64_t d, int64_t K, const T *x, const T *q, const T *r, const T *gz,     \
    OPT(T *) gx, OPT(T *) gq_part, int threads

/* a . b over d values, in two vector accumulators (GCC/Clang vector extensions, 32 bytes:
 * AVX) so that the multiply-adds of one dot product do not wait on one another and the
 * final sum stays in registers (rows are short: d = 64 in the main job). */
#define DEFINE_DOT(T, SUFFIX)                                                                      \
static inline T dot_##SUFFIX(const T *a, const T *b, int64_t d)                                \
{                                                                                              \
    typedef T V __attribute__((vector_size(32)));                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    V acc0 = {0}, acc1 = {0}, a0, b0, a1, b1;                                                  \
    int64_t k = 0;                                                                             \
    for (; k + 2 * W <= d; k += 2 * W) {                                                       \
        memcpy(&a0, a + k, sizeof(V)); memcpy(&b0, b + k, sizeof(V));                          \
        memcpy(&a1, a + k + W, sizeof(V)); memcpy(&b1, b + k + W, sizeof(V));                  \
        acc0 += a0 * b0;                                                                       \
        acc1 += a1 * b1;                                                                       \
    }                                                                                          \
    acc0 += acc1;                                                                              \
    T sum = 0;                                                                                 \
    for (int l = 0; l < W; ++l) sum += acc0[l];                                                \
    for (; k < d; ++k) sum += a[k] * b[k];                                                     \
    return sum;                                                                                \
}

/* exp of n floats in place, vectorized (libm's expf is one call per value: a third of
 * Phase 1's time before). exp(v) = 2^k exp(r), k = round(v / ln2), r = v - k ln2 in
 * [-ln2/2, ln2/2], exp(r) by its degree-7 Taylor polynomial (truncation below 3e-9
 * relative: the result is within float's rounding, 6e-8 relative against exp in double).
 * Meant for softmax arguments (v <= 0): below -87.3 the result is 0 (exp is under float's
 * smallest normal there); above 88.3 it stays at exp(88.3). GCC/Clang vector extensions:
 * 8 lanes, one AVX register where the CPU has AVX. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f select_v8(v8i mask, v8f a, v8f b) /* mask ? a : b, lane by lane */
{
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

static inline v8f exp_v8(v8f v)
{
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8f hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    const v8i under = v < lo;
    v = select_v8(under, lo, v);
    v = select_v8(v > hi, hi, v);
    const v8f k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(v / ln2) */
    const v8f r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-06f; /* ln2 in two parts */
    v8f p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i two_k = (__builtin_convertvector(k, v8i) + 127) << 23; /* the bits of 2^k */
    return (v8f)((v8i)(p * (v8f)two_k) & ~under);
}

static inline void exp_inplace_f32(float *x, int64_t n)
{
    int64_t i = 0;
    v8f v;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, x + i, sizeof v);
        v = exp_v8(v);
        memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {
        memset(&v, 0, sizeof v);
        memcpy(&v, x + i, (size_t)(n - i) * sizeof(float));
        v = exp_v8(v);
        memcpy(x + i, &v, (size_t)(n - i) * sizeof(float));
    }
}

/* double: libm (the precision gradcheck's reference arithmetic needs). */
static inline void exp_inplace_f64(double *x, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) x[i] = exp(x[i]);
}

/* o = sum_j c[j] rows[j][off ..] (plus o itself where add), over d values: the sum is kept
 * in registers across the m rows and o is written once (a row-by-row o += c x loads and
 * stores o once per row). Summed in the order j = 0 .. m - 1. */
#define DEFINE_COMBINE(T, SUFFIX)                                                                  \
static inline void combine_##SUFFIX(T *o, int add, const T *const *rows, int64_t off, const T *c, \
                                    int64_t m, int64_t d)                                      \
{                                                                                              \
    typedef T V __attribute__((vector_size(32)));                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    int64_t k = 0;                                                                             \
    for (; k + 4 * W <= d; k += 4 * W) {                                                       \
        V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x;                                           \
        if (add) {                                                                             \
            memcpy(&a0, o + k, sizeof(V)); memcpy(&a1, o + k + W, sizeof(V));                  \
            memcpy(&a2, o + k + 2 * W, sizeof(V)); memcpy(&a3, o + k + 3 * W, sizeof(V));      \
        }                                                                                      \
        for (int64_t j = 0; j < m; ++j) {                                                      \
            const T *r = rows[j] + off + k, cj = c[j];                                         \
            memcpy(&x, r, sizeof(V)); a0 += cj * x;                                            \
            memcpy(&x, r + W, sizeof(V)); a1 += cj * x;                                        \
            memcpy(&x, r + 2 * W, sizeof(V)); a2 += cj * x;                                    \
            memcpy(&x, r + 3 * W, sizeof(V)); a3 += cj * x;                                    \
        }                                                                                      \
        memcpy(o + k, &a0, sizeof(V)); memcpy(o + k + W, &a1, sizeof(V));                      \
        memcpy(o + k + 2 * W, &a2, sizeof(V)); memcpy(o + k + 3 * W, &a3, sizeof(V));          \
    }                                                                                          \
    for (; k + W <= d; k += W) {                                                               \
        V a = {0}, x;                                                                          \
        if (add) memcpy(&a, o + k, sizeof(V));                                                 \
        for (int64_t j = 0; j < m; ++j) { memcpy(&x, rows[j] + off + k, sizeof(V)); a += c[j] * x; } \
        memcpy(o + k, &a, sizeof(V));                                                          \
    }                                                                                          \
    for (; k < d; ++k) {                                                                       \
        T a = add ? o[k] : (T)0;                                                               \
        for (int64_t j = 0; j < m; ++j) a += c[j] * rows[j][off + k];                          \
        o[k] = a;                                                                              \
    }                                                                                          \
}

#define DEFINE_MERGE(T, SUFFIX, SQRT)                                                          \
/* The sources and the partial sum (when not NULL) as one table of m rows' bases. */         \
static const T **row_table_##SUFFIX(int64_t n, const T *const *src, const T *partial)          \
{                                                                                              \
    const T **rows = (const T **)malloc((size_t)(n + 1) * sizeof(T *));                        \
    for (int64_t j = 0; j < n; ++j) rows[j] = src[j];                                          \
    rows[n] = partial;                                                                         \
    return rows;                                                                               \
}                                                                                              \
                                                                                               \
/* Forward. out = RMSNorm(h) (or h), h = sum_j alpha_j x_j, alpha = softmax(z, zb). Writes    \
 * alpha [tokens, m]; with a partial sum zb and rb (its logit and RMS factor) [tokens]; with  \
 * a norm rstd [tokens]. */                                                                   \
void attnres_merge_forward_##SUFFIX(MERGE_FORWARD_PARAMS(T, PLAIN))                           \
{                                                                                              \
    const int64_t m = n + (partial != NULL);                                                   \
    const T **rows = row_table_##SUFFIX(n, src, partial);                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                         \
    for (int64_t t = 0; t < tokens; ++t) {                                                     \
        T *a = alpha + t * m;                                                                  \
        const T *zt = z + t * n;                                                               \
        if (partial != NULL) { /* the partial sum's logit: (p . qg) / rms(p) */               \
            const T *p = partial + t * d;                                                      \
            const T r = (T)1 / SQRT(dot_##SUFFIX(p, p, d) / (T)d + (T)eps);                    \
            rb[t] = r;                                                                         \
            zb[t] = dot_##SUFFIX(p, qg, d) * r;                                                \
            a[n] = zb[t];                                                                      \
        }                                                                                      \
        T mx = -INFINITY;                                                                      \
        for (int64_t j = 0; j < n; ++j) { a[j] = zt[j]; if (a[j] > mx) mx = a[j]; }            \
        if (partial != NULL && a[n] > mx) mx = a[n];                                           \
        T se = 0;                                                                              \
        for (int64_t j = 0; j < m; ++j) a[j] -= mx;                                            \
        exp_inplace_##SUFFIX(a, m);                                                            \
        for (int64_t j = 0; j < m; ++j) se += a[j];                                            \
        const T inv = (T)1 / se;                                                               \
        for (int64_t j = 0; j < m; ++j) a[j] *= inv;                                           \
        T *o = out + t * d;                                                                    \
        combine_##SUFFIX(o, 0, rows, t * d, a, m, d);                                          \
        if (norm_w != NULL) {                                                                  \
            const T r = (T)1 / SQRT(dot_##SUFFIX(o, o, d) / (T)d + (T)norm_eps);               \
            rstd[t] = r;                                                                       \
            for (int64_t k = 0; k < d; ++k) o[k] = o[k] * r * norm_w[k];                       \
        }                                                                                      \
    }                                                                                          \
    free(rows);                                                                                \
}                                                                                              \
                                                                                               \
/* Backward from g = d loss / d out [tokens, d]. Writes, where not NULL: gsrc[j] (d / d x_j),  \
 * gz [tokens, n] (d / d z), gpartial [tokens, d]; and per-thread partial sums over tokens    \
 * gqg_part and gw_part [threads, d] (d / d qg, d / d norm_w), which the caller adds up.      \
 * With a norm, h is recomputed from the sources. */                                          \
void attnres_merge_backward_##SUFFIX(MERGE_BACKWARD_PARAMS(T, PLAIN))                          \
{                                                                                              \
    const int64_t m = n + (partial != NULL);                                                   \
    if (gqg_part != NULL) memset(gqg_part, 0, (size_t)(threads * d) * sizeof(T));              \
    if (gw_part != NULL) memset(gw_part, 0, (size_t)(threads * d) * sizeof(T));                \
    const T **rows = row_table_##SUFFIX(n, src, partial);                                      \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        int tid = 0;                                                                           \
        ATTNRES_THREAD_ID(tid);                                                                \
        T *buf = (T *)malloc((size_t)(2 * d + m) * sizeof(T)); /* h, gh, s */                  \
        T *hb = buf, *gh = buf + d, *s = buf + 2 * d;                                          \
        T *gqg = gqg_part != NULL ? gqg_part + tid * d : NULL;                                 \
        T *gw = gw_part != NULL ? gw_part + tid * d : NULL;                                    \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t t = 0; t < tokens; ++t) {                                                 \
            const T *a = alpha + t * m;                                                        \
            const T *gt = g + t * d;                                                           \
            if (norm_w != NULL) { /* y = h rstd w: dh = rstd (u - rstd^2 (u . h) h / d) */     \
                const T *h = hb; /* recomputed from the sources */                             \
                combine_##SUFFIX(hb, 0, rows, t * d, a, m, d);                                 \
                const T r = rstd[t];                                                           \
                for (int64_t k = 0; k < d; ++k) gh[k] = gt[k] * norm_w[k];                    \
                const T uh = dot_##SUFFIX(gh, h, d);                                           \
                if (gw != NULL) for (int64_t k = 0; k < d; ++k) gw[k] += gt[k] * h[k] * r;     \
                const T c = r * r * uh / (T)d;                                                 \
                for (int64_t k = 0; k < d; ++k) gh[k] = r * (gh[k] - c * h[k]);                \
            } else {                                                                           \
                memcpy(gh, gt, (size_t)d * sizeof(T));                                         \
            }                                                                                  \
            /* softmax: dz_j = alpha_j (gh . x_j - sum_i alpha_i gh . x_i) */                  \
            T mean = 0;                                                                        \
            for (int64_t j = 0; j < m; ++j) {                                                  \
                const T *x = (j < n ? src[j] : partial) + t * d;                               \
                const T dot = dot_##SUFFIX(gh, x, d);                                          \
                s[j] = dot;                                                                    \
                mean += a[j] * dot;                                                            \
            }                                                                                  \
            if (gz != NULL) for (int64_t j = 0; j < n; ++j) gz[t * n + j] = a[j] * (s[j] - mean); \
            for (int64_t j = 0; j < n; ++j) {                                                  \
                if (gsrc[j] == NULL) continue;                                                 \
                T *gx = gsrc[j] + t * d;                                                       \
                const T aj = a[j];                                                             \
                for (int64_t k = 0; k < d; ++k) gx[k] = aj * gh[k];                            \
            }                                                                                  \
            if (partial != NULL) { /* d zb / d p = rb qg - (rb^2 zb / d) p, plus alpha_b */   \
                const T *p = partial + t * d;                                                  \
                const T gr = a[n] * (s[n] - mean) * rb[t];                                     \
                if (gpartial != NULL) {                                                        \
                    T *gp = gpartial + t * d;                                                  \
                    const T ab = a[n], c = gr * rb[t] * zb[t] / (T)d;                          \
                    for (int64_t k = 0; k < d; ++k) gp[k] = ab * gh[k] + gr * qg[k] - c * p[k]; \
                }                                                                              \
                if (gqg != NULL) for (int64_t k = 0; k < d; ++k) gqg[k] += gr * p[k];          \
            }                                                                                  \
        }                                                                                      \
        free(buf);                                                                             \
    }                                                                                          \
    free(rows);                                                                                \
}

/* Phase 1 works on tiles of this many tokens: their softmax weights are formed together
 * (one vectorized exp over the tile), then each token's rows are combined. */
#define TILE 16

/* Phase 1 of S queries over the same n completed sources, in one pass over each source
 * (report §4.2, Algorithm 1): out[s] = sum_i alpha_si x_i, lse[t, s] = log sum_i exp(z_tsi),
 * alpha_s = softmax(z_ts), z [tokens, S, n]. The backward recomputes alpha from z and lse,
 * reads each source once for the S queries and writes its gradient once: sum_s alpha_si g_s. */
#define DEFINE_PHASE1(T, SUFFIX, LOG)                                                              \
void attnres_phase1_forward_##SUFFIX(PHASE1_FORWARD_PARAMS(T, PLAIN))                         \
{                                                                                              \
    const int64_t tiles = (tokens + TILE - 1) / TILE;                                          \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        T *w = (T *)malloc((size_t)(TILE * S * n) * sizeof(T)); /* the tile's alpha */         \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t b = 0; b < tiles; ++b) {                                                  \
            const int64_t t0 = b * TILE, tt = tokens - t0 < TILE ? tokens - t0 : TILE;         \
            const int64_t rows = tt * S; /* one softmax per (token, query) */                  \
            memcpy(w, z + t0 * S * n, (size_t)(rows * n) * sizeof(T));                        \
            for (int64_t r = 0; r < rows; ++r) {                                               \
                T *wr = w + r * n, mx = -INFINITY;                                             \
                for (int64_t i = 0; i < n; ++i) if (wr[i] > mx) mx = wr[i];                    \
                for (int64_t i = 0; i < n; ++i) wr[i] -= mx;                                   \
                lse[t0 * S + r] = mx;                                                          \
            }                                                                                  \
            exp_inplace_##SUFFIX(w, rows * n);                                                 \
            for (int64_t r = 0; r < rows; ++r) {                                               \
                T *wr = w + r * n, se = 0;                                                     \
                for (int64_t i = 0; i < n; ++i) se += wr[i];                                   \
                const T inv = (T)1 / se;                                                       \
                for (int64_t i = 0; i < n; ++i) wr[i] *= inv;                                  \
                lse[t0 * S + r] += LOG(se);                                                    \
            }                                                                                  \
            for (int64_t t = 0; t < tt; ++t)                                                   \
                for (int64_t s = 0; s < S; ++s)                                                \
                    combine_##SUFFIX(out[s] + (t0 + t) * d, 0, src, (t0 + t) * d,              \
                                     w + (t * S + s) * n, n, d);                               \
        }                                                                                      \
        free(w);                                                                               \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* Backward from gout[s] (d / d out[s], NULL: zero) and glse [tokens, S] (NULL: zero).        \
 * Writes gz [tokens, S, n] (NULL: not needed) and gsrc[i] (NULL: not needed). */             \
void attnres_phase1_backward_##SUFFIX(PHASE1_BACKWARD_PARAMS(T, PLAIN))                        \
{                                                                                              \
    const int64_t tiles = (tokens + TILE - 1) / TILE;                                          \
    /* the output gradients that are there, and the query of each */                          \
    const T **g = (const T **)malloc((size_t)S * sizeof(T *));                                 \
    int64_t *q = (int64_t *)malloc((size_t)S * sizeof(int64_t)), ng = 0;                      \
    for (int64_t s = 0; s < S; ++s) if (gout[s] != NULL) { g[ng] = gout[s]; q[ng++] = s; }     \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        /* alpha and the dots g_s . x_i of the tile, and one source's weights per query */     \
        T *w = (T *)malloc((size_t)(2 * TILE * S * n + S) * sizeof(T));                       \
        T *dots = w + TILE * S * n, *c = dots + TILE * S * n;                                  \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t b = 0; b < tiles; ++b) {                                                  \
            const int64_t t0 = b * TILE, tt = tokens - t0 < TILE ? tokens - t0 : TILE;         \
            const int64_t rows = tt * S;                                                       \
            for (int64_t r = 0; r < rows; ++r)                                                 \
                for (int64_t i = 0; i < n; ++i)                                                \
                    w[r * n + i] = z[(t0 * S + r) * n + i] - lse[t0 * S + r];                  \
            exp_inplace_##SUFFIX(w, rows * n);                                                 \
            for (int64_t i = 0; i < n; ++i) { /* each source's rows of the tile in one run */    \
                for (int64_t t = 0; t < tt; ++t) {                                             \
                    const int64_t off = (t0 + t) * d;                                          \
                    const T *x = src[i] + off, *wt = w + t * S * n;                            \
                    if (gz != NULL)                                                            \
                        for (int64_t s = 0; s < S; ++s)                                        \
                            dots[(t * S + s) * n + i] =                                        \
                                gout[s] != NULL ? dot_##SUFFIX(gout[s] + off, x, d) : (T)0;    \
                    if (gsrc[i] == NULL) continue; /* d x_i = sum_s alpha_si g_s */            \
                    for (int64_t j = 0; j < ng; ++j) c[j] = wt[q[j] * n + i];                  \
                    combine_##SUFFIX(gsrc[i] + off, 0, g, off, c, ng, d);               \
                }                                                                              \
            }                                                                                  \
            if (gz != NULL) /* dz_si = alpha_si (g_s . x_i - g_s . out_s + glse_s) */         \
                for (int64_t r = 0; r < rows; ++r) {                                           \
                    const T *wr = w + r * n, *dr = dots + r * n;                               \
                    T mean = 0;                                                                \
                    for (int64_t i = 0; i < n; ++i) mean += wr[i] * dr[i];                     \
                    const T gl = glse != NULL ? glse[t0 * S + r] : (T)0;                       \
                    T *gzr = gz + (t0 * S + r) * n;                                            \
                    for (int64_t i = 0; i < n; ++i) gzr[i] = wr[i] * (dr[i] - mean + gl);      \
                }                                                                              \
        }                                                                                      \
        free(w);                                                                               \
    }                                                                                          \
    free(g);                                                                                   \
    free(q);                                                                                   \
}

/* The logits of one completed source against K later queries (report §3.1: phi(q, k) with
 * the key RMSNorm's gain folded into the queries): z[t, k] = r_t (x_t . q_k), r_t =
 * 1 / rms(x_t). A [tokens, d] x [d, K] product with K small (1 to L), where a BLAS call
 * spends most of its time on the skinny shape: here blocks of 4 tokens against 2 vectors of
 * queries at a time, every product in registers. q [K, d]; writes z [tokens, K], r [tokens]. */
#define LOGIT_TOKENS 4
#define LOGIT_CHUNK 64
#define DEFINE_LOGITS(T, SUFFIX, SQRT)                                                             \
typedef T logit_vec_##SUFFIX __attribute__((vector_size(32)));                                 \
                                                                                               \
/* out[t] = sum_{i < n} a[t][i] b[i * bs ..] over two vectors of b's row, for the              \
 * LOGIT_TOKENS rows a[t]: a block of a product, its sums in registers. */                     \
static inline void product_block_##SUFFIX(logit_vec_##SUFFIX out[LOGIT_TOKENS][2],             \
                                          const T *const *a, const T *b, int64_t bs, int64_t n)\
{                                                                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    logit_vec_##SUFFIX acc[LOGIT_TOKENS][2], b0, b1;                                           \
    memset(acc, 0, sizeof acc);                                                                \
    for (int64_t i = 0; i < n; ++i) {                                                          \
        memcpy(&b0, b + i * bs, sizeof b0);                                                    \
        memcpy(&b1, b + i * bs + W, sizeof b1);                                                \
        for (int t = 0; t < LOGIT_TOKENS; ++t) {                                               \
            acc[t][0] += a[t][i] * b0;                                                         \
            acc[t][1] += a[t][i] * b1;                                                         \
        }                                                                                      \
    }                                                                                          \
    memcpy(out, acc, sizeof acc);                                                              \
}                                                                                              \
                                                                                               \
void attnres_logits_forward_##SUFFIX(LOGITS_FORWARD_PARAMS(T, PLAIN))                         \
{                                                                                              \
    typedef T V __attribute__((vector_size(32)));                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    const int64_t Kp = (K + 2 * W - 1) / (2 * W) * (2 * W);                                    \
    T *qt = (T *)calloc((size_t)(d * Kp), sizeof(T)); /* q transposed, zero-padded to Kp */    \
    for (int64_t k = 0; k < K; ++k)                                                            \
        for (int64_t j = 0; j < d; ++j) qt[j * Kp + k] = q[k * d + j];                         \
    const int64_t blocks = (tokens + LOGIT_TOKENS - 1) / LOGIT_TOKENS;                        \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        T *zero = (T *)calloc((size_t)d, sizeof(T)); /* the rows past the last token */       \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t b = 0; b < blocks; ++b) {                                                 \
            const int64_t t0 = b * LOGIT_TOKENS;                                               \
            const int64_t tt = tokens - t0 < LOGIT_TOKENS ? tokens - t0 : LOGIT_TOKENS;        \
            const T *xr[LOGIT_TOKENS];                                                         \
            T rt[LOGIT_TOKENS];                                                                \
            for (int t = 0; t < LOGIT_TOKENS; ++t) {                                           \
                xr[t] = t < tt ? x + (t0 + t) * d : zero;                                      \
                rt[t] = t < tt ? (T)1 / SQRT(dot_##SUFFIX(xr[t], xr[t], d) / (T)d + (T)eps) : (T)0; \
                if (t < tt) r[t0 + t] = rt[t];                                                 \
            }                                                                                  \
            for (int64_t kb = 0; kb < Kp; kb += 2 * W) {                                       \
                V a[LOGIT_TOKENS][2];                                                          \
                product_block_##SUFFIX(a, xr, qt + kb, Kp, d);                                 \
                const int64_t kn = K - kb < 2 * W ? K - kb : 2 * W;                            \
                for (int64_t t = 0; t < tt; ++t) {                                             \
                    T out[2 * W];                                                              \
                    memcpy(out, a[t], sizeof a[t]);                                            \
                    for (int64_t k = 0; k < kn; ++k) z[(t0 + t) * K + kb + k] = out[k] * rt[t]; \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(zero);                                                                            \
    }                                                                                          \
    free(qt);                                                                                  \
}                                                                                              \
                                                                                               \
/* Backward from gz [tokens, K]. With u = sum_k gz_k q_k and c = (r^2 / d) sum_k gz_k z_k      \
 * = r^3 (x . u) / d (so z need not be kept): d x = r u - c x, written to gx (NULL: not     \
 * needed); d q_k = sum_t gz_tk r_t x_t, in per-thread partial      \
 * sums gq_part [threads, K, d] (NULL: not needed) that the caller adds up. Runs over          \
 * chunks of LOGIT_CHUNK tokens (their rows of x stay in L1 for d q), d x in blocks of         \
 * LOGIT_TOKENS tokens. */                                                                     \
void attnres_logits_backward_##SUFFIX(LOGITS_BACKWARD_PARAMS(T, PLAIN))                        \
{                                                                                              \
    typedef T V __attribute__((vector_size(32)));                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    if (gq_part != NULL) memset(gq_part, 0, (size_t)(threads * K * d) * sizeof(T));            \
    const int64_t chunks = (tokens + LOGIT_CHUNK - 1) / LOGIT_CHUNK;                          \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        int tid = 0;                                                                           \
        ATTNRES_THREAD_ID(tid);                                                                \
        T *gq = gq_part != NULL ? gq_part + (int64_t)tid * K * d : NULL;                       \
        T *wk = (T *)malloc((size_t)(K * LOGIT_CHUNK) * sizeof(T)); /* gz_tk r_t, by query */  \
        T *u = (T *)malloc((size_t)(LOGIT_TOKENS * d) * sizeof(T)); /* sum_k gz_k q_k */        \
        const T *xrows[LOGIT_CHUNK]; /* the chunk's rows of x */                               \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t ch = 0; ch < chunks; ++ch) {                                              \
            const int64_t c0 = ch * LOGIT_CHUNK;                                               \
            const int64_t cn = tokens - c0 < LOGIT_CHUNK ? tokens - c0 : LOGIT_CHUNK;          \
            for (int64_t b0 = c0; gx != NULL && b0 < c0 + cn; b0 += LOGIT_TOKENS) {            \
                const int64_t tt = c0 + cn - b0 < LOGIT_TOKENS ? c0 + cn - b0 : LOGIT_TOKENS; \
                const T *xb = x + b0 * d, *gzb = gz + b0 * K;                                  \
                const T *gzr[LOGIT_TOKENS]; /* the block's rows of gz */                       \
                for (int t = 0; t < LOGIT_TOKENS; ++t) gzr[t] = gzb + (t < tt ? t : 0) * K;    \
                int64_t j = 0;                                                                 \
                if (tt == LOGIT_TOKENS) /* u in registers, 2 vectors of d at a time */         \
                    for (; j + 2 * W <= d; j += 2 * W) {                                       \
                        V a[LOGIT_TOKENS][2];                                                  \
                        product_block_##SUFFIX(a, gzr, q + j, d, K);                           \
                        for (int t = 0; t < LOGIT_TOKENS; ++t) memcpy(u + t * d + j, a[t], sizeof a[t]); \
                    }                                                                          \
                for (int64_t t = 0; t < tt; ++t) /* the rest of d, and a last partial block */ \
                    for (int64_t l = j; l < d; ++l) {                                          \
                        T v = 0;                                                               \
                        for (int64_t k = 0; k < K; ++k) v += gzb[t * K + k] * q[k * d + l];   \
                        u[t * d + l] = v;                                                      \
                    }                                                                          \
                for (int64_t t = 0; t < tt; ++t) {                                             \
                    const T *ut = u + t * d, *xt = xb + t * d, rr = r[b0 + t];                 \
                    /* sum_k gz_k z_k = r (x . u): c = r^3 (x . u) / d */                      \
                    const T c = rr * rr * rr * dot_##SUFFIX(xt, ut, d) / (T)d;                 \
                    T *g = gx + (b0 + t) * d;                                                  \
                    for (int64_t l = 0; l < d; ++l) g[l] = rr * ut[l] - c * xt[l];             \
                }                                                                              \
            }                                                                                  \
            if (gq == NULL) continue;                                                          \
            for (int64_t t = 0; t < cn; ++t)                                                   \
                for (int64_t k = 0; k < K; ++k) wk[k * cn + t] = gz[(c0 + t) * K + k] * r[c0 + t]; \
            for (int64_t t = 0; t < cn; ++t) xrows[t] = x + (c0 + t) * d;                      \
            for (int64_t k = 0; k < K; ++k) /* gq_k += sum_t wk_t x_t */                       \
                combine_##SUFFIX(gq + k * d, 1, xrows, 0, wk + k * cn, cn, d);                 \
        }                                                                                      \
        free(wk);                                                                              \
        free(u);                                                                               \
    }                                                                                          \
}

#ifdef _OPENMP
#include <omp.h>
#define ATTNRES_THREAD_ID(tid) (tid) = omp_get_thread_num()
#else
#define ATTNRES_THREAD_ID(tid) (void)(tid)
#endif

DEFINE_DOT(float, f32)
DEFINE_DOT(double, f64)
DEFINE_COMBINE(float, f32)
DEFINE_COMBINE(double, f64)
DEFINE_MERGE(float, f32, sqrtf)
DEFINE_MERGE(double, f64, sqrt)
DEFINE_PHASE1(float, f32, logf)
DEFINE_PHASE1(double, f64, log)
DEFINE_LOGITS(float, f32, sqrtf)
DEFINE_LOGITS(double, f64, sqrt)

/* ---- what the binding checks: the ABI version and every function's parameters ---- */
#define ATTNRES_STR(...) #__VA_ARGS__
#define ATTNRES_XSTR(...) ATTNRES_STR(__VA_ARGS__)
#define NULLABLE(x) nullable x

int attnres_abi_version(void) { return ATTNRES_ABI_VERSION; }

const char *attnres_signatures(void)
{
    return "merge_forward(" ATTNRES_XSTR(MERGE_FORWARD_PARAMS(scalar_t, NULLABLE)) ");"
           "merge_backward(" ATTNRES_XSTR(MERGE_BACKWARD_PARAMS(scalar_t, NULLABLE)) ");"
           "phase1_forward(" ATTNRES_XSTR(PHASE1_FORWARD_PARAMS(scalar_t, NULLABLE)) ");"
           "phase1_backward(" ATTNRES_XSTR(PHASE1_BACKWARD_PARAMS(scalar_t, NULLABLE)) ");"
           "logits_forward(" ATTNRES_XSTR(LOGITS_FORWARD_PARAMS(scalar_t, NULLABLE)) ");"
           "logits_backward(" ATTNRES_XSTR(LOGITS_BACKWARD_PARAMS(scalar_t, NULLABLE)) ")";
}
