/* The CPU implementation of the depth-attention operations (report §4.2), as passes over
 * the tokens: attnres/ops/depth_attention/cpu_kernel.py binds it to the custom operators.
 *
 * - phase1: Phase 1 of a block's (or group's) S queries over their n shared sources: each
 *   source's RMS factor and logits (computed once per call, shared by the S queries), the
 *   softmax, the S weighted sums and each query's log-sum-exp;
 * - merge: one sublayer's input (Phase 2): softmax over k sources of known logit (Phase 1's
 *   weighted sum, whose logit is its log-sum-exp) and c sources whose logits it computes
 *   (Block AttnRes' partial sum, Full AttnRes' outputs of the current group), the weighted
 *   sum, the next sublayer's RMSNorm;
 * and the backward of both. Each computes what torch_impl.py computes, with the same saved
 * statistics and the same backward decomposition (tests compare the two, forward and every
 * gradient, and gradcheck this kernel in double precision).
 *
 * Why a kernel: in eager PyTorch every (sublayer, source) pair costs about twelve passes
 * over a [tokens, d] tensor (a multiply-add in the forward; a product, a sum, a scaled copy
 * in the backward), each a separate operation. Here the loop runs over tokens and, per
 * token, over the sources: a token's rows of all sources stay in the L1 cache, so each
 * source is read once in the forward and once in the backward - its logits included - and
 * its gradient written once.
 *
 * Layout: every [tokens, d] tensor is contiguous (row t at t * d); logits and weights are
 * [tokens, S, n] or [tokens, m] with m = k + c.
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
#define ATTNRES_ABI_VERSION 4
#define PLAIN(x) x
#define MERGE_FORWARD_PARAMS(T, OPT)                                                           \
    int64_t tokens, int64_t d, int64_t k, int64_t c, const T *const *src, const T *z,          \
    OPT(const T *) const *comp, OPT(const T *) qg, double eps, OPT(const T *) norm_w,           \
    double norm_eps, T *out, T *alpha, OPT(T *) rc, OPT(T *) zc, OPT(T *) rstd, int threads
#define MERGE_BACKWARD_PARAMS(T, OPT)                                                          \
    int64_t tokens, int64_t d, int64_t k, int64_t c, const T *const *src,                      \
    OPT(const T *) const *comp, OPT(const T *) qg, OPT(const T *) norm_w, const T *alpha,       \
    OPT(const T *) rc, OPT(const T *) zc, OPT(const T *) rstd, const T *g,                      \
    OPT(T *) const *gsrc, OPT(T *) const *gcomp, OPT(T *) gz, OPT(T *) gqg_part,               \
    OPT(T *) gw_part, int threads
#define PHASE1_FORWARD_PARAMS(T, OPT)                                                          \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *q,          \
    double eps, T *const *out, T *lse, int threads
#define PHASE1_BACKWARD_PARAMS(T, OPT)                                                         \
    int64_t tokens, int64_t d, int64_t n, int64_t S, const T *const *src, const T *q,          \
    double eps, const T *lse, OPT(const T *) const *gout, OPT(const T *) glse,                 \
    OPT(T *) const *gsrc, OPT(T *) gq_part, int threads

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

/* out[j] = a . b[j] for the m rows b[j], four rows at a time against one load of a (rows
 * are short: one row of a stays in registers for the four products). */
