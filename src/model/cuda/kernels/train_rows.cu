// Row kernels of the trainer's forward and backward: RMSNorm both ways, q's and k's RMSNorm with
// RoPE both ways, the experts' activation silu(g) * u scaled by each row's routing weight both ways,
// and the chosen tokens' log-probabilities over the vocabulary with softmax - onehot left for the
// backward. Each replaces a chain of LibTorch element-wise passes (casts to fp32, powers, means,
// products) with one or two reads of the row. Rounding follows the eager path: the normalised values are
// rounded to the model dtype before the weight product.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../train_kernels.hpp"
#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kRowWarps = 8;  // rows (one a warp) of a norm block
constexpr int kVocabThreads = 512;
constexpr int kVocabLoads = 4;  // vectors a thread has in flight in the log-probability rows

// Elements [i, i + V) of a row as floats, V = 8 (16-byte loads) or 1.
template <int V, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
    if constexpr (V == 8) {
        load8(p, out);
    } else {
        out[0] = to_float(p[0]);
    }
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[V]) {
    if constexpr (V == 8) {
        store8(p, v);
    } else {
        p[0] = from_float<T>(v[0]);
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    rms_norm_forward_kernel(const T* x, const T* w, float eps, int64_t rows, int width, T* y, float* rstd) {
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * width;
    float sum_sq = 0.0f;
    for (int c = lane * V; c < width; c += 32 * V) {
        float v[V];
        load_vec<V>(xr + c, v);
#pragma unroll
        for (int k = 0; k < V; ++k) sum_sq += v[k] * v[k];
    }
    const float inv = rsqrtf(warp_sum(sum_sq) / static_cast<float>(width) + eps);
    if (lane == 0) rstd[row] = inv;
    T* yr = y + row * width;
    for (int c = lane * V; c < width; c += 32 * V) {
        float v[V], g[V];
        load_vec<V>(xr + c, v);
        load_vec<V>(w + c, g);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = g[k] * round_to<T>(v[k] * inv);
        store_vec<V>(yr + c, v);
    }
}

// dx = rstd (g - n mean(g n)) with n = x rstd and g = dy w. One block a row at a time: thread t owns
// the columns (t + j kNormThreads) V + [0, V) for j < C, so its share of dw = sum over the block's
// rows of dy round(n) stays in registers and goes to dw_partial[blockIdx.x] once, with no atomics.
template <typename T, int V, int C>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_backward_kernel(const T* dy, const T* x, const T* w, const float* rstd, int64_t rows, int width,
                             T* dx, float* dw_partial) {
    __shared__ float scratch[32];
    auto column = [](int j) { return (static_cast<int>(threadIdx.x) + j * kNormThreads) * V; };
    float wv[C][V] = {}, dw[C][V] = {};
#pragma unroll
    for (int j = 0; j < C; ++j)
        if (column(j) < width) load_vec<V>(w + column(j), wv[j]);
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * width;
        const T* dyr = dy + row * width;
        float xv[C][V] = {}, gv[C][V] = {};
        float dot = 0.0f;
        const float inv = rstd[row];
#pragma unroll
        for (int j = 0; j < C; ++j) {
            if (column(j) < width) load_vec<V>(xr + column(j), xv[j]), load_vec<V>(dyr + column(j), gv[j]);
#pragma unroll
            for (int k = 0; k < V; ++k) dot += gv[j][k] * wv[j][k] * xv[j][k] * inv;
        }
        const float mean = block_sum(dot, scratch) / static_cast<float>(width);
        T* dxr = dx + row * width;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            if (column(j) >= width) continue;
            float out[V];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float n = xv[j][k] * inv;
                out[k] = inv * (gv[j][k] * wv[j][k] - n * mean);
                dw[j][k] += gv[j][k] * round_to<T>(n);
            }
            store_vec<V>(dxr + column(j), out);
        }
    }
    float* part = dw_partial + static_cast<int64_t>(blockIdx.x) * width;
