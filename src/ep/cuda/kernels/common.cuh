// Internal device helpers of the EP kernels: signals with acquire/release at system scope, waits that
// time out into the error word, warp-wide row copies and conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels.hpp"

namespace moerl::ep::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kFp8MaxDev = 448.0f;
constexpr int kFp8Cols = 128;

// Bytes of one row of x or y (hidden elements of the routing's dtype).
__host__ __device__ __forceinline__ size_t row_bytes_of(const Routing& rt) {
    return static_cast<size_t>(rt.hidden) * (rt.dtype == 0 ? 4 : 2);
}

// Calls launch(dtype, vec) with std::integral_constant / std::bool_constant tags for a runtime dtype
// (0 fp32, 1 bf16) and vec, so that a launcher instantiates kernel<kDType, kVec> through one switch.
template <typename Launch>
void with_dtype_and_vec(int dtype, bool vec, Launch&& launch) {
    if (dtype == 0) {
        if (vec)
            launch(std::integral_constant<int, 0>{}, std::true_type{});
        else
            launch(std::integral_constant<int, 0>{}, std::false_type{});
    } else {
        if (vec)
            launch(std::integral_constant<int, 1>{}, std::true_type{});
        else
            launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void add_release_sys(unsigned long long* p, unsigned long long v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// Flags in a rank's symmetric region: data[ch][src] then ready[ch][dst].
__device__ __forceinline__ unsigned long long* data_flag(const Signals& s, uint8_t* base, int ch, int src) {
    return reinterpret_cast<unsigned long long*>(base + s.flags_offset) + ch * s.world + src;
}
__device__ __forceinline__ unsigned long long* ready_flag(const Signals& s, uint8_t* base, int ch, int dst) {
    return reinterpret_cast<unsigned long long*>(base + s.flags_offset) +
           (kNumDeviceChannels + ch) * s.world + dst;
}

// The epoch of the call now running on channel ch (1-based).
__device__ __forceinline__ unsigned long long current_epoch(const Signals& s, int ch) {
    return s.peers == nullptr ? 0 : *reinterpret_cast<volatile unsigned long long*>(s.epoch + ch) + 1;
}

// Spins until *flag >= target; on timeout records (phase, peer) in the error word and returns false.
// Also gives up at once when another wait already failed, so one dead peer costs one timeout.
static __device__ __noinline__ bool wait_at_least(const Signals& s, const unsigned long long* flag,
                                                  unsigned long long target, int phase, int peer) {
    unsigned long long v = ld_acquire_sys(flag);
    if (v >= target) return true;
    const unsigned long long start = global_timer_ns();
    while (true) {
        v = ld_acquire_sys(flag);
        if (v >= target) return true;
        if (*reinterpret_cast<volatile int*>(&s.error->code) != 0) return false;
        if (global_timer_ns() - start > s.timeout_ns) {
            if (atomicCAS(&s.error->code, 0, kErrTimeout) == 0) {
                s.error->phase = phase;
                s.error->peer = peer;
                s.error->observed = v;
                s.error->target = target;
                __threadfence_system();
                if (s.error_mirror != nullptr) {  // the fields before the code the host tests
                    volatile DeviceError* m = s.error_mirror;
                    m->phase = phase;
                    m->peer = peer;
                    m->observed = v;
                    m->target = target;
                    __threadfence_system();
                    m->code = kErrTimeout;
                    __threadfence_system();
                }
            }
            return false;
        }
    }
}

// Every block of a send kernel: waits until each destination has released the slot this rank
// writes (call e-1 consumed). Returns false (uniformly) when a wait failed.
__device__ __forceinline__ bool block_wait_slots_free(const Signals& s, int ch, unsigned long long epoch) {
    if (s.peers == nullptr) return true;
    bool ok = true;
    uint8_t* local = s.peers[s.rank];
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        ok = ok && wait_at_least(s, ready_flag(s, local, ch, r), epoch - 1, ch * 2 + 1, r);
    return __syncthreads_and(ok);
}

// Every block of a send kernel, after its writes: one data signal to every destination.
__device__ __forceinline__ void block_signal_data(const Signals& s, int ch) {
    if (s.peers == nullptr) return;
    __threadfence_system();  // this thread's stores to peers become visible before the signal
    __syncthreads();
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        add_release_sys(data_flag(s, s.peers[r], ch, s.rank), 1);
}

// Every block of a receive kernel: waits until every source's send blocks have signalled.
__device__ __forceinline__ bool block_wait_data(const Signals& s, int ch, unsigned long long epoch,
                                                int send_blocks) {
    if (s.peers == nullptr) return true;
    bool ok = true;
    uint8_t* local = s.peers[s.rank];
    const unsigned long long target = epoch * static_cast<unsigned long long>(send_blocks);
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        ok = ok && wait_at_least(s, data_flag(s, local, ch, r), target, ch * 2, r);
    return __syncthreads_and(ok);
}

// The one block that read a channel's slots in this call, after its reads: releases the slots back to
// their senders and advances the channel's epoch.
__device__ __forceinline__ void block_release_slots(const Signals& s, int ch, unsigned long long epoch) {
    if (s.peers == nullptr) return;
    if (threadIdx.x == 0) {
        s.done[ch] = 0;
        s.epoch[ch] = epoch;
    }
    __threadfence_system();
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        add_release_sys(ready_flag(s, s.peers[r], ch, s.rank), 1);
}

// Every block at the end of a receive kernel: the last block to finish releases the slots.
__device__ __forceinline__ void block_finish_recv(const Signals& s, int ch, unsigned long long epoch) {
    if (s.peers == nullptr) return;
    __shared__ int is_last;
    __syncthreads();  // this block's reads of the slots are done
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(s.done + ch, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    block_release_slots(s, ch, epoch);
}

// Records the first out-of-range expert id in the error word and in its host-mapped mirror (if any).
__device__ __forceinline__ void report_bad_id(DeviceError* err, DeviceError* mirror, int t, int k,
                                              long long value) {
    if (atomicCAS(&err->bad_input, 0, 1) == 0) {
        err->bad_token = t;
        err->bad_k = k;
        err->bad_value = value;
        if (mirror != nullptr) {  // the fields before the flag the host tests
            volatile DeviceError* m = mirror;
            m->bad_token = t;
            m->bad_k = k;
            m->bad_value = value;
            __threadfence_system();
            m->bad_input = 1;
            __threadfence_system();
        }
    }
}

// Ids k0..k0+7 of token t's row of topk_idx [*, K], -1 past K (eight loads in flight).
__device__ __forceinline__ void load_ids(long long (&ids)[8], const int64_t* topk_idx, int t, int k0, int K) {
#pragma unroll
    for (int j = 0; j < 8; ++j) ids[j] = k0 + j < K ? topk_idx[static_cast<size_t>(t) * K + k0 + j] : -1;
}

// Calls on_expert(e) for each entry of token t's row of topk_idx [*, K] that names an expert in [0, E),
// eight loads in flight; -1 is skipped, any other id is reported (when err is set) and skipped. With
// use_first, `first` holds the row's first eight ids, loaded by the caller ahead of time (load_ids).
template <typename F>
__device__ __forceinline__ void for_each_routed_expert(const int64_t* topk_idx, int t, int K, int E,
                                                       DeviceError* err, DeviceError* mirror, F&& on_expert,
                                                       const long long (&first)[8], bool use_first) {
    for (int k0 = 0; k0 < K; k0 += 8) {
        long long ids[8];
        if (k0 == 0 && use_first) {
#pragma unroll
            for (int j = 0; j < 8; ++j) ids[j] = first[j];
        } else {
            load_ids(ids, topk_idx, t, k0, K);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long long e = ids[j];
            if (e < -1 || e >= E) {
                if (err != nullptr) report_bad_id(err, mirror, t, k0 + j, e);
                continue;
            }
            if (e >= 0) on_expert(static_cast<int>(e));
        }
    }
}
template <typename F>
__device__ __forceinline__ void for_each_routed_expert(const int64_t* topk_idx, int t, int K, int E,
                                                       DeviceError* err, DeviceError* mirror, F&& on_expert) {
    const long long none[8] = {};
    for_each_routed_expert(topk_idx, t, K, E, err, mirror, on_expert, none, false);
}

constexpr int kCopyUnroll = 8;  // 16-byte loads in flight per lane in the row copies

// v[u] = s[i0 + 32 u + lane] for the 16-byte units below `end` (zeros past it): kUnroll loads in flight.
template <int kUnroll>
__device__ __forceinline__ void load_units(int4 (&v)[kUnroll], const int4* s, int i0, int end, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * 32 + lane;
        v[u] = i < end ? s[i] : make_int4(0, 0, 0, 0);
    }
}

// d[i0 + 32 u + lane] = v[u] for the 16-byte units below `end` (the stores of load_units' loads).
template <int kUnroll>
__device__ __forceinline__ void store_units(int4* d, const int4 (&v)[kUnroll], int i0, int end, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * 32 + lane;
        if (i < end) d[i] = v[u];
    }
}

// Copies `bytes` with the widest access the alignment allows; the warp's lanes stride the row, each
// with kCopyUnroll loads in flight. Plain (coherent) loads: the source may be a slot a peer wrote
// during this kernel. No shuffles, so lanes of a warp may call it divergently.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int bytes, int lane) {
    const uintptr_t align =
        reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
    if ((align & 15) == 0) {
        auto* d = static_cast<int4*>(dst);
        const auto* s = static_cast<const int4*>(src);
        const int n = bytes / 16;
        for (int i0 = 0; i0 < n; i0 += 32 * kCopyUnroll) {
            int4 v[kCopyUnroll];
            load_units(v, s, i0, n, lane);
            store_units(d, v, i0, n, lane);
        }
    } else if ((align & 3) == 0) {
        auto* d = static_cast<int*>(dst);
        const auto* s = static_cast<const int*>(src);
        for (int i = lane; i < bytes / 4; i += 32) d[i] = s[i];
    } else {
        auto* d = static_cast<uint8_t*>(dst);
        const auto* s = static_cast<const uint8_t*>(src);
        for (int i = lane; i < bytes; i += 32) d[i] = s[i];
    }
}

// Copies `bytes` from src to the `dst` of every lane that passes one (lanes with dst == nullptr add
// none), reading src once. Warp-uniform call (shuffles).
__device__ __forceinline__ void warp_copy_fanout(uint8_t* dst, const void* src, int bytes, int lane) {
    const unsigned dests = __ballot_sync(kFullMask, dst != nullptr);
    if (dests == 0) return;
    const bool misaligned = dst != nullptr && (reinterpret_cast<uintptr_t>(dst) & 15) != 0;
    const bool vec = __ballot_sync(kFullMask, misaligned) == 0 &&
                     ((reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes)) & 15) == 0;
    if (!vec || __popc(dests) == 1) {
        for (unsigned m = dests; m != 0; m &= m - 1) {
            const int j = __ffs(m) - 1;
            auto* d = reinterpret_cast<uint8_t*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(dst), j));
            warp_copy(d, src, bytes, lane);
        }
        return;
    }
    const auto* s = static_cast<const int4*>(src);
    const int n = bytes / 16;
    for (int i0 = 0; i0 < n; i0 += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
        load_units(v, s, i0, n, lane);
        for (unsigned m = dests; m != 0; m &= m - 1) {
            const int j = __ffs(m) - 1;
            auto* d =
                reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(dst), j));
            store_units(d, v, i0, n, lane);
        }
    }
}

