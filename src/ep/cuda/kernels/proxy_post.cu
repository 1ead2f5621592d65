// The kernel that queues an exchange's writes on a write proxy (proxy_post.hpp).
#include "proxy_post.hpp"
#include "write_queue_device.cuh"

namespace moerl::ep::cuda {

namespace {

__global__ void post_writes_kernel(const PostWritesArgs a) {
    namespace dev = proxy::device;
    // The packing kernels before this one on the stream have finished; make their stores visible
    // to the proxy thread (and the NIC) before the commands that read them.
    __threadfence_system();
    dev::RingCursor cursor = dev::open_ring(a.queue, a.ring);
    for (int r = 0; r < a.world; ++r) {
        const PostedWrite& w = a.writes[r];
        if (!dev::push_write(a.queue, a.ring, cursor, r, w.src_offset, w.dst_offset, w.bytes, a.channel))
            return;  // the proxy stopped: the host reports why
    }
    dev::push(a.queue, a.ring, cursor, proxy::Command{proxy::kQuiet});
}

}  // namespace

void launch_post_writes(const PostWritesArgs& args, cudaStream_t stream) {
    post_writes_kernel<<<1, 1, 0, stream>>>(args);
}

}  // namespace moerl::ep::cuda