#pragma unroll
    for (int j = 0; j < C; ++j)
        if (column(j) < width)
#pragma unroll
            for (int k = 0; k < V; ++k) part[column(j) + k] = dw[j][k];
}

// Lanes of a head row (norm + RoPE): a row of `width` (a power of two in [16, 256]) takes
// width / 8 lanes, lane l of it holding columns [8l, 8l + 8); a warp works on 256 / width rows.
struct HeadRowLanes {
    int span;      // lanes a row
    int per_warp;  // rows a warp
    int col;       // this lane's first column
    int slot;      // this lane's row among its warp's
    __device__ explicit HeadRowLanes(int width) {
        const int lane = threadIdx.x & 31;
        span = width / 8 < 32 ? width / 8 : 32;
        per_warp = 32 / span;
        col = (lane % span) * 8;
        slot = lane / span;
    }
    // v summed over the lanes of this lane's row.
    __device__ float row_sum(float v) const {
        for (int o = span / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
        return v;
    }
};

// Head rows a block of kRowWarps warps works on at once.
int64_t head_rows_per_block(int width) { return kRowWarps * std::max(1, 256 / width); }

// Blocks of a norm backward for `rounds` block-sized pieces of its rows: enough to keep every SM
// streaming rows (eight of 256 threads an SM); each block adds one partial row of dw to reduce.
int norm_backward_blocks(int64_t rounds) { return static_cast<int>(std::clamp<int64_t>(rounds, 1, 1024)); }

// RMSNorm of each head's row followed by RoPE (q and k before attention): row r of x [rows, width]
// belongs to token r / heads, whose cos and sin rows [width] sit at that index. A row takes
// width / 8 lanes, lane l of it holding columns [8l, 8l + 8), with its rotation partner (the other
// half) in lane l ^ (width / 16); a warp works on 256 / width rows at once (two for heads of 128).
// The normalised row is rounded as RMSNorm's output is, the rotation once.
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    norm_rope_forward_kernel(const T* x, const T* w, const T* cos, const T* sin, float eps, int64_t rows,
                             int heads, int width, T* y, float* rstd) {
    const int lane = threadIdx.x & 31;
    const HeadRowLanes my(width);
    const int64_t row =
        (static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5)) * my.per_warp + my.slot;
    const bool on = row < rows;  // every lane takes part in the shuffles
    const int64_t at = row * width + my.col, tok = (row / heads) * width + my.col;
    float v[8] = {}, g[8] = {}, c[8] = {}, sn[8] = {};
    if (on) load8(x + at, v), load8(w + my.col, g), load8(cos + tok, c), load8(sin + tok, sn);
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) sum_sq += v[k] * v[k];
    const float inv = rsqrtf(my.row_sum(sum_sq) / static_cast<float>(width) + eps);
    if (on && my.col == 0) rstd[row] = inv;
    const int partner = width / 16;
    const bool first_half = (lane & partner) == 0;
    float out[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float n = round_to<T>(g[k] * round_to<T>(v[k] * inv));
        const float p = __shfl_xor_sync(kFullMask, n, partner);
        out[k] = first_half ? n * c[k] - p * sn[k] : n * c[k] + p * sn[k];
    }
    if (on) store8(y + at, out);
}