constexpr int kQuantUnroll = 4;  // pairs of 128-column blocks quantized per pass (loads in flight per lane)

// Quantizes kQuantUnroll pairs of 128-column blocks of a bf16 row to e4m3 in registers: pair u covers
// columns c0 + u * stride + [0, 256), lane l its 8 columns at + 8 l; a half-warp spans one block, whose
// scale is amax / 448 (1 for an all-zero block). All loads are issued before any arithmetic.
__device__ __forceinline__ void quantize_pairs(const __nv_bfloat16* src, int H, int c0, int stride, int lane,
                                               uint2 (&q)[kQuantUnroll], float (&scale)[kQuantUnroll]) {
    int4 raw[kQuantUnroll];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
        const int col = c0 + u * stride + lane * 8;
        raw[u] = col < H ? __ldg(reinterpret_cast<const int4*>(src + col)) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
        const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
        float v[8], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(h[j]), amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
        for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
        scale[u] = amax > 0.0f ? amax / kFp8MaxDev : 1.0f;
        uint8_t out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
            out[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[j] / scale[u], __NV_SATFINITE, __NV_E4M3));
        q[u] = *reinterpret_cast<const uint2*>(out);
    }
}

// Quantizes one bf16 row of H columns (H % 128 == 0) to e4m3 with one fp32 scale per 128 columns;
// scales may be null. part < parts: the warp takes every parts-th pair of blocks, starting at `part`.
__device__ __forceinline__ void warp_quantize_row(uint8_t* q, float* scales, const __nv_bfloat16* src, int H,
                                                  int lane, int part = 0, int parts = 1) {
    const int stride = parts * 2 * kFp8Cols;
    for (int c0 = part * 2 * kFp8Cols; c0 < H; c0 += kQuantUnroll * stride) {
        uint2 v[kQuantUnroll];
        float sc[kQuantUnroll];
        quantize_pairs(src, H, c0, stride, lane, v, sc);
#pragma unroll
        for (int u = 0; u < kQuantUnroll; ++u) {
            const int col = c0 + u * stride + lane * 8;
            if (col >= H) continue;
            *reinterpret_cast<uint2*>(q + col) = v[u];
            if (scales != nullptr && (lane & 15) == 0) scales[col / kFp8Cols] = sc[u];
        }
    }
}

