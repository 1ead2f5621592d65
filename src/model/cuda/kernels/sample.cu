// Greedy token choice on the device, so a decode step needs no logits on the host. Many blocks per
// row (a vocabulary of 150k is too long for one block to scan quickly): each folds its range into
// one 64-bit key (orderable value bits, then the inverted index so ties go to the lowest index), the
// row's maximum key is kept with one atomicMax, and the row's last block to finish writes its index.
#include <cfloat>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kArgmaxThreads = 256;
// Logits a thread reads: all of its loads in flight at once (bench/RESULTS.md).
constexpr int kArgmaxPerThread = 8;

__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    const unsigned u = __float_as_uint(v);
    const unsigned ordered = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(ordered) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const T* logits, int V, unsigned long long* best_key, int* blocks_done, int64_t* out,
                  int* advance_position) {
    griddep_wait();
    griddep_launch_dependents();
    __shared__ unsigned long long warp_best[kArgmaxThreads / 32];
    const int b = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const T* row = logits + static_cast<size_t>(b) * V;  // logits [B, V]
    const int first = blockIdx.x * kArgmaxThreads * kArgmaxPerThread;
    unsigned long long best = 0;
#pragma unroll 8
    for (int j = 0; j < kArgmaxPerThread; ++j) {
        const int i = first + j * kArgmaxThreads + threadIdx.x;
        if (i < V) best = max(best, argmax_key(to_float(row[i]), i));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(kFullMask, best, o));
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kArgmaxThreads / 32; ++w) best = max(best, warp_best[w]);
        atomicMax(best_key + b, best);
    }
    // The row's last block reads the winner and leaves the key zero for the next call.
    if (!last_block_of(blocks_done + b, gridDim.x) || threadIdx.x != 0) return;
    const unsigned long long key = atomicExch(best_key + b, 0ull);
    out[b] = static_cast<int64_t>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
    if (advance_position != nullptr && advance_position[b] >= 0) advance_position[b] += 1;
}

}  // namespace

void launch_argmax(int dtype, const void* logits, int B, int V, unsigned long long* keys, int* blocks_done,
                   int64_t* out, int* advance_position, const Launch& launch) {
    if (B == 0) return;
    constexpr int kPerBlock = kArgmaxThreads * kArgmaxPerThread;
    const dim3 grid((V + kPerBlock - 1) / kPerBlock, B);
    if (dtype == 0)
        launch_kernel(argmax_kernel<float>, grid, kArgmaxThreads, 0, launch,
                      static_cast<const float*>(logits), V, keys, blocks_done, out, advance_position);
    else
        launch_kernel(argmax_kernel<__nv_bfloat16>, grid, kArgmaxThreads, 0, launch,
                      static_cast<const __nv_bfloat16*>(logits), V, keys, blocks_done, out, advance_position);
}

