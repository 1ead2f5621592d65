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
// One block a row; thread t owns the contiguous chunk [t * chunk, (t + 1) * chunk) of the vocabulary.
// Pass 1 folds each chunk into its maximum and its mass relative to it (double); a block scan of the
// chunks' masses (rescaled to the row's maximum) finds the chunk where u x the row's mass falls, and
// that chunk's thread walks it again to find the token. The logits are read once, the chunk twice.
namespace {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    sample_rows_kernel(const T* logits, int64_t stride, int V, double inv_temperature, const double* uniforms,
                       double* out) {
    __shared__ double warp_max[kSampleWarps], warp_sum[kSampleWarps];
    __shared__ int warp_last[kSampleWarps];
    __shared__ double row_max;
    __shared__ int last_thread;
    const int b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const T* row = logits + static_cast<int64_t>(b) * stride;
    const int chunk = (V + kSampleThreads - 1) / kSampleThreads;
    const int begin = min(V, t * chunk), end = min(V, begin + chunk);
    double m = -INFINITY, s = 0;  // the chunk's maximum and sum of exp(z - m); -inf logits weigh 0
    for (int i = begin; i < end; ++i) {
        const double z = static_cast<double>(to_float(row[i])) * inv_temperature;
        if (!(z > -INFINITY)) continue;
        if (z > m) {
            s = s * exp(m - z) + 1.0;
            m = z;
        } else {
            s += exp(z - m);
        }
    }
    // The row's maximum.
    double x = m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(kFullMask, x, o));
    if (lane == 0) warp_max[warp] = x;
    __syncthreads();
    if (t == 0) {
        double v = warp_max[0];
        for (int w = 1; w < kSampleWarps; ++w) v = fmax(v, warp_max[w]);
        row_max = v;
    }
    __syncthreads();
    const double M = row_max;
    const double c = s > 0 ? s * exp(m - M) : 0.0;  // the chunk's mass in the row's units
    // Inclusive scan of the chunks' masses in thread order, and the last thread with any mass.
    double inc = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(kFullMask, inc, o);
        if (lane >= o) inc += y;
    }
    int last = c > 0 ? t : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(kFullMask, last, o));
    if (lane == 31) warp_sum[warp] = inc;
    if (lane == 0) warp_last[warp] = last;
    __syncthreads();
    if (t == 0) {
        double acc = 0;
        int l = -1;
        for (int w = 0; w < kSampleWarps; ++w) {
            const double v = warp_sum[w];
            warp_sum[w] = acc;  // exclusive: the mass of the warps before
            acc += v;
            l = max(l, warp_last[w]);
        }
        row_max = acc;  // now the row's mass
        last_thread = l;
    }
    __syncthreads();
    // This chunk's interval [before, upto) of the row's running mass: upto of the thread before it
    // is its before, so the intervals tile [0, total) with no gap or overlap whatever the rounding.
    const double total = row_max, upto = warp_sum[warp] + inc;
    double before = __shfl_up_sync(kFullMask, upto, 1);
    if (lane == 0) before = warp_sum[warp];
    if (last_thread < 0) {  // no finite logit: the first token, log-prob -inf
        if (t == 0) out[b] = 0, out[gridDim.x + b] = -INFINITY;
        return;
    }
    const double target = uniforms[b] * total;
    const bool mine = c > 0 && before <= target && (target < upto || t == last_thread);
    if (!mine) return;
    // The first token whose running mass exceeds the target (rounding aside: this chunk's last token
    // with any mass).
    double acc = before;
    int pick = -1;
    double pick_z = 0;
    for (int i = begin; i < end; ++i) {
        const double z = static_cast<double>(to_float(row[i])) * inv_temperature;
        if (!(z > -INFINITY)) continue;
        const double p = exp(z - M);
        if (p <= 0) continue;
        pick = i, pick_z = z;
        if ((acc += p) > target) break;
    }
    out[b] = static_cast<double>(pick);
    out[gridDim.x + b] = pick_z - M - log(total);
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
