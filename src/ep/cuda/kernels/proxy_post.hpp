// Internal: the kernel that hands an exchange's writes to a write proxy (src/ep/write_proxy.hpp). It
// runs on the stream right after the kernels that pack the rows, so the NIC is told to move them the
// moment they are ready, with no host synchronisation in between: one thread queues a write per peer
// (its data and, on arrival, one signal on `channel` at the peer), then a quiet, on one ring.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../write_queue.hpp"
#include "kernels.hpp"

namespace moerl::ep::cuda {

struct PostedWrite {
    uint64_t src_offset;  // in this rank's region
    uint64_t dst_offset;  // in the peer's region
    uint64_t bytes;       // 0: the signal alone
};

struct PostWritesArgs {
    proxy::QueueView queue;  // the device's view of the proxy's queues
    int ring;                // produced by this kernel only, one launch at a time
    int channel;
    int world;
    PostedWrite writes[kMaxRanks];  // [world]: writes[r] goes to rank r
};

// Queues world writes and one quiet on args.ring: world + 1 commands, for which the ring must have
// room (the caller waited for the previous quiet, so the ring is empty).
void launch_post_writes(const PostWritesArgs& args, cudaStream_t stream);

}  // namespace moerl::ep::cuda
