// Layout kernels: per-rank and per-expert counts from topk_idx, validated on the device, and the
// normal-mode notify phase (counts written into every peer's count slot).
#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

// One block of kLayoutThreads; thread i handles token chunk+i.
__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(LayoutArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, K = rt.top_k, T = a.num_tokens;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    __shared__ int expert_count[kMaxExperts];
    __shared__ int warp_rank_count[kLayoutThreads / 32][kMaxRanks];  // per warp, then exclusive prefix
    __shared__ int rank_base[kMaxRanks];
    for (int i = tid; i < W * L; i += blockDim.x) expert_count[i] = 0;
    for (int i = tid; i < W; i += blockDim.x) rank_base[i] = 0;
    __syncthreads();

    for (int chunk = 0; chunk < T; chunk += kLayoutThreads) {
        const int t = chunk + tid;
        unsigned long long mask = 0;  // ranks token t goes to
        if (t < T) {
            for (int k0 = 0; k0 < K; k0 += 8) {
                long long ids[8];  // eight loads in flight
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    ids[j] = k0 + j < K ? a.topk_idx[static_cast<size_t>(t) * K + k0 + j] : -1;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const long long e = ids[j];
                    if (e < -1 || e >= rt.num_experts) {
                        if (a.sig.error != nullptr) report_bad_id(a.sig.error, t, k0 + j, e);
                        continue;
                    }
                    if (e < 0) continue;
                    atomicAdd(&expert_count[e], 1);
                    mask |= 1ull << (e / L);
                }
            }
        }
        for (int r = 0; r < W; ++r) {
            const unsigned b = __ballot_sync(kFullMask, (mask >> r) & 1);
            if (lane == 0) warp_rank_count[warp][r] = __popc(b);
        }
        __syncthreads();
        if (tid < W) {
            int run = rank_base[tid];
            for (int w = 0; w < kLayoutThreads / 32; ++w) {
                const int c = warp_rank_count[w][tid];
                warp_rank_count[w][tid] = run;
                run += c;
            }
            rank_base[tid] = run;
        }
        __syncthreads();
        for (int r = 0; r < W; ++r) {
            const bool in = (mask >> r) & 1;
            const unsigned b = __ballot_sync(kFullMask, in);
            if (t < T)
                a.send_pos[static_cast<size_t>(t) * W + r] =
                    in ? warp_rank_count[warp][r] + __popc(b & lanemask_lt()) : -1;
        }
        __syncthreads();
    }

    // send_summary [W, 1+L]
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int r = i / (1 + L), j = i % (1 + L);
        a.send_summary[i] = j == 0 ? rank_base[r] : expert_count[r * L + j - 1];
    }
    const Signals& s = a.sig;
    if (s.peers == nullptr) return;

    // Notify: summary for rank r -> r's count slot `rank`; then read every source's summary here.
    const unsigned long long epoch = current_epoch(s, kChCount);
    if (!block_wait_slots_free(s, kChCount, epoch)) return;
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int r = i / (1 + L), j = i % (1 + L);
        auto* slot = reinterpret_cast<int*>(s.peers[r] + a.count_offset + s.rank * a.count_slot_bytes);
        slot[j] = j == 0 ? rank_base[r] : expert_count[r * L + j - 1];
    }
    block_signal_data(s, kChCount);
    if (!block_wait_data(s, kChCount, epoch, 1)) return;
    const uint8_t* local = s.peers[s.rank] + a.count_offset;
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int src = i / (1 + L), j = i % (1 + L);
        a.recv_summary[i] = reinterpret_cast<const volatile int*>(local + src * a.count_slot_bytes)[j];
    }
    __syncthreads();
    if (tid == 0) {
        int run = 0;
        a.recv_src_offset[0] = 0;
        for (int src = 0; src < W; ++src) {
            run += a.recv_summary[src * (1 + L)];
            a.recv_src_offset[src + 1] = run;
        }
    }
    block_finish_recv(s, kChCount, epoch);
}

// One block; entries i = t*K + k in chunks of kLayoutThreads, the warps of a chunk take turns so that
// positions within an expert follow (t, k) order.
__global__ void __launch_bounds__(kLayoutThreads, 1) ll_layout_kernel(LLLayoutArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, K = rt.top_k;
    const int N = a.num_tokens * K;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    __shared__ int expert_count[kMaxExperts];
    for (int i = tid; i < W * L; i += blockDim.x) expert_count[i] = 0;
    __syncthreads();
    for (int chunk = 0; chunk < N; chunk += kLayoutThreads) {
        const int i = chunk + tid;
        int e = -1;
        if (i < N) {
            const long long v = a.topk_idx[i];
            if (v < -1 || v >= rt.num_experts) {
                report_bad_id(a.error, i / K, i % K, v);
            } else {
                e = static_cast<int>(v);
            }
            a.topk32[i] = e;
        }
        const unsigned same = __match_any_sync(kFullMask, e);
        const int leader = __ffs(same) - 1;
        int base = 0;
        for (int w = 0; w < kLayoutThreads / 32; ++w) {
            if (w == warp && lane == leader && e >= 0) {
                base = expert_count[e];
                expert_count[e] = base + __popc(same);
            }
            __syncthreads();
        }
        base = __shfl_sync(kFullMask, base, leader);
        if (i < N) a.pos_in_expert[i] = e >= 0 ? base + __popc(same & lanemask_lt()) : -1;
    }
    __syncthreads();
    for (int i = tid; i < W * L; i += blockDim.x) a.expert_count[i] = expert_count[i];
    if (tid < W) {
        int run = 0;
        for (int l = 0; l < L; ++l) {
            a.expert_offset[tid * L + l] = run;
            run += expert_count[tid * L + l];
        }
        a.send_rows[tid] = run;
    }
}

}  // namespace

void launch_layout(const LayoutArgs& a, cudaStream_t stream) {
    layout_kernel<<<1, kLayoutThreads, 0, stream>>>(a);
}

void launch_ll_layout(const LLLayoutArgs& a, cudaStream_t stream) {
    ll_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(a);
}

}  // namespace moerl::ep::cuda
