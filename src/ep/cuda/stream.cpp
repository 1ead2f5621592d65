#include "stream.hpp"

namespace moerl::ep::cuda {

namespace {
thread_local cudaStream_t t_stream = nullptr;
}  // namespace

void set_stream(cudaStream_t stream) { t_stream = stream; }
cudaStream_t current_stream() { return t_stream; }

}  // namespace moerl::ep::cuda