#define DEFINE_MULTIDOT(T, SUFFIX)                                                                 \
static inline void multidot_##SUFFIX(const T *a, const T *const *b, int64_t m, int64_t d, T *out) \
{                                                                                              \
    typedef T V __attribute__((vector_size(32)));                                              \
    enum { W = 32 / sizeof(T) };                                                               \
    int64_t j = 0;                                                                             \
    for (; j + 4 <= m; j += 4) {                                                               \
        V c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, x, y;                                        \
        int64_t k = 0;                                                                         \
        for (; k + W <= d; k += W) {                                                           \
            memcpy(&x, a + k, sizeof(V));                                                      \
            memcpy(&y, b[j] + k, sizeof(V)); c0 += x * y;                                      \
            memcpy(&y, b[j + 1] + k, sizeof(V)); c1 += x * y;                                  \
            memcpy(&y, b[j + 2] + k, sizeof(V)); c2 += x * y;                                  \
            memcpy(&y, b[j + 3] + k, sizeof(V)); c3 += x * y;                                  \
        }                                                                                      \
        T s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                      \
        for (int l = 0; l < W; ++l) { s0 += c0[l]; s1 += c1[l]; s2 += c2[l]; s3 += c3[l]; }    \
        for (; k < d; ++k) {                                                                   \
            s0 += a[k] * b[j][k]; s1 += a[k] * b[j + 1][k];                                    \
            s2 += a[k] * b[j + 2][k]; s3 += a[k] * b[j + 3][k];                                \
        }                                                                                      \
        out[j] = s0; out[j + 1] = s1; out[j + 2] = s2; out[j + 3] = s3;                        \
    }                                                                                          \
    for (; j < m; ++j) out[j] = dot_##SUFFIX(a, b[j], d);                                      \
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


#ifdef _OPENMP
#include <omp.h>
#define ATTNRES_THREAD_ID(tid) (tid) = omp_get_thread_num()
#else
#define ATTNRES_THREAD_ID(tid) (void)(tid)
#endif

#define DEFINE_MERGE(T, SUFFIX, SQRT)                                                          \
/* The k sources, then the c computed-logit ones, as one table of m rows' bases. */          \
static const T **row_table_##SUFFIX(int64_t k, const T *const *src, int64_t c,                \
                                    const T *const *comp)                                      \
{                                                                                              \
    const T **rows = (const T **)malloc((size_t)(k + c + 1) * sizeof(T *));                   \
    for (int64_t j = 0; j < k; ++j) rows[j] = src[j];                                          \
    for (int64_t j = 0; j < c; ++j) rows[k + j] = comp[j];                                     \
    return rows;                                                                               \
}                                                                                              \
                                                                                               \
/* Forward. The logit of each computed source x_j: zc_j = rc_j (x_j . qg), rc_j = 1/rms(x_j)  \
 * (both written, [tokens, c]); alpha = softmax(z, zc) [tokens, m]; h = sum_j alpha_j x_j;    \
 * out = RMSNorm(h) with rstd [tokens] written, or h without a norm. */                       \
void attnres_merge_forward_##SUFFIX(MERGE_FORWARD_PARAMS(T, PLAIN))                           \
{                                                                                              \
    const int64_t m = k + c;                                                                   \
    const T **rows = row_table_##SUFFIX(k, src, c, comp);                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                         \
    for (int64_t t = 0; t < tokens; ++t) {                                                     \
        T *a = alpha + t * m;                                                                  \
        for (int64_t j = 0; j < k; ++j) a[j] = z[t * k + j];                                   \
        for (int64_t j = 0; j < c; ++j) { /* (x . qg) / rms(x) */                              \
            const T *x = comp[j] + t * d;                                                      \
            const T r = (T)1 / SQRT(dot_##SUFFIX(x, x, d) / (T)d + (T)eps);                    \
            rc[t * c + j] = r;                                                                 \
            a[k + j] = zc[t * c + j] = dot_##SUFFIX(x, qg, d) * r;                             \
        }                                                                                      \
        T mx = -INFINITY, se = 0;                                                              \
        for (int64_t j = 0; j < m; ++j) if (a[j] > mx) mx = a[j];                              \
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
            for (int64_t l = 0; l < d; ++l) o[l] = o[l] * r * norm_w[l];                       \
        }                                                                                      \
    }                                                                                          \
    free(rows);                                                                                \
}                                                                                              \
                                                                                               \
/* Backward from g = d loss / d out [tokens, d]. With a norm, h is recomputed from the        \
 * sources and gh = rstd (u - rstd^2 (u . h) h / d), u = g norm_w (else gh = g). Softmax:     \
 * dz_j = alpha_j (gh . x_j - sum_i alpha_i gh . x_i). Writes, where not NULL: gsrc[j] =      \
 * alpha_j gh; gz [tokens, k]; gcomp[j] = alpha_j gh + gr_j (qg - (rc_j zc_j / d) x_j) with    \
 * gr_j = dzc_j rc_j; per-thread partial sums over tokens gqg_part (sum gr_j x_j) and gw_part  \
 * (sum g h rstd), [threads, d], which the caller adds up. */                                 \