// warp_quantize_row into the (q, scales) of every lane whose q is set, quantizing once. Warp-uniform.
__device__ __forceinline__ void warp_quantize_fanout(uint8_t* q, float* scales, const __nv_bfloat16* src,
                                                     int H, int lane) {
    const unsigned dests = __ballot_sync(kFullMask, q != nullptr);
    if (dests == 0) return;
    constexpr int stride = 2 * kFp8Cols;
    for (int c0 = 0; c0 < H; c0 += kQuantUnroll * stride) {
        uint2 v[kQuantUnroll];
        float sc[kQuantUnroll];
        quantize_pairs(src, H, c0, stride, lane, v, sc);
        for (unsigned m = dests; m != 0; m &= m - 1) {
            const int j = __ffs(m) - 1;
            auto* d = reinterpret_cast<uint8_t*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(q), j));
            auto* ds = reinterpret_cast<float*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(scales), j));
#pragma unroll
            for (int u = 0; u < kQuantUnroll; ++u) {
                const int col = c0 + u * stride + lane * 8;
                if (col >= H) continue;
                *reinterpret_cast<uint2*>(d + col) = v[u];
                if (ds != nullptr && (lane & 15) == 0) ds[col / kFp8Cols] = sc[u];
            }
        }
    }
}

// 16 bytes of fp32 or bf16 values, accumulated in fp32.
template <int kDType>
struct Vec16 {
    static constexpr int kElems = kDType == 0 ? 4 : 8;
    __device__ __forceinline__ static void add(float* acc, const int4& raw, float w) {
        if constexpr (kDType == 0) {
            const auto* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] += w * f[j];
        } else {
            const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += w * __bfloat162float(h[j]);
        }
    }
    __device__ __forceinline__ static int4 pack(const float* acc) {
        int4 out;
        if constexpr (kDType == 0) {
            auto* f = reinterpret_cast<float*>(&out);
#pragma unroll
            for (int j = 0; j < 4; ++j) f[j] = acc[j];
        } else {
            auto* h = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
            for (int j = 0; j < 8; ++j) h[j] = __float2bfloat16_rn(acc[j]);
        }
        return out;
    }
};