// The backward: the rotation's transpose takes dy to the norm's output gradient dn (first half
// dy1 c + dy2 s, second half dy2 c - dy1 s), then RMSNorm's backward as rms_norm_backward_kernel.
// A row takes width / 8 lanes, so a warp works on 256 / width rows at once (two for heads of 128:
// no lane idles); each lane keeps its columns' share of dw in registers until the block's end.
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32)
    norm_rope_backward_kernel(const T* dy, const T* x, const T* w, const T* cos, const T* sin,
                              const float* rstd, int64_t rows, int heads, int width, T* dx,
                              float* dw_partial) {
    extern __shared__ float dw[];
    for (int c = threadIdx.x; c < width; c += blockDim.x) dw[c] = 0.0f;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const HeadRowLanes my(width);
    const int col = my.col;
    const int partner = width / 16;
    const bool first_half = (lane & partner) == 0;
    float wv[8], dw_mine[8] = {};  // the lane's columns of dw over its rows
    load8(w + col, wv);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowWarps * my.per_warp;
    for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5)) * my.per_warp;
         first < rows; first += stride) {
        const int64_t row = first + my.slot;
        const bool on = row < rows;  // every lane takes part in the shuffles
        const int64_t at = row * width + col, tok = (row / heads) * width + col;
        float d[8] = {}, xv[8] = {}, c[8] = {}, sn[8] = {};
        if (on) load8(dy + at, d), load8(x + at, xv), load8(cos + tok, c), load8(sin + tok, sn);
        const float inv = on ? rstd[row] : 0.0f;
        float dn[8], dot = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float q = __shfl_xor_sync(kFullMask, d[k] * sn[k], partner);
            dn[k] = first_half ? d[k] * c[k] + q : d[k] * c[k] - q;
            dot += dn[k] * wv[k] * xv[k] * inv;
        }
        const float mean = my.row_sum(dot) / static_cast<float>(width);
        if (!on) continue;
        float out[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float n = xv[k] * inv;
            out[k] = inv * (dn[k] * wv[k] - n * mean);
            dw_mine[k] += dn[k] * round_to<T>(n);
        }
        store8(dx + at, out);
    }
    for (int k = 0; k < 8; ++k) atomicAdd(&dw[col + k], dw_mine[k]);
    __syncthreads();
    float* part = dw_partial + static_cast<int64_t>(blockIdx.x) * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) part[c] = dw[c];
}

// h = silu(g) u w[row], one warp a row, fp32 math rounded once (the composition rounds each of its
// three products).
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    weighted_swiglu_forward_kernel(const T* g, const T* u, const float* w, int64_t rows, int width, T* h) {
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float wr = w[row];
    const int64_t at = row * width;
    for (int c = lane * V; c < width; c += 32 * V) {
        float gv[V], uv[V], out[V];
        load_vec<V>(g + at + c, gv);
        load_vec<V>(u + at + c, uv);
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = gv[k] / (1.0f + __expf(-gv[k])) * uv[k] * wr;
        store_vec<V>(h + at + c, out);
    }
}

