// Transport's defaults: a wait that spins briefly, then yields, until the deadline; copies for a
// region in host memory.
#include "moerl/ep/transport.hpp"

#include <cstring>
#include <thread>

#include "moerl/core/error.hpp"

namespace moerl::ep {

const char* region_memory_name(RegionMemory memory) {
    switch (memory) {
        case RegionMemory::kHost:
            return "host";
        case RegionMemory::kCuda:
            return "cuda";
        case RegionMemory::kHostAsDevice:
            return "host-as-device";
    }
    return "?";
}

namespace {

void check_region_range(const Transport& t, size_t offset, size_t bytes, const char* what) {
    MOERL_CHECK(offset <= t.region_bytes() && bytes <= t.region_bytes() - offset, t.name(), " ", what, ": [",
                offset, ", +", bytes, ") is outside the region of ", t.region_bytes(), " bytes");
}

}  // namespace

void Transport::copy_into_region(size_t offset, const void* src, size_t bytes) {
    check_region_range(*this, offset, bytes, "copy_into_region");
    if (bytes > 0) std::memcpy(region() + offset, src, bytes);
}

void Transport::copy_from_region(size_t offset, void* dst, size_t bytes) {
    check_region_range(*this, offset, bytes, "copy_from_region");
    if (bytes > 0) std::memcpy(dst, region() + offset, bytes);
}

void Transport::wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase) {
    int spins = 0;
    while (signals(channel, src) < target) {
        if (++spins < 1024) continue;
        if (Clock::now() > deadline) {
            throw TimeoutError(detail::concat("rank ", rank(), ": timed out in ", phase, " waiting for rank ",
                                              src, " (", name(), ", channel ", channel, ", have ",
                                              signals(channel, src), " of ", target, " signals)"),
                               __FILE__, __LINE__);
        }
        std::this_thread::yield();
    }
}

}  // namespace moerl::ep
