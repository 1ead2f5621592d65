// The generation engine's entry points in a build without it (no LibTorch with CUDA, or no CUDA
// toolkit at configure time): each reports what the build lacks.
#include "moerl/core/error.hpp"
#include "moerl/model/adamw.hpp"
#include "moerl/model/generator.hpp"
#include "train_rows.hpp"

namespace moerl::model {

struct Generator::Impl {};

namespace {
[[noreturn]] void unavailable() {
    MOERL_FAIL(
        "Generator: this build has no CUDA generation engine (it needs LibTorch with CUDA and the CUDA "
        "toolkit at configure time)");
}
}  // namespace

at::Tensor sample_on_device(const at::Tensor&, const std::vector<double>&, double) { unavailable(); }
at::Tensor sample_on_device_async(const at::Tensor&, const at::Tensor&, double) { unavailable(); }
Generator::Generator(const MoeModel&, const GeneratorOptions&) { unavailable(); }
Generator::~Generator() = default;
bool Generator::available() { return false; }
int Generator::acquire() { unavailable(); }
void Generator::release(int) { unavailable(); }
int64_t Generator::length(int) const { unavailable(); }
int64_t Generator::free_blocks() const { unavailable(); }
bool Generator::step_fits(const std::vector<int>&) const { unavailable(); }
void Generator::queue_step(const std::vector<int>&, const at::Tensor&, const std::vector<double>&, double) {
    unavailable();
}
at::Tensor Generator::queued_tokens() const { unavailable(); }
DrawnStep Generator::collect_step() { unavailable(); }
int Generator::queued_steps() const { unavailable(); }
void Generator::wait_queued() { unavailable(); }
void Generator::drop_queued() { unavailable(); }
int64_t Generator::shared_blocks() const { unavailable(); }
int64_t Generator::release_memory() { unavailable(); }
void Generator::restore_memory() { unavailable(); }
int64_t Generator::cache_memory_bytes() const { unavailable(); }
int64_t Generator::weight_copy_bytes() const { unavailable(); }
int64_t Generator::kept_memory_bytes() const { unavailable(); }
GenerationStep Generator::prefill(const std::vector<int>&, const std::vector<std::vector<int64_t>>&) {
    unavailable();
}
void Generator::fork(int, int) { unavailable(); }
GenerationStep Generator::decode(const std::vector<int>&, const at::Tensor&) { unavailable(); }
void Generator::idle_step() { unavailable(); }
void Generator::refresh_weights() { unavailable(); }
GeneratorStats Generator::stats() const { unavailable(); }
std::vector<std::pair<std::string, double>> Generator::profile() const { unavailable(); }
void Generator::reset_stats() { unavailable(); }
int64_t Generator::dense_bytes_per_step(int) const { unavailable(); }
int64_t Generator::expert_bytes() const { unavailable(); }
int64_t Generator::kv_bytes_per_token() const { unavailable(); }

// No CUDA row kernels either: the trainer keeps its LibTorch compositions.
bool adamw_master_available() { return false; }
void adamw_master_step(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const AdamwStep&) {
    MOERL_FAIL("adamw_master_step: this build has no CUDA trainer kernels");
}
bool cuda_rows_serve(const at::Tensor&) { return false; }
at::Tensor cuda_rms_norm(const at::Tensor&, const at::Tensor&, double) {
    return at::Tensor();  // the caller composes the norm
}
at::Tensor cuda_weighted_swiglu(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    MOERL_FAIL("weighted_swiglu: this build has no CUDA row kernels");
}
at::Tensor cuda_rms_norm_rope(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              double) {
    return at::Tensor();  // the caller composes rms_norm and apply_rope
}
at::Tensor cuda_slot_sum(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&) {
    return at::Tensor();
}
void cuda_selected_logprob_rows(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                                const at::Tensor&) {
    MOERL_FAIL("selected_logprobs: this build has no CUDA row kernels");
}

}  // namespace moerl::model