// With s = sigmoid(g): dg = dh w u s (1 + g (1 - s)), du = dh w g s, dw[row] = sum(dh g s u).
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    weighted_swiglu_backward_kernel(const T* dh, const T* g, const T* u, const float* w, int64_t rows,
                                    int width, T* dg, T* du, float* dw) {
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float wr = w[row];
    const int64_t at = row * width;
    float dot = 0.0f;
    for (int c = lane * V; c < width; c += 32 * V) {
        float dv[V], gv[V], uv[V], dgv[V], duv[V];
        load_vec<V>(dh + at + c, dv);
        load_vec<V>(g + at + c, gv);
        load_vec<V>(u + at + c, uv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float s = 1.0f / (1.0f + __expf(-gv[k])), silu = gv[k] * s, a = dv[k] * wr;
            dgv[k] = a * uv[k] * s * (1.0f + gv[k] * (1.0f - s));
            duv[k] = a * silu;
            dot += dv[k] * silu * uv[k];
        }
        store_vec<V>(dg + at + c, dgv);
        store_vec<V>(du + at + c, duv);
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[row] = dot;
}

// out[t] = sum over k < K of in[inverse[t K + k]] for rows of `width`: each token's K slot rows, from
// expert order back to token order (the experts' combine, and the backward of moving tokens to their
// slots). One warp a token; lane k < K holds the k-th index, fp32 sums rounded once.
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    slot_sum_kernel(const T* in, const T* also, const int64_t* inverse, int64_t tokens, int K, int width,
                    T* out) {
    const int lane = threadIdx.x & 31;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (t >= tokens) return;
    const int64_t mine = lane < K ? inverse[t * K + lane] : 0;
    for (int c0 = 0; c0 < width; c0 += 32 * V) {  // the same trips on every lane: the shuffles need all
        const int c = c0 + lane * V;
        float acc[V] = {};
        for (int k = 0; k < K; ++k) {
            const int64_t src = __shfl_sync(kFullMask, mine, k);
            if (c >= width) continue;
            float v[V];
            load_vec<V>(in + src * width + c, v);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += v[j];
            if (also == nullptr) continue;
            load_vec<V>(also + src * width + c, v);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += v[j];
        }
        if (c < width) store_vec<V>(out + t * width + c, acc);
    }
}

// A 32-bit hash of (seed, i): the random bits of stochastic rounding.
__device__ __forceinline__ uint32_t mix32(uint32_t seed, int64_t i) {
    uint32_t x = seed ^ static_cast<uint32_t>(i) ^ (static_cast<uint32_t>(i >> 32) * 0x9e3779b9u);
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// v rounded to bf16 up or down with probability by distance (16 random bits added below bf16's last
// bit, then truncated): unbiased, so a moment that changes by less than half a bf16 step a step still
// moves on average. Round to nearest would leave beta2 = 0.999's decay of v stuck at most values.
__device__ __forceinline__ __nv_bfloat16 round_bf16_stochastic(float v, uint32_t random) {
    uint32_t bits = __float_as_uint(v);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits += random & 0xffffu;  // inf and NaN as they are
    return __ushort_as_bfloat16(static_cast<unsigned short>(bits >> 16));
}

// Moments of type M stored from floats: fp32 as they are, bf16 rounded stochastically.
template <typename M>
__device__ __forceinline__ M store_moment(float v, uint32_t seed, int64_t i) {
    if constexpr (std::is_same_v<M, float>) {
        return v;
    } else {
        return round_bf16_stochastic(v, mix32(seed, i));
    }
}

// AdamW on fp32 master weights p with moments m, v (fp32, or bf16 rounded stochastically), reading
// the gradient in its own type G and writing the model's copy w (bf16; null = none) in the same pass,
// as torch.optim.AdamW computes it, over elements [begin, end). V = 8: each thread moves 16-byte
// groups of eight elements (all pointers 16-byte aligned, end - begin a multiple of 8); V = 1: one
// element at a time. The clipping scale is read from the device where given (no host round trip
// for the gradient norm).
template <int V, typename G, typename M>
__global__ void __launch_bounds__(256)
    adamw_master_kernel(float* p, const G* g, M* m, M* v, __nv_bfloat16* w, int64_t begin, int64_t end,
                        AdamwArgs a, const float* scale_on_device) {
    const float grad_scale = scale_on_device != nullptr ? *scale_on_device : a.grad_scale;
    const int64_t groups = (end - begin) / V;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < groups; k += stride) {
        const int64_t i0 = begin + k * V;
        float pv[V], gv[V], mv[V], vv[V];
        if constexpr (V == 8) {
            load8(p + i0, pv);
            load8(g + i0, gv);
            load8(m + i0, mv);
            load8(v + i0, vv);
        } else {
            pv[0] = p[i0], gv[0] = to_float(g[i0]), mv[0] = to_float(m[i0]), vv[0] = to_float(v[i0]);
        }
        alignas(16) M mo[V], vo[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float grad = gv[j] * grad_scale;
            const float mi = a.beta1 * mv[j] + (1.0f - a.beta1) * grad;
            const float vi = a.beta2 * vv[j] + (1.0f - a.beta2) * grad * grad;
            const float denom = sqrtf(vi) / a.bias_correction2_sqrt + a.eps;
            pv[j] = pv[j] * (1.0f - a.lr * a.weight_decay) - a.step_size * mi / denom;
            mo[j] = store_moment<M>(mi, a.seed, i0 + j);
            vo[j] = store_moment<M>(vi, a.seed ^ 0x5bd1e995u, i0 + j);
        }
        if constexpr (V == 8) {
            store8(p + i0, pv);
            if (w != nullptr) store8(w + i0, pv);
            if constexpr (std::is_same_v<M, float>) {
                store8(m + i0, mo);
                store8(v + i0, vo);
            } else {
                *reinterpret_cast<uint4*>(m + i0) = *reinterpret_cast<const uint4*>(mo);
                *reinterpret_cast<uint4*>(v + i0) = *reinterpret_cast<const uint4*>(vo);
            }
        } else {
            p[i0] = pv[0], m[i0] = mo[0], v[i0] = vo[0];
            if (w != nullptr) w[i0] = __float2bfloat16(pv[0]);
        }
    }
}

// (max, sum of exp(z - max)) pairs, merged.
__device__ __forceinline__ void merge_lse(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;  // both empty (every logit masked so far)
    s = s * __expf(m - top) + s2 * __expf(m2 - top);
    m = top;
}

// The (max, sum) pair merged over the warp; every lane gets the result.
__device__ __forceinline__ void warp_merge_lse(float& m, float& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(kFullMask, m, o), s2 = __shfl_xor_sync(kFullMask, s, o);
        merge_lse(m, s, m2, s2);
    }
}