__device__ __forceinline__ float load_elem(const uint8_t* row, int j, int dtype) {
    return dtype == 0 ? reinterpret_cast<const float*>(row)[j]
                      : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[j]);
}
__device__ __forceinline__ void store_elem(uint8_t* row, int j, float v, int dtype) {
    if (dtype == 0)
        reinterpret_cast<float*>(row)[j] = v;
    else
        reinterpret_cast<__nv_bfloat16*>(row)[j] = __float2bfloat16_rn(v);
}

// The source rank of received row i: offsets [W+1]; lanes search in parallel, W <= 64.
__device__ __forceinline__ int warp_find_source(const int* offsets, int world, int i, int lane) {
    int found = -1;
    for (int base = 0; base < world; base += 32) {
        const int s = base + lane;
        const bool hit = s < world && offsets[s] <= i && i < offsets[s + 1];
        const unsigned m = __ballot_sync(kFullMask, hit);
        if (m != 0 && found < 0) found = base + __ffs(m) - 1;
    }
    return found;
}

// In-place exclusive scan of v[0..n) in shared memory by the whole block (blockDim.x a multiple of 32);
// v[n] receives the total, so v holds n + 1 entries. Every thread calls it; it ends with __syncthreads.
__device__ __forceinline__ void block_exclusive_scan(int* v, int n) {
    __shared__ int warp_prefix[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int lo = min(n, tid * per), hi = min(n, lo + per);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += v[i];
    int incl = sum;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(kFullMask, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) warp_prefix[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < warps ? warp_prefix[lane] : 0;
        int winc = w;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(kFullMask, winc, off);
            if (lane >= off) winc += y;
        }
        warp_prefix[lane] = winc - w;
    }
    __syncthreads();
    int run = warp_prefix[warp] + incl - sum;
    for (int i = lo; i < hi; ++i) {
        const int c = v[i];
        v[i] = run;
        run += c;
    }
    if (tid == blockDim.x - 1) v[n] = run;
    __syncthreads();
}

