// Internal device helpers of the EP kernels: signals with acquire/release at system scope, waits that
// time out into the error word, warp-wide row copies and conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels.hpp"

namespace moerl::ep::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kFp8MaxDev = 448.0f;
constexpr int kFp8Cols = 128;

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

// Every block at the end of a receive kernel: the last block to finish releases the slots back to
// their senders and advances the channel's epoch.
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
    if (threadIdx.x == 0) {
        s.done[ch] = 0;
        s.epoch[ch] = epoch;
    }
    __threadfence_system();
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        add_release_sys(ready_flag(s, s.peers[r], ch, s.rank), 1);
}

__device__ __forceinline__ void report_bad_id(DeviceError* err, int t, int k, long long value) {
    if (atomicCAS(&err->bad_input, 0, 1) == 0) {
        err->bad_token = t;
        err->bad_k = k;
        err->bad_value = value;
    }
}

// Copies `bytes` with the widest access the alignment allows; the warp's lanes stride the row. Plain
// (coherent) loads: the source may be a slot a peer wrote during this kernel.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int bytes, int lane) {
    const uintptr_t align =
        reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
    if ((align & 15) == 0) {
        auto* d = static_cast<int4*>(dst);
        const auto* s = static_cast<const int4*>(src);
        const int n = bytes / 16;
        int i = lane;
        for (; i + 96 < n; i += 128) {  // four loads in flight per lane
            const int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i < n; i += 32) d[i] = s[i];
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

// Quantizes one bf16 row of H columns (H % 128 == 0) to e4m3 with one scale per 128 columns
// (amax / 448, 1 for an all-zero block). A half-warp covers one block: 16 lanes x 8 columns.
__device__ __forceinline__ void warp_quantize_row(uint8_t* q, float* scales, const __nv_bfloat16* src, int H,
                                                  int lane) {
    for (int c0 = 0; c0 < H; c0 += 2 * kFp8Cols) {
        const int col = c0 + lane * 8;
        const bool active = col < H;
        float v[8];
        if (active) {
            const int4 raw = __ldg(reinterpret_cast<const int4*>(src + col));
            const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(h[j]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = 0.0f;
        }
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
        for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
        const float scale = amax > 0.0f ? amax / kFp8MaxDev : 1.0f;
        if (active) {
            uint8_t out[8];
#pragma unroll
            for (int j = 0; j < 8; ++j)
                out[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[j] / scale, __NV_SATFINITE, __NV_E4M3));
            *reinterpret_cast<uint2*>(q + col) = *reinterpret_cast<const uint2*>(out);
            if ((lane & 15) == 0) scales[col / kFp8Cols] = scale;
        }
    }
}

// Writes the data part of a dispatched row: a copy, or e4m3 + scales with fp8 dispatch.
__device__ __forceinline__ void warp_write_row_data(uint8_t* row, const RowLayout& rl, const Routing& rt,
                                                    const void* x, int t, int lane) {
    const size_t x_row_bytes = static_cast<size_t>(rt.hidden) * (rt.dtype == 0 ? 4 : 2);
    const auto* src = static_cast<const uint8_t*>(x) + static_cast<size_t>(t) * x_row_bytes;
    if (rt.fp8)
        warp_quantize_row(row, reinterpret_cast<float*>(row + rl.scales_off),
                          reinterpret_cast<const __nv_bfloat16*>(src), rt.hidden, lane);
    else
        warp_copy(row, src, static_cast<int>(x_row_bytes), lane);
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

__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_warps() { return (gridDim.x * blockDim.x) >> 5; }

}  // namespace moerl::ep::cuda