// Logit c of a row after temperature and bias.
__device__ __forceinline__ float scaled_logit(float z, int64_t c, float temperature, const float* bias) {
    return z / temperature + (bias != nullptr ? bias[c] : 0.0f);
}

// One block a row. The first pass keeps a running (max, sum) per thread, folding kVocabLoads vectors
// at a time: their loads are in flight together and the running sum is rescaled at most once for
// them. The second pass walks the row backwards, so the part read last (the likeliest still in L2)
// is read first.
template <typename T, int V>
__global__ void __launch_bounds__(kVocabThreads)
    selected_logprob_rows_kernel(T* logits, int64_t ld, const int64_t* targets, const float* bias,
                                 float temperature, int vocab, bool write_softmax, float* lp) {
    constexpr int U = kVocabLoads, kStep = kVocabThreads * V;
    __shared__ float red_m[32], red_s[32];
    __shared__ float lse_shared;
    const int64_t row = blockIdx.x;
    T* lr = logits + row * ld;
    float m = -INFINITY, s = 0.0f;
    for (int c0 = threadIdx.x * V; c0 < vocab; c0 += kStep * U) {
        float z[U][V];
        float top = -INFINITY;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * kStep;
            if (c < vocab) {
                load_vec<V>(lr + c, z[u]);
            } else {
#pragma unroll
                for (int k = 0; k < V; ++k) z[u][k] = -INFINITY;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * kStep;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                if (c < vocab) z[u][k] = scaled_logit(z[u][k], c + k, temperature, bias);
                top = fmaxf(top, z[u][k]);
            }
        }
        if (top == -INFINITY) continue;              // all masked (or past the row's end)
        if (top > m) s *= __expf(m - top), m = top;  // exp(-inf) = 0 while s is still 0
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int k = 0; k < V; ++k) s += __expf(z[u][k] - m);
    }
    warp_merge_lse(m, s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red_m[warp] = m, red_s[warp] = s;
    __syncthreads();
    if (warp == 0) {
        const int nw = kVocabThreads / 32;
        m = lane < nw ? red_m[lane] : -INFINITY;
        s = lane < nw ? red_s[lane] : 0.0f;
        warp_merge_lse(m, s);
        if (lane == 0) lse_shared = m + logf(s);
    }
    __syncthreads();
    const float lse = lse_shared;
    const int64_t t = targets[row];
    const float zt = scaled_logit(to_float(lr[t]), t, temperature, bias);
    const float chosen = zt - lse;
    if (threadIdx.x == 0) lp[row] = chosen;
    if (!write_softmax) return;
    __syncthreads();  // every thread has read lr[t]
    const int groups = (vocab + kStep * U - 1) / (kStep * U);
    for (int g = groups - 1; g >= 0; --g) {
        const int c0 = g * kStep * U + threadIdx.x * V;
        float z[U][V];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c0 + u * kStep < vocab) load_vec<V>(lr + c0 + u * kStep, z[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * kStep;
            if (c >= vocab) continue;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float v = scaled_logit(z[u][k], c + k, temperature, bias);
                z[u][k] = c + k == t ? expm1f(chosen) : __expf(v - lse);
            }
            store_vec<V>(lr + c, z[u]);
        }
    }
}

