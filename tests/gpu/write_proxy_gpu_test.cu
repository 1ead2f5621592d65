// The write queues from a kernel (label gpu): GPU blocks queue writes, signals and quiets on their
// rings in mapped pinned memory, the proxy thread runs them on a one-rank host transport, and the
// blocks wait on the mirrored signals. Skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/kernels/write_queue_device.cuh"
#include "moerl/ep/transport.hpp"
#include "write_proxy.hpp"

namespace moerl::ep::proxy {
namespace {

using namespace std::chrono_literals;

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

constexpr int kBlocks = 4;
constexpr int kMessages = 24;
constexpr size_t kMessageBytes = 300;
constexpr size_t kSlot = kMessages * kMessageBytes;  // one block's messages, back to back

// Block b copies its send slot into its receive slot in kMessages writes on channel 1 + b, signals
// channel 8 + b, waits for its quiet, then for both counters; ok[b] = 1 when all of it worked.
__global__ void produce(QueueView q, int* ok) {
    if (threadIdx.x != 0) return;
    const int ring = blockIdx.x;
    device::RingCursor cursor = device::open_ring(q, ring);
    bool good = true;
    for (int m = 0; m < kMessages && good; ++m) {
        const uint64_t offset = static_cast<uint64_t>(m) * kMessageBytes;
        good = device::push_write(q, ring, cursor, 0, kBlocks * kSlot + ring * kSlot + offset,
                                  ring * kSlot + offset, kMessageBytes, 1 + ring);
    }
    good = good && device::push_signal(q, ring, cursor, 0, 8 + ring) && device::quiet(q, ring, cursor) &&
           device::wait_signals(q, 0, 1 + ring, kMessages) && device::wait_signals(q, 0, 8 + ring, 1);
    ok[ring] = good ? 1 : 0;
}

// Waits for a signal nobody sends: returns (ok = 0) once the proxy is stopped.
__global__ void wait_forever(QueueView q, int* ok) { *ok = device::wait_signals(q, 0, 3, 1) ? 1 : 0; }

std::unique_ptr<Transport> one_rank(size_t bytes) {
    TransportOptions o;
    o.region_bytes = bytes;
    o.job_id = "proxy-gpu-test";
    return make_transport("host", o);
}

TEST(WriteProxyGpu, KernelsQueueWritesAndWaitOnMirroredSignals) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    auto t = one_rank(2 * kBlocks * kSlot);
    std::vector<std::byte> host(2 * kBlocks * kSlot, std::byte{0});
    for (size_t i = 0; i < kBlocks * kSlot; ++i)
        host[kBlocks * kSlot + i] = std::byte(static_cast<uint8_t>(i * 7 + 3));
    t->copy_into_region(0, host.data(), host.size());
    WriteProxy proxy(*t, {.num_rings = kBlocks, .capacity = 8, .memory = QueueMemory::kCudaMapped});
    int* ok = nullptr;
    ASSERT_EQ(cudaMallocManaged(&ok, kBlocks * sizeof(int)), cudaSuccess);
    std::memset(ok, 0, kBlocks * sizeof(int));
    produce<<<kBlocks, 32>>>(proxy.device_view(), ok);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    proxy.check();
    for (int b = 0; b < kBlocks; ++b) EXPECT_EQ(ok[b], 1) << "block " << b;
    EXPECT_EQ(proxy.commands_run(), static_cast<uint64_t>(kBlocks) * (kMessages + 2));
    t->copy_from_region(0, host.data(), kBlocks * kSlot);
    for (size_t i = 0; i < kBlocks * kSlot; ++i)
        ASSERT_EQ(host[i], std::byte(static_cast<uint8_t>(i * 7 + 3))) << "byte " << i;
    cudaFree(ok);
}

TEST(WriteProxyGpu, AKernelWaitingOnAStoppedProxyReturns) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    auto t = one_rank(4096);
    WriteProxy proxy(*t, {.num_rings = 1, .capacity = 4, .memory = QueueMemory::kCudaMapped});
    int* ok = nullptr;
    ASSERT_EQ(cudaMallocManaged(&ok, sizeof(int)), cudaSuccess);
    *ok = 7;
    wait_forever<<<1, 1>>>(proxy.device_view(), ok);
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(cudaStreamQuery(nullptr), cudaErrorNotReady) << "the kernel did not wait";
    proxy.stop();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(*ok, 0);
    cudaFree(ok);
}

}  // namespace
}  // namespace moerl::ep::proxy
