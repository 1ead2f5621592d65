// Internal: a kernel's side of a write queue (src/ep/write_queue.hpp): the protocol of HostProducer
// on the GPU, over the queue block mapped from pinned host memory (WriteProxy with
// QueueMemory::kCudaMapped, through device_view()). One thread of a block produces for its ring;
// the loads and stores that cross to the host are system-scope (ld.acquire.sys / st.release.sys),
// and the commands are written before the tail that publishes them.
#pragma once

#include <cstdint>

#include "../../write_queue.hpp"

namespace moerl::ep::proxy::device {

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A producer's position on its ring, kept by the producing thread (in registers or its block's
// shared memory) across calls: the first call reads it from the queue.
struct RingCursor {
    uint64_t next = 0;    // the tail this producer will publish next
    uint64_t quiets = 0;  // kQuiet commands queued
};

__device__ __forceinline__ RingCursor open_ring(const QueueView& q, int ring) {
    return {load_acquire_sys(&q.tail[ring].value), load_acquire_sys(&q.quiets_done[ring].value)};
}

// False when the proxy no longer runs commands: the kernel must give up (the host reports why).
__device__ __forceinline__ bool proxy_running(const QueueView& q) {
    return load_acquire_sys(&q.header->failed.value) == 0;
}

// Queues one command; false (nothing queued) when the proxy has stopped.
__device__ __forceinline__ bool push(const QueueView& q, int ring, RingCursor& cursor, const Command& c) {
    const uint64_t capacity = q.header->capacity;
    while (cursor.next - load_acquire_sys(&q.head[ring].value) >= capacity) {
        if (!proxy_running(q)) return false;
        __nanosleep(256);
    }
    Command* slot = q.slots + static_cast<size_t>(ring) * capacity + cursor.next % capacity;
    *slot = c;
    // The release orders the slot's stores before the tail, for the proxy thread that reads them.
    store_release_sys(&q.tail[ring].value, ++cursor.next);
    return true;
}

__device__ __forceinline__ bool push_write(const QueueView& q, int ring, RingCursor& cursor, int peer,
                                           uint64_t src_offset, uint64_t dst_offset, uint64_t bytes,
                                           int channel) {
    return push(q, ring, cursor,
                Command{kWrite, static_cast<uint32_t>(peer), static_cast<uint32_t>(channel), 0, src_offset,
                        dst_offset, bytes});
}

__device__ __forceinline__ bool push_signal(const QueueView& q, int ring, RingCursor& cursor, int peer,
                                            int channel) {
    return push(q, ring, cursor,
                Command{kSignal, static_cast<uint32_t>(peer), static_cast<uint32_t>(channel)});
}

// Returns once the writes queued on this ring have left the local region (it may be refilled).
__device__ __forceinline__ bool quiet(const QueueView& q, int ring, RingCursor& cursor) {
    if (!push(q, ring, cursor, Command{kQuiet})) return false;
    ++cursor.quiets;
    while (load_acquire_sys(&q.quiets_done[ring].value) < cursor.quiets) {
        if (!proxy_running(q)) return false;
        __nanosleep(256);
    }
    return true;
}

// Waits until rank `src` has signalled `channel` `target` times (the proxy's mirror of the
// transport's counter); false when the proxy stopped first.
__device__ __forceinline__ bool wait_signals(const QueueView& q, int src, int channel, uint64_t target) {
    const uint64_t* counter = q.signals + static_cast<size_t>(src) * kNumChannels + channel;
    while (load_acquire_sys(counter) < target) {
        if (!proxy_running(q)) return false;
        __nanosleep(256);
    }
    return true;
}

}  // namespace moerl::ep::proxy::device