// The segment q of an exclusive scan v[0..n] (v[0] = 0 <= g < v[n]) that holds g: v[q] <= g < v[q+1].
__device__ __forceinline__ int scan_segment(const int* v, int n, int g) {
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (v[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_warps() { return (gridDim.x * blockDim.x) >> 5; }

// Sums, per 16-byte column group of one token, the rows of its sources in rank order (fp32
// accumulation) with kUnroll groups per lane in flight. Warp-uniform: row_of(r) shuffles.
template <int kDType, int kUnroll, typename RowOf>
__device__ __forceinline__ void warp_sum_rows_vec(uint8_t* out, int num_rows, const RowOf& row_of, int n,
                                                  int first_group, int group_step, int lane) {
    using V = Vec16<kDType>;
    for (int c0 = first_group * 32 * kUnroll; c0 < n; c0 += group_step * 32 * kUnroll) {
        float acc[kUnroll][V::kElems];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int j = 0; j < V::kElems; ++j) acc[u][j] = 0.0f;
        for (int r = 0; r < num_rows; ++r) {
            float w;
            const auto* row = reinterpret_cast<const int4*>(row_of(r, w));
            int4 v[kUnroll];
            load_units(v, row, c0, n, lane);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) V::add(acc[u], v[u], w);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int c = c0 + u * 32 + lane;
            if (c < n) reinterpret_cast<int4*>(out)[c] = V::pack(acc[u]);
        }
    }
}

// The scalar form of warp_sum_rows_vec (rows or strides not 16-byte aligned): one element per lane.
template <int kDType, typename RowOf>
__device__ __forceinline__ void warp_sum_rows_scalar(uint8_t* out, int num_rows, const RowOf& row_of, int H,
                                                     int first_group, int group_step, int lane) {
    for (int c0 = first_group * 32; c0 < H; c0 += group_step * 32) {
        const int c = c0 + lane;
        float acc = 0.0f;
        for (int r = 0; r < num_rows; ++r) {
            float w;
            const uint8_t* row = row_of(r, w);
            if (c < H) acc += w * load_elem(row, c, kDType);
        }
        if (c < H) store_elem(out, c, acc, kDType);
    }
}

// out = the weighted sum of num_rows rows (row_of), columns of part `part` of `parts`: 16-byte accesses
// with kVec, element by element otherwise. One row (nothing to sum across) takes more loads in flight.
template <int kDType, bool kVec, typename RowOf>
__device__ __forceinline__ void warp_sum_rows(uint8_t* out, int num_rows, const RowOf& row_of, int H,
                                              int part, int parts, int lane) {
    if constexpr (kVec) {
        const int n = H / Vec16<kDType>::kElems;
        if (num_rows <= 1)
            warp_sum_rows_vec<kDType, 8>(out, num_rows, row_of, n, part, parts, lane);
        else
            warp_sum_rows_vec<kDType, 4>(out, num_rows, row_of, n, part, parts, lane);
    } else {
        warp_sum_rows_scalar<kDType>(out, num_rows, row_of, H, part, parts, lane);
    }
}

// Warps per token when there are fewer tokens than warps: each takes a share of the column groups.
__device__ __forceinline__ int warps_per_token(int num_tokens, int num_groups) {
    const int per = num_tokens > 0 ? num_warps() / num_tokens : 1;
    return max(1, min(per, num_groups));
}

}  // namespace moerl::ep::cuda
