#include "moerl/ep/config.hpp"

#include "moerl/core/error.hpp"

namespace moerl::ep {

namespace {
size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }
}  // namespace

void Config::validate() const {
    MOERL_CHECK(world_size >= 1 && world_size <= 1024, "Config.world_size = ", world_size,
                ", expected 1..1024");
    MOERL_CHECK(rank >= 0 && rank < world_size, "Config.rank = ", rank, ", expected 0..", world_size - 1);
    MOERL_CHECK(num_experts >= world_size, "Config.num_experts = ", num_experts, ", expected >= world_size (",
                world_size, ")");
    MOERL_CHECK(num_experts <= (1 << 20), "Config.num_experts = ", num_experts, ", expected <= 2^20");
    MOERL_CHECK((num_experts + num_local_experts() - 1) / num_local_experts() == world_size,
                "Config.num_experts = ", num_experts, " leaves a rank without experts at world_size ",
                world_size, " (", num_local_experts(), " per rank)");
    MOERL_CHECK(hidden >= 1, "Config.hidden = ", hidden, ", expected >= 1");
    MOERL_CHECK(top_k >= 1 && top_k <= 32, "Config.top_k = ", top_k, ", expected 1..32");
    MOERL_CHECK(max_tokens_per_rank >= 1, "Config.max_tokens_per_rank = ", max_tokens_per_rank,
                ", expected >= 1");
    MOERL_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16, "Config.dtype = ", dtype_name(dtype),
                ", expected fp32 or bf16 (fp8 is a dispatch option: fp8_dispatch)");
    if (fp8_dispatch) {
        MOERL_CHECK(dtype == DType::kBFloat16, "Config.fp8_dispatch needs dtype bf16, got ",
                    dtype_name(dtype));
        MOERL_CHECK(hidden % kFp8BlockCols == 0, "Config.hidden = ", hidden,
                    " must be a multiple of 128 with fp8_dispatch");
    }
    MOERL_CHECK(timeout_s > 0, "Config.timeout_s = ", timeout_s, ", expected > 0");
    MOERL_CHECK(num_sms >= 1 && num_sms <= 1024, "Config.num_sms = ", num_sms, ", expected 1..1024");
    MOERL_CHECK(device >= -1 && device <= 1023, "Config.device = ", device,
                ", expected -1 (MOERL_EP_DEVICE, LOCAL_RANK or the rank) or 0..1023");
    MOERL_CHECK(fabric_chunk_bytes >= 8, "Config.fabric_chunk_bytes = ", fabric_chunk_bytes,
                ", expected >= 8");
    MOERL_CHECK(!transport.empty(), "Config.transport is empty");
    MOERL_CHECK(!job_id.empty(), "Config.job_id is empty");
}

void Config::set_transport(const std::string& spec) {
    const auto slash = spec.find('/');
    transport = spec.substr(0, slash);
    if (slash != std::string::npos) fabric_provider = spec.substr(slash + 1);
    MOERL_CHECK(!transport.empty() && (slash == std::string::npos || !fabric_provider.empty()), "transport '",
                spec, "': expected NAME or NAME/PROVIDER (e.g. host, fabric/tcp)");
}

size_t Config::dispatch_row_bytes() const {
    size_t data = fp8_dispatch ? static_cast<size_t>(hidden) : hidden * element_bytes();
    size_t scales = fp8_dispatch ? (hidden / kFp8BlockCols) * sizeof(float) : 0;
    // data | scales | K int32 expert ids | K fp32 weights | int32 source token
    return align16(data + scales + top_k * (sizeof(int32_t) + sizeof(float)) + sizeof(int32_t));
}

size_t Config::combine_row_bytes() const { return align16(hidden * element_bytes()); }

size_t Config::normal_bytes_hint() const {
    const size_t slots = 2 * static_cast<size_t>(world_size);  // receive + send slot per peer
    const size_t counts = align16((1 + num_local_experts()) * sizeof(int32_t));
    return slots * (counts + max_tokens_per_rank * (dispatch_row_bytes() + combine_row_bytes()));
}

size_t Config::low_latency_bytes_hint() const {
    if (!low_latency) return 0;
    const size_t slots = 2 * static_cast<size_t>(world_size);
    const size_t rows = static_cast<size_t>(max_tokens_per_rank) * top_k;
    const size_t header = align16(num_local_experts() * sizeof(int32_t));
    return slots * (header + rows * (dispatch_row_bytes() + combine_row_bytes()));
}

}  // namespace moerl::ep
