// Transport's default wait: spin briefly, then yield, until the deadline.
#include "moerl/ep/transport.hpp"

#include <thread>

#include "moerl/core/error.hpp"

namespace moerl::ep {

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