// Tags for_rows() passes to the launchers below: the element type and the vector width.
template <typename T>
struct Elements {
    using type = T;
};

template <typename T, int V>
void norm_forward(Elements<T>, std::integral_constant<int, V>, const void* x, const void* w, float eps,
                  int64_t rows, int width, void* y, float* rstd, cudaStream_t stream) {
    const auto blocks = static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps);
    rms_norm_forward_kernel<T, V><<<blocks, kRowWarps * 32, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), eps, rows, width, static_cast<T*>(y), rstd);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int V>
void norm_backward(Elements<T>, std::integral_constant<int, V>, const void* dy, const void* x, const void* w,
                   const float* rstd, int64_t rows, int width, void* dx, float* dw_partial, int blocks,
                   cudaStream_t stream) {
    // As few column chunks a thread as the width allows: registers bound how many blocks an SM runs.
    auto run = [&](auto chunks) {
        rms_norm_backward_kernel<T, V, decltype(chunks)::value><<<blocks, kNormThreads, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd, rows, width,
            static_cast<T*>(dx), dw_partial);
    };
    const int chunks = (width + kNormThreads * V - 1) / (kNormThreads * V);
    if (V == 1 || chunks > 2)
        run(std::integral_constant<int, kMaxHidden / (kNormThreads * V)>{});
    else if (chunks == 2)
        run(std::integral_constant<int, 2>{});
    else
        run(std::integral_constant<int, 1>{});
    MOERL_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int V>
void logprob_rows(Elements<T>, std::integral_constant<int, V>, void* logits, int64_t ld,
                  const int64_t* targets, const float* bias, float temperature, int64_t rows, int vocab,
                  bool write_softmax, float* lp, cudaStream_t stream) {
    selected_logprob_rows_kernel<T, V><<<static_cast<unsigned>(rows), kVocabThreads, 0, stream>>>(
        static_cast<T*>(logits), ld, targets, bias, temperature, vocab, write_softmax, lp);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int V>
void swiglu_forward(Elements<T>, std::integral_constant<int, V>, const void* g, const void* u, const float* w,
                    int64_t rows, int width, void* h, cudaStream_t stream) {
    const auto blocks = static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps);
    weighted_swiglu_forward_kernel<T, V><<<blocks, kRowWarps * 32, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(u), w, rows, width, static_cast<T*>(h));
    MOERL_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int V>
void swiglu_backward(Elements<T>, std::integral_constant<int, V>, const void* dh, const void* g,
                     const void* u, const float* w, int64_t rows, int width, void* dg, void* du, float* dw,
                     cudaStream_t stream) {
    const auto blocks = static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps);
    weighted_swiglu_backward_kernel<T, V><<<blocks, kRowWarps * 32, 0, stream>>>(
        static_cast<const T*>(dh), static_cast<const T*>(g), static_cast<const T*>(u), w, rows, width,
        static_cast<T*>(dg), static_cast<T*>(du), dw);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

bool vec8(int64_t a, int64_t b, const void* p, const void* q = nullptr) {
    auto aligned = [](const void* ptr) {
        return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    };
    return a % 8 == 0 && b % 8 == 0 && aligned(p) && aligned(q);
}

// Calls fn(Elements<T>{}, std::integral_constant<int, V>{}) with T the element type of `dtype` (1 =
// bf16, else fp32) and V = 8 (16-byte loads) or 1.
template <class Fn>
void for_rows(int dtype, bool v8, Fn&& fn) {
    using V8 = std::integral_constant<int, 8>;
    using V1 = std::integral_constant<int, 1>;
    if (dtype == 1) {
        if (v8)
            fn(Elements<__nv_bfloat16>{}, V8{});
        else
            fn(Elements<__nv_bfloat16>{}, V1{});
    } else {
        if (v8)
            fn(Elements<float>{}, V8{});
        else
            fn(Elements<float>{}, V1{});
    }
}

}  // namespace