void attnres_merge_backward_##SUFFIX(MERGE_BACKWARD_PARAMS(T, PLAIN))                          \
{                                                                                              \
    const int64_t m = k + c;                                                                   \
    if (gqg_part != NULL) memset(gqg_part, 0, (size_t)(threads * d) * sizeof(T));              \
    if (gw_part != NULL) memset(gw_part, 0, (size_t)(threads * d) * sizeof(T));                \
    const T **rows = row_table_##SUFFIX(k, src, c, comp);                                      \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        int tid = 0;                                                                           \
        ATTNRES_THREAD_ID(tid);                                                                \
        T *buf = (T *)malloc((size_t)(2 * d + m) * sizeof(T)); /* h, gh, s */                  \
        T *h = buf, *gh = buf + d, *s = buf + 2 * d;                                           \
        T *gqg = gqg_part != NULL ? gqg_part + tid * d : NULL;                                 \
        T *gw = gw_part != NULL ? gw_part + tid * d : NULL;                                    \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t t = 0; t < tokens; ++t) {                                                 \
            const T *a = alpha + t * m, *gt = g + t * d;                                       \
            if (norm_w != NULL) {                                                              \
                combine_##SUFFIX(h, 0, rows, t * d, a, m, d);                                  \
                const T r = rstd[t];                                                           \
                for (int64_t l = 0; l < d; ++l) gh[l] = gt[l] * norm_w[l];                    \
                const T uh = dot_##SUFFIX(gh, h, d);                                           \
                if (gw != NULL) for (int64_t l = 0; l < d; ++l) gw[l] += gt[l] * h[l] * r;     \
                const T cf = r * r * uh / (T)d;                                                \
                for (int64_t l = 0; l < d; ++l) gh[l] = r * (gh[l] - cf * h[l]);               \
            } else {                                                                           \
                memcpy(gh, gt, (size_t)d * sizeof(T));                                         \
            }                                                                                  \
            T mean = 0;                                                                        \
            for (int64_t j = 0; j < m; ++j) {                                                  \
                s[j] = dot_##SUFFIX(gh, rows[j] + t * d, d);                                   \
                mean += a[j] * s[j];                                                           \
            }                                                                                  \
            if (gz != NULL) for (int64_t j = 0; j < k; ++j) gz[t * k + j] = a[j] * (s[j] - mean); \
            for (int64_t j = 0; j < k; ++j) {                                                  \
                if (gsrc[j] == NULL) continue;                                                 \
                T *gx = gsrc[j] + t * d;                                                       \
                for (int64_t l = 0; l < d; ++l) gx[l] = a[j] * gh[l];                          \
            }                                                                                  \
            for (int64_t j = 0; j < c; ++j) { /* d zc / d x = rc qg - (rc^2 zc / d) x */        \
                const T *x = comp[j] + t * d, aj = a[k + j], r = rc[t * c + j];                \
                const T gr = aj * (s[k + j] - mean) * r, cf = gr * r * zc[t * c + j] / (T)d;   \
                if (gcomp[j] != NULL) {                                                        \
                    T *gx = gcomp[j] + t * d;                                                  \
                    for (int64_t l = 0; l < d; ++l) gx[l] = aj * gh[l] + gr * qg[l] - cf * x[l]; \
                }                                                                              \
                if (gqg != NULL) for (int64_t l = 0; l < d; ++l) gqg[l] += gr * x[l];          \
            }                                                                                  \
        }                                                                                      \
        free(buf);                                                                             \
    }                                                                                          \
    free(rows);                                                                                \
}

/* Phase 1 works on tiles of this many tokens: their softmax weights are formed together
 * (one vectorized exp over the tile), then each token's rows are combined. */
#define TILE 16

/* Phase 1 of S queries q [S, d] (gain-folded) over the same n completed sources, in one
 * pass over each source (report §4.2, Algorithm 1): per token, each source's RMS factor
 * r_i = 1/rms(x_i) once for the S queries and its logits z_si = r_i (x_i . q_s); then
 * out[s] = sum_i alpha_si x_i with alpha_s = softmax(z_s), and lse[t, s] = log sum_i
 * exp(z_si). The backward recomputes the logits and weights from the sources, q and lse. */
#define DEFINE_PHASE1(T, SUFFIX, LOG, SQRT)                                                        \
/* The tile's logits w [tt, S, n] and the sources' RMS factors r [tt, n]; with g (the S      \
 * output gradients' rows, NULL: none) also the dots gx [tt, S, n] = g_s . x_i, in the same    \
 * pass over each source row. rows: scratch of 2 S + 1 row pointers, dots of 2 S + 1 values. */ \
