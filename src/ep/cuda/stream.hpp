// The CUDA stream the cuda and nccl EP engines enqueue their work on.
//
// The Buffer API takes no stream argument. Device engines use the calling thread's current EP stream,
// which is the legacy default stream (0) unless set_stream() chose another: the model layer sets
// torch's current stream here before a dispatch; a CUDA-graph capture sets the capturing stream.
// While that stream is capturing, the engines enqueue work only (no host synchronisation): see
// cuda_engine.cpp for which calls can be captured.
#pragma once

#include <cuda_runtime.h>

namespace moerl::ep::cuda {

// Sets the calling thread's EP stream (0 = the legacy default stream).
void set_stream(cudaStream_t stream);
cudaStream_t current_stream();

// Sets the stream for one scope and restores the previous one.
class StreamGuard {
  public:
    explicit StreamGuard(cudaStream_t stream) : previous_(current_stream()) { set_stream(stream); }
    ~StreamGuard() { set_stream(previous_); }
    StreamGuard(const StreamGuard&) = delete;
    StreamGuard& operator=(const StreamGuard&) = delete;

  private:
    cudaStream_t previous_;
};

}  // namespace moerl::ep::cuda