int rms_norm_backward_blocks(int64_t rows) { return norm_backward_blocks(rows); }  // a row a block

int norm_rope_backward_blocks(int64_t rows, int width) {
    const int64_t per_block = head_rows_per_block(width);
    return norm_backward_blocks((rows + per_block - 1) / per_block);
}

bool rms_norm_fits(int width) { return width >= 1 && width <= kMaxHidden; }

void launch_rms_norm_forward(int dtype, const void* x, const void* w, float eps, int64_t rows, int width,
                             void* y, float* rstd, cudaStream_t stream) {
    if (rows == 0) return;
    for_rows(dtype, vec8(width, 8, x, y) && vec8(8, 8, w), [&](auto elems, auto vec) {
        norm_forward(elems, vec, x, w, eps, rows, width, y, rstd, stream);
    });
}

void launch_rms_norm_backward(int dtype, const void* dy, const void* x, const void* w, const float* rstd,
                              int64_t rows, int width, void* dx, float* dw_partial, int blocks,
                              cudaStream_t stream) {
    MOERL_CHECK(rms_norm_fits(width), "rms_norm: width ", width, " over ", kMaxHidden);
    if (rows == 0) return;
    for_rows(dtype, vec8(width, 8, x, dx) && vec8(8, 8, dy, w), [&](auto elems, auto vec) {
        norm_backward(elems, vec, dy, x, w, rstd, rows, width, dx, dw_partial, blocks, stream);
    });
}

void launch_slot_sum(int dtype, const void* in, const void* also, const int64_t* inverse, int64_t tokens,
                     int K, int width, void* out, cudaStream_t stream) {
    MOERL_CHECK(K >= 1 && K <= 32, "slot_sum: ", K, " slots a token, expected 1 to 32");
    if (tokens == 0 || width == 0) return;
    const auto blocks = static_cast<unsigned>((tokens + kRowWarps - 1) / kRowWarps);
    for_rows(dtype, vec8(width, 8, in, out) && vec8(width, 8, also, out), [&](auto elems, auto vec) {
        using T = typename decltype(elems)::type;
        slot_sum_kernel<T, decltype(vec)::value>
            <<<blocks, kRowWarps * 32, 0, stream>>>(static_cast<const T*>(in), static_cast<const T*>(also),
                                                    inverse, tokens, K, width, static_cast<T*>(out));
    });
    MOERL_CUDA_CHECK(cudaGetLastError());
}

bool norm_rope_fits(int width) { return width >= 16 && width <= 256 && (width & (width - 1)) == 0; }

void launch_norm_rope_forward(int dtype, const void* x, const void* w, const void* cos, const void* sin,
                              float eps, int64_t rows, int heads, int width, void* y, float* rstd,
                              cudaStream_t stream) {
    MOERL_CHECK(norm_rope_fits(width) && heads >= 1, "norm_rope: width ", width, " / heads ", heads,
                " not taken");
    if (rows == 0) return;
    const int64_t per_block = head_rows_per_block(width);
    const auto blocks = static_cast<unsigned>((rows + per_block - 1) / per_block);
    for_rows(dtype, true, [&](auto elems, auto) {
        using T = typename decltype(elems)::type;
        norm_rope_forward_kernel<T><<<blocks, kRowWarps * 32, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(cos),
            static_cast<const T*>(sin), eps, rows, heads, width, static_cast<T*>(y), rstd);
    });
    MOERL_CUDA_CHECK(cudaGetLastError());
}