static void phase1_logits_##SUFFIX(int64_t t0, int64_t tt, int64_t d, int64_t n, int64_t S,    \
                                   const T *const *src, const T *q, double eps, T *w, T *r,    \
                                   const T *const *g, T *gx, const T **rows, T *dots)          \
{                                                                                              \
    for (int64_t t = 0; t < tt; ++t) {                                                         \
        int64_t m = S + 1;                                                                     \
        for (int64_t s = 0; s < S; ++s) rows[1 + s] = q + s * d;                               \
        if (g != NULL)                                                                         \
            for (int64_t s = 0; s < S; ++s) if (g[s] != NULL) rows[m++] = g[s] + (t0 + t) * d; \
        for (int64_t i = 0; i < n; ++i) {                                                      \
            const T *x = src[i] + (t0 + t) * d;                                                \
            rows[0] = x;                                                                       \
            multidot_##SUFFIX(x, rows, m, d, dots);                                            \
            const T ri = (T)1 / SQRT(dots[0] / (T)d + (T)eps);                                 \
            r[t * n + i] = ri;                                                                 \
            for (int64_t s = 0; s < S; ++s) w[(t * S + s) * n + i] = ri * dots[1 + s];         \
            if (g == NULL) continue;                                                           \
            for (int64_t s = 0, j = S + 1; s < S; ++s)                                         \
                gx[(t * S + s) * n + i] = g[s] != NULL ? dots[j++] : (T)0;                     \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void attnres_phase1_forward_##SUFFIX(PHASE1_FORWARD_PARAMS(T, PLAIN))                         \
{                                                                                              \
    const int64_t tiles = (tokens + TILE - 1) / TILE;                                          \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        T *w = (T *)malloc((size_t)(TILE * S * n + TILE * n + 2 * S + 1) * sizeof(T));        \
        T *r = w + TILE * S * n, *dots = r + TILE * n; /* alpha, r, one row's dots */          \
        const T **rowp = (const T **)malloc((size_t)(2 * S + 1) * sizeof(T *));                \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t b = 0; b < tiles; ++b) {                                                  \
            const int64_t t0 = b * TILE, tt = tokens - t0 < TILE ? tokens - t0 : TILE;         \
            const int64_t rows = tt * S; /* one softmax per (token, query) */                  \
            phase1_logits_##SUFFIX(t0, tt, d, n, S, src, q, eps, w, r, NULL, NULL, rowp, dots); \
            for (int64_t j = 0; j < rows; ++j) {                                               \
                T *wr = w + j * n, mx = -INFINITY;                                             \
                for (int64_t i = 0; i < n; ++i) if (wr[i] > mx) mx = wr[i];                    \
                /* an infinite max (an infinite query) is the lse, as torch.logsumexp gives it \
                 * (NaN with a NaN logit), not mx + log(NaN) from inf - inf */                 \
                lse[t0 * S + j] = mx;                                                          \
                if (isinf(mx))                                                                 \
                    for (int64_t i = 0; i < n; ++i) if (wr[i] != wr[i]) lse[t0 * S + j] = wr[i]; \
                for (int64_t i = 0; i < n; ++i) wr[i] -= mx;                                   \
            }                                                                                  \
            exp_inplace_##SUFFIX(w, rows * n);                                                 \
            for (int64_t j = 0; j < rows; ++j) {                                               \
                T *wr = w + j * n, se = 0;                                                     \
                for (int64_t i = 0; i < n; ++i) se += wr[i];                                   \
                const T inv = (T)1 / se;                                                       \
                for (int64_t i = 0; i < n; ++i) wr[i] *= inv;                                  \
                if (!isinf(lse[t0 * S + j])) lse[t0 * S + j] += LOG(se);                       \
            }                                                                                  \
            for (int64_t t = 0; t < tt; ++t)                                                   \
                for (int64_t s = 0; s < S; ++s)                                                \
                    combine_##SUFFIX(out[s] + (t0 + t) * d, 0, src, (t0 + t) * d,              \
                                     w + (t * S + s) * n, n, d);                               \
        }                                                                                      \
        free(w);                                                                               \
        free(rowp);                                                                            \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* Backward from gout[s] (NULL: zero) and glse [tokens, S] (NULL: zero). With g_s . x_i the  \
 * dots: dz_si = alpha_si (g_s . x_i - sum_j alpha_sj g_s . x_j + glse_s); then d x_i =       \
 * sum_s alpha_si g_s + r_i u_i - (r_i^2 / d) (sum_s dz_si z_si) x_i with u_i = sum_s dz_si   \
 * q_s (through the logits), into gsrc[i] (NULL: not needed); d q_s = sum_t,i dz_si r_i x_i   \
 * in per-thread partial sums gq_part [threads, S, d] (NULL: not needed). */                  \
void attnres_phase1_backward_##SUFFIX(PHASE1_BACKWARD_PARAMS(T, PLAIN))                        \
{                                                                                              \
    const int64_t tiles = (tokens + TILE - 1) / TILE;                                          \
    if (gq_part != NULL) memset(gq_part, 0, (size_t)(threads * S * d) * sizeof(T));            \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        int tid = 0;                                                                           \
        ATTNRES_THREAD_ID(tid);                                                                \
        /* the tile's alpha, logits, dots then dz, r; one row's dots and coefficients */       \
        const int64_t sz = TILE * S * n;                                                       \
        T *w = (T *)malloc((size_t)(3 * sz + 2 * TILE * n + 4 * S + 2) * sizeof(T));          \
        T *zt = w + sz, *dz = zt + sz, *r = dz + sz, *dots = r + TILE * n, *cf = dots + 2 * S + 1; \
        T *ci = cf + 2 * S + 1; /* the tile's coefficients of d q_s */                         \
        const T **rowp = (const T **)malloc((size_t)(2 * S + 1 + TILE * n) * sizeof(T *));     \
        const T **xr = rowp + 2 * S + 1; /* the tile's source rows */                          \
        T *gq = gq_part != NULL ? gq_part + (int64_t)tid * S * d : NULL;                       \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t b = 0; b < tiles; ++b) {                                                  \
            const int64_t t0 = b * TILE, tt = tokens - t0 < TILE ? tokens - t0 : TILE;         \
            phase1_logits_##SUFFIX(t0, tt, d, n, S, src, q, eps, zt, r, gout, dz, rowp, dots); \
            for (int64_t j = 0; j < tt * S * n; ++j) w[j] = zt[j] - lse[t0 * S + j / n];       \
            exp_inplace_##SUFFIX(w, tt * S * n);                                               \
            for (int64_t j = 0; j < tt * S; ++j) { /* dz = alpha (dots - alpha . dots + glse) */ \
                T *dr = dz + j * n;                                                            \
                const T *wr = w + j * n;                                                       \
                T mean = 0;                                                                    \
                for (int64_t i = 0; i < n; ++i) mean += wr[i] * dr[i];                         \
                const T gl = glse != NULL ? glse[t0 * S + j] : (T)0;                           \
                for (int64_t i = 0; i < n; ++i) dr[i] = wr[i] * (dr[i] - mean + gl);           \
            }                                                                                  \
            for (int64_t t = 0; t < tt; ++t) {                                                 \
                const int64_t off = (t0 + t) * d;                                              \
                int64_t m = 0; /* d x_i = sum_s alpha_si g_s + sum_s dz_si r_i q_s - c0 x_i */  \
                for (int64_t s = 0; s < S; ++s) if (gout[s] != NULL) rowp[m++] = gout[s] + off; \
                for (int64_t s = 0; s < S; ++s) rowp[m + s] = q + s * d;                       \
                for (int64_t i = 0; i < n; ++i) {                                              \
                    const T *x = src[i] + off, ri = r[t * n + i];                              \
                    T zsum = 0;                                                                \
                    for (int64_t s = 0, j = 0; s < S; ++s) {                                   \
                        const int64_t at = (t * S + s) * n + i;                                \
                        if (gout[s] != NULL) cf[j++] = w[at];                                  \
                        cf[m + s] = dz[at] * ri;                                               \
                        zsum += dz[at] * zt[at];                                               \
                    }                                                                          \
                    xr[t * n + i] = x;                                                         \
                    if (gsrc[i] == NULL) continue;                                             \
                    rowp[m + S] = x;                                                           \
                    cf[m + S] = -ri * ri * zsum / (T)d;                                        \
                    combine_##SUFFIX(gsrc[i] + off, 0, rowp, 0, cf, m + S + 1, d);             \
                }                                                                              \
            }                                                                                  \
            if (gq == NULL) continue;                                                          \
            for (int64_t s = 0; s < S; ++s) { /* d q_s += sum_t,i dz_si r_i x_i */             \
                for (int64_t t = 0; t < tt; ++t)                                               \
                    for (int64_t i = 0; i < n; ++i) ci[t * n + i] = dz[(t * S + s) * n + i] * r[t * n + i]; \
                combine_##SUFFIX(gq + s * d, 1, xr, 0, ci, tt * n, d);                         \
            }                                                                                  \
        }                                                                                      \
        free(w);                                                                               \
        free(rowp);                                                                            \
    }                                                                                          \
}

DEFINE_DOT(float, f32)
DEFINE_DOT(double, f64)
DEFINE_MULTIDOT(float, f32)
DEFINE_MULTIDOT(double, f64)
DEFINE_COMBINE(float, f32)
DEFINE_COMBINE(double, f64)
DEFINE_MERGE(float, f32, sqrtf)
DEFINE_MERGE(double, f64, sqrt)
DEFINE_PHASE1(float, f32, logf, sqrtf)
DEFINE_PHASE1(double, f64, log, sqrt)

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
           "phase1_backward(" ATTNRES_XSTR(PHASE1_BACKWARD_PARAMS(scalar_t, NULLABLE)) ")";
}
