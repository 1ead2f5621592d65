// Internal: the write queues between code that cannot call a transport (a GPU kernel) and the proxy
// thread that calls it for them (write_proxy.hpp). One queue ("ring") per producer: a fixed array
// of commands with a tail the producer advances and a head the proxy advances, in memory both can
// reach (host memory mapped into the GPU's address space for a kernel). The proxy mirrors the
// transport's signal counters into the same memory, so the producer waits on them there.
//
// Protocol, for a ring of `capacity` slots (one producer each, never shared):
//   producer: wait until tail - head < capacity; fill slot tail % capacity; store tail + 1 (release).
//   proxy:    load tail (acquire); run the slots from head to tail in order; store head (release).
//   quiet:    a kQuiet command; when the proxy has run it (the transport's quiet() returned), it adds
//             one to quiets_done of that ring: the producer waits for its count.
// The proxy stops at its first error and sets `failed` (kFailed; kStopped when it was stopped);
// producers waiting on anything see it and give up instead of waiting forever.
//
// The host producer is below; a CUDA kernel does the same with ld.acquire.sys / st.release.sys
// (write_queue_device.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moerl/ep/transport.hpp"

namespace moerl::ep::proxy {

enum CommandKind : uint32_t { kWrite = 1, kSignal = 2, kQuiet = 3 };

struct Command {
    uint32_t kind = 0;
    uint32_t peer = 0;
    uint32_t channel = 0;
    uint32_t unused = 0;
    uint64_t src_offset = 0;  // in the region, as Transport::write takes them
    uint64_t dst_offset = 0;
    uint64_t bytes = 0;
};
static_assert(sizeof(Command) == 40);

// A counter alone on its cache line: producer and proxy write different lines.
struct alignas(64) Counter {
    uint64_t value = 0;
};

constexpr uint32_t kQueueMagic = 0x6d6f5771;  // "moWq"

// QueueHeader::failed: the proxy runs (0), stopped on an error, or was stopped.
constexpr uint64_t kFailed = 1;
constexpr uint64_t kStopped = 2;

struct QueueHeader {
    uint32_t magic = kQueueMagic;
    uint32_t num_rings = 0;
    uint32_t capacity = 0;
    uint32_t num_signals = 0;  // world_size * kNumChannels: [src * kNumChannels + channel]
    Counter failed;            // kFailed or kStopped once the proxy no longer runs commands
};

// Where each part of a queue block lies, for one address space (the host's, or the GPU's view of
// the same mapped memory): [header][tail x R][head x R][quiets_done x R][signals][slots x R x C].
struct QueueView {
    QueueHeader* header = nullptr;
    Counter* tail = nullptr;
    Counter* head = nullptr;
    Counter* quiets_done = nullptr;
    uint64_t* signals = nullptr;
    Command* slots = nullptr;  // ring r's slot i at slots[r * capacity + i]

    static size_t bytes_for(uint32_t num_rings, uint32_t capacity, uint32_t num_signals);
    // The parts of a block of bytes_for(...) bytes at `base` (64-byte aligned).
    static QueueView at(void* base, uint32_t num_rings, uint32_t capacity, uint32_t num_signals);
};

// The host's side of the counters (GCC/Clang builtins: std::atomic_ref is C++20, and the CUDA
// sources that include this header may be compiled as C++17).
inline uint64_t load_acquire(const uint64_t& v) { return __atomic_load_n(&v, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t& v, uint64_t x) { __atomic_store_n(&v, x, __ATOMIC_RELEASE); }

class WriteProxy;

// One ring's producer on the host: what a kernel does, for CPU code and for the tests that stand in
// for a GPU. Not thread-safe: one thread per ring.
class HostProducer {
  public:
    HostProducer(const WriteProxy& proxy, int ring);

    void write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel);
    void signal(int peer, int channel);
    // Returns once every write queued on this ring so far has left the local region.
    void quiet(Clock::time_point deadline);
    uint64_t signals(int channel, int src) const;
    // Blocks until signals(channel, src) >= target; TimeoutError at the deadline, Error when the
    // proxy failed (with its message).
    void wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase) const;

  private:
    void push(const Command& c);
    void check_proxy() const;

    const WriteProxy& proxy_;
    QueueView q_;
    int ring_;
    uint64_t next_ = 0;    // this producer's tail
    uint64_t quiets_ = 0;  // kQuiet commands queued
    int world_size_ = 0;
};

}  // namespace moerl::ep::proxy