void launch_norm_rope_backward(int dtype, const void* dy, const void* x, const void* w, const void* cos,
                               const void* sin, const float* rstd, int64_t rows, int heads, int width,
                               void* dx, float* dw_partial, int blocks, cudaStream_t stream) {
    MOERL_CHECK(norm_rope_fits(width) && heads >= 1, "norm_rope: width ", width, " / heads ", heads,
                " not taken");
    if (rows == 0) return;
    const size_t smem = static_cast<size_t>(width) * sizeof(float);
    for_rows(dtype, true, [&](auto elems, auto) {
        using T = typename decltype(elems)::type;
        norm_rope_backward_kernel<T><<<blocks, kRowWarps * 32, smem, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w),
            static_cast<const T*>(cos), static_cast<const T*>(sin), rstd, rows, heads, width,
            static_cast<T*>(dx), dw_partial);
    });
    MOERL_CUDA_CHECK(cudaGetLastError());
}

void launch_weighted_swiglu_forward(int dtype, const void* g, const void* u, const float* w, int64_t rows,
                                    int width, void* h, cudaStream_t stream) {
    if (rows == 0 || width == 0) return;
    for_rows(dtype, vec8(width, 8, g, u) && vec8(8, 8, h),
             [&](auto elems, auto vec) { swiglu_forward(elems, vec, g, u, w, rows, width, h, stream); });
}

void launch_weighted_swiglu_backward(int dtype, const void* dh, const void* g, const void* u, const float* w,
                                     int64_t rows, int width, void* dg, void* du, float* dw,
                                     cudaStream_t stream) {
    if (rows == 0) return;
    for_rows(dtype, vec8(width, 8, dh, g) && vec8(8, 8, u, dg) && vec8(8, 8, du), [&](auto elems, auto vec) {
        swiglu_backward(elems, vec, dh, g, u, w, rows, width, dg, du, dw, stream);
    });
}

void launch_adamw_master(float* p, int grad_dtype, const void* g, int moment_dtype, void* m, void* v,
                         void* w_bf16, int64_t n, const AdamwArgs& a, const float* scale_on_device,
                         cudaStream_t stream) {
    if (n == 0) return;
    auto* w = static_cast<__nv_bfloat16*>(w_bf16);
    // The gradient's type and the vector width as for the row kernels, then the moments' type.
    for_rows(grad_dtype, vec8(8, 8, p, g) && vec8(8, 8, m, v) && vec8(8, 8, w), [&](auto grad, auto vec) {
        auto run = [&](auto moments) {
            constexpr int V = decltype(vec)::value;
            using G = typename decltype(grad)::type;
            using M = typename decltype(moments)::type;
            const int threads = 256;
            const auto* gt = static_cast<const G*>(g);
            auto *mt = static_cast<M*>(m), *vt = static_cast<M*>(v);
            const int64_t items = n / V, done = items * V;
            if (items > 0) {
                const auto blocks =
                    static_cast<unsigned>(std::min<int64_t>((items + threads - 1) / threads, 132 * 16));
                adamw_master_kernel<V>
                    <<<blocks, threads, 0, stream>>>(p, gt, mt, vt, w, 0, done, a, scale_on_device);
                MOERL_CUDA_CHECK(cudaGetLastError());
            }
            if (done == n) return;
            // The tail past the last group of V, one element a thread.
            adamw_master_kernel<1><<<1, 32, 0, stream>>>(p, gt, mt, vt, w, done, n, a, scale_on_device);
            MOERL_CUDA_CHECK(cudaGetLastError());
        };
        if (moment_dtype == 1)
            run(Elements<__nv_bfloat16>{});
        else
            run(Elements<float>{});
    });
}

void launch_selected_logprob_rows(int dtype, void* logits, int64_t ld, const int64_t* targets,
                                  const float* bias, float temperature, int64_t rows, int vocab,
                                  bool write_softmax, float* lp, cudaStream_t stream) {
    if (rows == 0) return;
    for_rows(dtype, vec8(vocab, ld, logits), [&](auto elems, auto vec) {
        logprob_rows(elems, vec, logits, ld, targets, bias, temperature, rows, vocab, write_softmax, lp,
                     stream);
    });
}

}  // namespace moerl::model::cuda