// ---- sampling: one token a row from softmax(logits / T) by the inverse CDF in vocabulary order ----
// One block a row; warp w owns the contiguous chunk [w * chunk, (w + 1) * chunk) of the vocabulary and
// its lanes read it 32 consecutive logits at a time. Pass 1 folds each warp's chunk into its maximum
// and its mass relative to it (double); one thread turns the 32 masses into intervals of the row's
// running mass; the warp whose interval holds u x the row's mass walks its chunk again a tile at a
// time (a warp scan each) to find the token. The logits are read once, one chunk twice.
namespace {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kSampleAhead = 8;

// (m, s) folded with (m2, s2): the sum of exp(z - max) of both parts, relative to the larger maximum.
__device__ __forceinline__ void fold_mass(double& m, double& s, double m2, double s2) {
    if (s2 <= 0) return;
    if (s <= 0 || m2 > m) {
        s = s2 + (s > 0 ? s * exp(m - m2) : 0.0);
        m = m2;
    } else {
        s += s2 * exp(m2 - m);
    }
}

// The logits first + 32 k + lane (k < kSampleAhead) of a warp's tile group, all loads issued before any
// is used (one at a time, a row took as many memory round trips as its chunk has tiles); -inf past end.
template <typename T>
__device__ __forceinline__ void load_ahead(const T* row, int first, int end, int lane,
                                           float (&v)[kSampleAhead]) {
#pragma unroll
    for (int k = 0; k < kSampleAhead; ++k) {
        const int i = first + 32 * k + lane;
        v[k] = i < end ? to_float(row[i]) : -INFINITY;
    }
}

template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    sample_rows_kernel(const T* logits, int64_t stride, int V, double inv_temperature, const double* uniforms,
                       double* out) {
    __shared__ double warp_m[kSampleWarps], warp_s[kSampleWarps], before[kSampleWarps + 1];
    __shared__ double row_max, row_mass;
    __shared__ int last_warp;
    const int b = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const T* row = logits + static_cast<int64_t>(b) * stride;
    const int chunk = ((V + kSampleWarps - 1) / kSampleWarps + 31) / 32 * 32;
    const int begin = min(V, warp * chunk), end = min(V, begin + chunk);
    // Pass 1: this lane's maximum and mass, then the warp's; -inf (and NaN) logits weigh nothing.
    double m = -INFINITY, s = 0;
    for (int first = begin; first < end; first += 32 * kSampleAhead) {
        float v[kSampleAhead];
        load_ahead(row, first, end, lane, v);
#pragma unroll
        for (int k = 0; k < kSampleAhead; ++k) {
            const double z = static_cast<double>(v[k]) * inv_temperature;
            if (z > -INFINITY) fold_mass(m, s, z, 1.0);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double m2 = __shfl_xor_sync(kFullMask, m, o), s2 = __shfl_xor_sync(kFullMask, s, o);
        fold_mass(m, s, m2, s2);
    }
    if (lane == 0) warp_m[warp] = m, warp_s[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double mx = -INFINITY;
        for (int w = 0; w < kSampleWarps; ++w)
            if (warp_s[w] > 0) mx = fmax(mx, warp_m[w]);
        // Warp w's interval of the running mass is [before[w], before[w + 1]): the same numbers bound
        // neighbouring intervals, so they tile [0, mass) whatever the rounding.
        double acc = 0;
        int last = -1;
        for (int w = 0; w < kSampleWarps; ++w) {
            before[w] = acc;
            const double c = warp_s[w] > 0 ? warp_s[w] * exp(warp_m[w] - mx) : 0.0;
            warp_s[w] = c;  // now the warp's mass in the row's units
            if (c > 0) {
                acc += c;
                last = w;
            }
        }
        before[kSampleWarps] = acc;
        row_max = mx, row_mass = acc, last_warp = last;
    }
    __syncthreads();
    if (last_warp < 0) {  // no finite logit: the first token, log-prob -inf
        if (threadIdx.x == 0) out[b] = 0, out[gridDim.x + b] = -INFINITY;
        return;
    }
    const double M = row_max, total = row_mass, target = uniforms[b] * total;
    const bool mine =
        warp_s[warp] > 0 && before[warp] <= target && (target < before[warp + 1] || warp == last_warp);
    if (!mine) return;
    // Pass 2, one warp: the first token whose running mass exceeds the target (rounding aside: the
    // chunk's last token with any mass).
    double acc = before[warp];
    int found = -1, last_with_mass = -1;
    for (int group = begin; group < end && found < 0; group += 32 * kSampleAhead) {
        float v[kSampleAhead];
        load_ahead(row, group, end, lane, v);
#pragma unroll
        for (int k = 0; k < kSampleAhead; ++k) {
            const int first = group + 32 * k;
            const double z = static_cast<double>(v[k]) * inv_temperature;
            const double p = z > -INFINITY ? exp(z - M) : 0.0;
            double inc = p;  // the tile's running mass up to this lane
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double y = __shfl_up_sync(kFullMask, inc, o);
                if (lane >= o) inc += y;
            }
            const unsigned over = __ballot_sync(kFullMask, p > 0 && acc + inc > target);
            if (over != 0) {
                found = first + __ffs(over) - 1;
                break;
            }
            const unsigned with_mass = __ballot_sync(kFullMask, p > 0);
            if (with_mass != 0) last_with_mass = first + 31 - __clz(with_mass);
            acc += __shfl_sync(kFullMask, inc, 31);
        }
    }
    if (lane != 0) return;
    const int pick = found >= 0 ? found : last_with_mass;
    const double z = static_cast<double>(to_float(row[pick])) * inv_temperature;
    out[b] = static_cast<double>(pick);
    out[gridDim.x + b] = z - M - log(total);
}

}  // namespace

void launch_sample_rows(int dtype, const void* logits, int64_t row_stride, int B, int V, double temperature,
                        const double* uniforms, double* out, cudaStream_t stream) {
    if (B == 0) return;
    if (dtype == 0)
        sample_rows_kernel<float><<<B, kSampleThreads, 0, stream>>>(
            static_cast<const float*>(logits), row_stride, V, 1.0 / temperature, uniforms, out);
    else
        sample_rows_kernel<__nv_bfloat16><<<B, kSampleThreads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(logits), row_stride, V, 1.0 / temperature, uniforms, out);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moerl::model::cuda
