/* The lean path's depth merge as one pass over the tokens, for CPUs (report §4.2).
 *
 * One sublayer's input from known logits: softmax over depth, the weighted sum of the
 * sources, Block AttnRes' partial-sum logit, the next sublayer's RMSNorm - and the analytic
 * backward of all of it. It is the same function as attnres.ops.recompute._DepthMerge
 * (the PyTorch code there is its readable reference; tests compare the two, forward and
 * every gradient, and gradcheck this kernel in double precision).
 *
 * Why a kernel: on the eager PyTorch path every (sublayer, source) pair costs about twelve
 * passes over a [tokens, d] tensor (a multiply-add in the forward; a product, a sum, a
 * scaled copy in the backward), each a separate operation. Here the loop runs over tokens
 * and, per token, over the sources: a token's rows of all sources stay in the L1 cache, so
 * each source is read once in the forward and once in the backward, and its gradient
 * written once.
 *
 * Layout: every [tokens, d] tensor is contiguous (row t at t * d); the logits z and the
 * weights alpha are [tokens, n] and [tokens, m] with m = n + has_partial. Pointers that
 * may be absent are NULL. Built by attnres/kernels/cpu.py (gcc -O3 -fopenmp), once per
 * machine, and called through ctypes: plain C, no Python or PyTorch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define DEFINE_MERGE(T, SUFFIX, EXP, SQRT)                                                          \
/* Row t of h = sum_j a_j x_j over the n sources and the partial sum (when not NULL). */      \
static void weighted_row_##SUFFIX(T *o, const T *a, int64_t t, int64_t d, int64_t n,           \
                                  const T *const *src, const T *partial)                       \
{                                                                                              \
    const int64_t m = n + (partial != NULL);                                                   \
    const T *x0 = src[0] + t * d;                                                              \
    for (int64_t k = 0; k < d; ++k) o[k] = a[0] * x0[k];                                       \
    for (int64_t j = 1; j < m; ++j) {                                                          \
        const T *x = (j < n ? src[j] : partial) + t * d;                                       \
        const T aj = a[j];                                                                     \
        for (int64_t k = 0; k < d; ++k) o[k] += aj * x[k];                                     \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* Forward. out = RMSNorm(h) (or h), h = sum_j alpha_j x_j, alpha = softmax(z, zb). Writes    \
 * alpha [tokens, m]; with a partial sum zb and rb (its logit and RMS factor) [tokens]; with  \
 * a norm rstd [tokens]; kept (the norm's input h) when not NULL. */                           \
void attnres_merge_forward_##SUFFIX(                                                           \
    int64_t tokens, int64_t d, int64_t n, const T *const *src, const T *z, const T *partial,  \
    const T *qg, double eps, const T *norm_w, double norm_eps, T *out, T *alpha, T *rb,         \
    T *zb, T *rstd, T *kept, int threads)                                                      \
{                                                                                              \
    const int64_t m = n + (partial != NULL);                                                   \
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
        for (int64_t j = 0; j < m; ++j) { a[j] = EXP(a[j] - mx); se += a[j]; }                 \
        const T inv = (T)1 / se;                                                               \
        for (int64_t j = 0; j < m; ++j) a[j] *= inv;                                           \
        T *o = out + t * d;                                                                    \
        weighted_row_##SUFFIX(o, a, t, d, n, src, partial);                                    \
        if (kept != NULL) memcpy(kept + t * d, o, (size_t)d * sizeof(T));                      \
        if (norm_w != NULL) {                                                                  \
            const T r = (T)1 / SQRT(dot_##SUFFIX(o, o, d) / (T)d + (T)norm_eps);               \
            rstd[t] = r;                                                                       \
            for (int64_t k = 0; k < d; ++k) o[k] = o[k] * r * norm_w[k];                       \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* Backward from g = d loss / d out [tokens, d]. Writes, where not NULL: gsrc[j] (d / d x_j; \
 * added to what it holds where accumulate[j] is set: a source's gradient slot),             \
 * gz [tokens, n] (d / d z), gpartial [tokens, d]; and per-thread partial sums over tokens    \
 * gqg_part and gw_part [threads, d] (d / d qg, d / d norm_w), which the caller adds up.      \
 * With a norm, h is kept (kept) or recomputed from the sources. */                           \
void attnres_merge_backward_##SUFFIX(                                                          \
    int64_t tokens, int64_t d, int64_t n, const T *const *src, const T *partial, const T *qg,  \
    const T *norm_w, const T *alpha, const T *rb, const T *zb, const T *rstd, const T *kept,   \
    const T *g, T *const *gsrc, const unsigned char *accumulate, T *gz, T *gpartial,           \
    T *gqg_part, T *gw_part, int threads)                                                      \
{                                                                                              \
    const int64_t m = n + (partial != NULL);                                                   \
    if (gqg_part != NULL) memset(gqg_part, 0, (size_t)(threads * d) * sizeof(T));              \
    if (gw_part != NULL) memset(gw_part, 0, (size_t)(threads * d) * sizeof(T));                \
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
                const T *h = hb;                                                               \
                if (kept != NULL) {                                                            \
                    h = kept + t * d;                                                          \
                } else { /* recompute h from the sources */                                   \
                    weighted_row_##SUFFIX(hb, a, t, d, n, src, partial);                       \
                }                                                                              \
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
                if (accumulate[j]) for (int64_t k = 0; k < d; ++k) gx[k] += aj * gh[k];        \
                else for (int64_t k = 0; k < d; ++k) gx[k] = aj * gh[k];                       \
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
}

/* Phase 1 of S queries over the same n completed sources, in one pass over each source
 * (report §4.2, Algorithm 1): out[s] = sum_i alpha_si x_i, lse[t, s] = log sum_i exp(z_tsi),
 * alpha_s = softmax(z_ts), z [tokens, S, n]. The backward recomputes alpha from z and lse,
 * reads each source once for the S queries and writes (or adds to, where accumulate[i] is
 * set) its gradient once: sum_s alpha_si g_s. */
#define DEFINE_PHASE1(T, SUFFIX, EXP, LOG)                                                         \
void attnres_phase1_forward_##SUFFIX(                                                          \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *z,          \
    T *const *out, T *lse, int threads)                                                        \
{                                                                                              \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        T *w = (T *)malloc((size_t)(S * n) * sizeof(T));                                      \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t t = 0; t < tokens; ++t) {                                                 \
            for (int64_t s = 0; s < S; ++s) {                                                  \
                const T *zs = z + (t * S + s) * n;                                             \
                T *ws = w + s * n;                                                             \
                T mx = -INFINITY, se = 0;                                                      \
                for (int64_t i = 0; i < n; ++i) if (zs[i] > mx) mx = zs[i];                    \
                for (int64_t i = 0; i < n; ++i) { ws[i] = EXP(zs[i] - mx); se += ws[i]; }      \
                const T inv = (T)1 / se;                                                       \
                for (int64_t i = 0; i < n; ++i) ws[i] *= inv;                                  \
                lse[t * S + s] = mx + LOG(se);                                                 \
            }                                                                                  \
            for (int64_t i = 0; i < n; ++i) {                                                  \
                const T *x = src[i] + t * d;                                                   \
                for (int64_t s = 0; s < S; ++s) {                                              \
                    T *o = out[s] + t * d;                                                     \
                    const T a = w[s * n + i];                                                  \
                    if (i == 0) for (int64_t k = 0; k < d; ++k) o[k] = a * x[k];               \
                    else for (int64_t k = 0; k < d; ++k) o[k] += a * x[k];                     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(w);                                                                               \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* Backward from gout[s] (d / d out[s], NULL: zero) and glse [tokens, S] (NULL: zero).        \
 * Writes gz [tokens, S, n] (NULL: not needed) and gsrc[i] (NULL: not needed). */             \
void attnres_phase1_backward_##SUFFIX(                                                         \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *z,          \
    const T *lse, const T *const *gout, const T *glse, T *gz, T *const *gsrc,                  \
    const unsigned char *accumulate, int threads)                                              \
{                                                                                              \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        T *w = (T *)malloc((size_t)(2 * S * n) * sizeof(T)); /* alpha, then the dots */        \
        T *dots = w + S * n;                                                                   \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t t = 0; t < tokens; ++t) {                                                 \
            for (int64_t s = 0; s < S; ++s)                                                    \
                for (int64_t i = 0; i < n; ++i)                                                \
                    w[s * n + i] = EXP(z[(t * S + s) * n + i] - lse[t * S + s]);               \
            if (gz != NULL) { /* dz_si = alpha_si (g_s . x_i - g_s . out_s + glse_s) */       \
                for (int64_t i = 0; i < n; ++i) {                                              \
                    const T *x = src[i] + t * d;                                               \
                    for (int64_t s = 0; s < S; ++s) {                                          \
                        dots[s * n + i] = gout[s] != NULL ? dot_##SUFFIX(gout[s] + t * d, x, d) : (T)0; \
                    }                                                                          \
                }                                                                              \
                for (int64_t s = 0; s < S; ++s) {                                              \
                    const T *ws = w + s * n, *ds = dots + s * n;                               \
                    T mean = 0;                                                                \
                    for (int64_t i = 0; i < n; ++i) mean += ws[i] * ds[i];                     \
                    const T gl = glse != NULL ? glse[t * S + s] : (T)0;                        \
                    T *gzs = gz + (t * S + s) * n;                                             \
                    for (int64_t i = 0; i < n; ++i) gzs[i] = ws[i] * (ds[i] - mean + gl);      \
                }                                                                              \
            }                                                                                  \
            for (int64_t i = 0; i < n; ++i) {                                                  \
                if (gsrc[i] == NULL) continue;                                                 \
                T *gx = gsrc[i] + t * d;                                                       \
                if (!accumulate[i]) memset(gx, 0, (size_t)d * sizeof(T));                      \
                for (int64_t s = 0; s < S; ++s) {                                              \
                    if (gout[s] == NULL) continue;                                             \
                    const T *g = gout[s] + t * d;                                              \
                    const T a = w[s * n + i];                                                  \
                    for (int64_t k = 0; k < d; ++k) gx[k] += a * g[k];                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(w);                                                                               \
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
DEFINE_MERGE(float, f32, expf, sqrtf)
DEFINE_MERGE(double, f64, exp, sqrt)
DEFINE_PHASE1(float, f32, expf, logf)
DEFINE_PHASE1(double, f64, exp, log)
