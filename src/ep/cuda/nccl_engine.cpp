// The nccl engine: the same contract over grouped ncclSend/ncclRecv, the baseline "stack without
// accelerated EP": a packed engine (packed_engine.hpp) whose exchanges are NCCL's. One GPU per rank.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "builtin.hpp"
#include "moerl/core/error.hpp"
#include "packed_engine.hpp"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define MOERL_NCCL_AVAILABLE 1
#endif

namespace moerl::ep {

#ifdef MOERL_NCCL_AVAILABLE

// MOERL_NCCL_CHECK(ncclSend(...)): throws moerl::Error with the call and NCCL's error string.
#define MOERL_NCCL_CHECK(call)                                                                              \
    do {                                                                                                    \
        const ncclResult_t moerl_nccl_res_ = (call);                                                        \
        if (moerl_nccl_res_ != ncclSuccess && moerl_nccl_res_ != ncclInProgress)                            \
            throw ::moerl::Error(                                                                           \
                ::moerl::detail::concat(#call, " failed: ", ncclGetErrorString(moerl_nccl_res_)), __FILE__, \
                __LINE__);                                                                                  \
    } while (0)

namespace {

using namespace cuda;

class NcclEngine final : public PackedEngine {
  public:
    NcclEngine(const Config& config, Store* store) : PackedEngine(config, store, "nccl") {
        const int W = c_.world_size;
        // One GPU per rank: NCCL refuses two ranks on one device, so say so before it does.
        char bus[64] = {};
        MOERL_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_));
        char host[256] = {};
        gethostname(host, sizeof(host) - 1);
        const std::string me = std::string(host) + "/" + bus;
        if (W > 1) {
            auto all = all_gather(*store_, c_.job_id + "/nccl/devices", c_.rank, W,
                                  std::vector<uint8_t>(me.begin(), me.end()), timeout_ms());
            for (int r = 0; r < W; ++r)
                MOERL_CHECK(r == c_.rank || std::string(all[r].begin(), all[r].end()) != me,
                            "the nccl EP engine needs one GPU per rank, but ranks ", std::min(r, c_.rank),
                            " and ", std::max(r, c_.rank), " both use GPU ", bus, " on ", host,
                            " (use the cuda transport to share a GPU)");
        }
        ncclUniqueId id;
        if (c_.rank == 0) MOERL_NCCL_CHECK(ncclGetUniqueId(&id));
        if (W > 1) {
            const std::string key = c_.job_id + "/nccl/id";
            if (c_.rank == 0) {
                store_->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                      reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
            } else {
                auto v = store_->get(key, timeout_ms());
                MOERL_CHECK(v.size() == sizeof(id), "nccl engine: bad unique id in the store");
                std::memcpy(&id, v.data(), sizeof(id));
            }
        }
        MOERL_NCCL_CHECK(ncclCommInitRank(&comm_, W, id, c_.rank));
        send_ = DeviceMemory(slot_bytes() * W);
        recv_ = DeviceMemory(slot_bytes() * W);
        summaries_ = DeviceMemory(summary_bytes());
        set_packing_memory(send_.get<uint8_t>(), recv_.get<uint8_t>(), summaries_.get<int>());
    }

    ~NcclEngine() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return "nccl"; }

    void destroy() override {
        if (comm_ == nullptr) return;
        cudaSetDevice(device_);
        cudaDeviceSynchronize();
        ncclCommDestroy(comm_);
        comm_ = nullptr;
    }

  private:
    void check_live(const char* what) const override {
        MOERL_CHECK(comm_ != nullptr, what, ": EP buffer used after destroy()");
    }

    // One grouped ncclSend/ncclRecv with every rank.
    void exchange(const std::vector<Messages>& messages, cudaStream_t stream,
                  const char* /*phase*/) override {
        MOERL_NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < c_.world_size; ++r) {
            const Messages& m = messages[r];
            MOERL_NCCL_CHECK(ncclSend(m.send, m.send_bytes, ncclUint8, r, comm_, stream));
            MOERL_NCCL_CHECK(ncclRecv(m.recv + r * m.recv_stride, m.recv_bytes, ncclUint8, r, comm_, stream));
        }
        MOERL_NCCL_CHECK(ncclGroupEnd());
    }

    // A dead peer leaves NCCL kernels spinning; an asynchronous error is reported at once.
    void check_progress(const char* /*phase*/) override {
        ncclResult_t async_err = ncclSuccess;
        MOERL_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async_err));
        MOERL_NCCL_CHECK(async_err);
    }

    std::string on_stream_timeout() override {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return "; the communicator was aborted";
    }

    ncclComm_t comm_ = nullptr;
    DeviceMemory send_, recv_, summaries_;
};

}  // namespace

std::unique_ptr<Engine> make_nccl_engine(const Config& config, Store* store) {
    return std::make_unique<NcclEngine>(config, store);
}

#else  // no nccl.h at build time

std::unique_ptr<Engine> make_nccl_engine(const Config&, Store*) {
    MOERL_FAIL("the nccl EP transport was built without NCCL (nccl.h not found); pass its include directory");
}

#endif

}  // namespace moerl::ep
