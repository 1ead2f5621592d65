// One of the two processes of rollout_processes_test's CUDA IPC case, sharing one GPU, with
// torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT).
//   rl_ipc_rank OUT
// Rank 0 is a trainer (bf16 on the GPU): one GRPO update, its checkpoint (OUT/saved) and its bf16
// weights as they are on the GPU (OUT/trainer-bf16.safetensors), then its CUDA IPC export
// (OUT/policy.json); it stays alive until rank 1 has copied, then exits. Rank 1 is a rollout model
// (bf16, other weights to start from): it copies the policy by CUDA IPC twice, compares its weights
// bit for bit with the trainer's and with a model loaded from the checkpoint, decodes greedily with
// both, copies once more after rank 0 has exited, and writes OUT/results.json.
#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cuda_ipc.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/process.hpp"
#include "moerl/model/generator.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/roles.hpp"
#include "moerl/rl/trainer.hpp"
#include "rank_launcher.hpp"
#include "rl_test_util.hpp"

using namespace moerl;
using namespace moerl::rl;
using namespace moerl::rl::detail;
namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& p) {
    std::ifstream in(p);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

void wait_key(const RoleProcesses& p, const std::string& key) {
    p.store->wait({key}, std::chrono::seconds(120));
}

int trainer(const RoleProcesses& p, const fs::path& out, RunConfig c) {
    PolicyTrainer trainer(c, (out / "work").string());
    const auto batch = test::synthetic_batch(
        c, [](int q, int g) { return 1 + (q + g) % 4; },
        [](const ExperienceRecord&, int q, int g, int j) { return 3 + (q * 5 + g + j) % 12; },
        [](int) { return -1.2f; }, [](int q, int g) { return ((q * 3 + g) % 4) / 3.0; });
    std::vector<double> rewards;
    for (const auto& e : batch) rewards.push_back(e.reward);
    trainer.update(batch, group_advantages(rewards, c.group_size));
    trainer.save_weights((out / "saved").string());
    std::vector<at::Tensor> keep;
    std::vector<model::TensorBytes> tensors;
    for (const auto& [name, t] : trainer.weights()) {
        keep.push_back(t.to(at::kCPU).contiguous());
        const at::Tensor& h = keep.back();
        tensors.push_back({name, model::StDType::kBF16,
                           std::vector<int64_t>(h.sizes().begin(), h.sizes().end()), h.data_ptr(),
                           static_cast<uint64_t>(h.nbytes())});
    }
    model::write_safetensors((out / "trainer-bf16.safetensors").string(), tensors);
    std::string why;
    const std::vector<std::string> parts = trainer.export_weights_ipc(why);
    if (parts.empty()) {
        std::cerr << "rank 0: no CUDA IPC export: " << why << "\n";
        return 1;
    }
    IpcPolicy policy;
    policy.version = 1;
    policy.publisher = "ipc-rank";
    policy.writes = trainer.weight_writes();
    for (const std::string& part : parts) policy.processes.push_back(ipc_process_from_json(part));
    std::ofstream(out / "policy.json") << ipc_policy_to_json(policy);
    p.store->set("exported", std::vector<uint8_t>{1});
    wait_key(p, "copied");  // the trainer's memory must outlive the copies
    return 0;
}

// Bit for bit: as 16-bit integers.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
           at::equal(a.contiguous().view(at::kShort).cpu(), b.contiguous().view(at::kShort).cpu());
}

int rollout(const RoleProcesses& p, const fs::path& out, const RunConfig& c) {
    wait_key(p, "exported");
    const IpcPolicy policy = ipc_policy_from_json(read_text(out / "policy.json"), "policy.json");
    model::ModelOptions o;
    o.device = at::Device(at::kCUDA, 0);
    o.dtype = at::kBFloat16;
    model::MoeModel synced(c.model, o);
    synced.init_random(99);
    nlohmann::json r;
    {
        IpcImporter reader(synced);
        r["bytes"] = reader.copy(policy);
        r["bytes_again"] = reader.copy(policy);  // the handles opened once
        r["open"] = reader.num_open();
        size_t allocations = 0;
        for (const IpcProcess& q : policy.processes) allocations += q.allocations.size();
        r["allocations"] = allocations;
        r["weight_bytes"] = synced.weight_bytes();

        model::SafetensorsFile theirs((out / "trainer-bf16.safetensors").string());
        model::MoeModel fresh(c.model, o);
        fresh.load_weights((out / "saved").string());
        const auto loaded = fresh.state_dict();
        int vs_trainer = 0, vs_checkpoint = 0, compared = 0;
        const auto mine = synced.state_dict();
        for (size_t i = 0; i < mine.size(); ++i) {
            const auto& [name, t] = mine[i];
            const model::TensorInfo* info = theirs.find(name);
            const at::Tensor host = t.to(at::kCPU).contiguous();
            if (info == nullptr || info->nbytes != static_cast<uint64_t>(host.nbytes()) ||
                std::memcmp(theirs.data(*info), host.data_ptr(), host.nbytes()) != 0)
                ++vs_trainer;
            if (loaded[i].first != name || !same_bits(t, loaded[i].second)) ++vs_checkpoint;
            ++compared;
        }
        r["compared"] = compared;
        r["differ_from_trainer"] = vs_trainer;
        r["differ_from_checkpoint"] = vs_checkpoint;
        if (model::Generator::available()) {
            model::Generator a(synced, {.max_batch = 4, .max_seq_len = 64});
            model::Generator b(fresh, {.max_batch = 4, .max_seq_len = 64});
            std::vector<std::vector<int64_t>> prompts;
            for (int i = 0; i < 3; ++i) {
                const TaskPayload t = make_task_payload(c, 1, i, 0);
                prompts.emplace_back(t.prompt_tokens.begin(), t.prompt_tokens.end());
            }
            std::vector<int> sa, sb;
            for (int i = 0; i < 3; ++i) sa.push_back(a.acquire()), sb.push_back(b.acquire());
            at::Tensor ta = a.prefill(sa, prompts).greedy, tb = b.prefill(sb, prompts).greedy;
            bool equal = true;
            for (int step = 0; step < 8 && equal; ++step) {
                equal = at::equal(ta.cpu(), tb.cpu());
                auto ra = a.decode(sa, ta), rb = b.decode(sb, tb);
                equal = equal && at::equal(ra.logits.cpu(), rb.logits.cpu());
                ta = ra.greedy;
                tb = rb.greedy;
            }
            r["decode_equal"] = equal;
        }
        p.store->set("copied", std::vector<uint8_t>{1});
        // The trainer gone: a copy names it instead of reading what is left of its memory.
        for (int i = 0; i < 600 && process_alive(static_cast<pid_t>(policy.processes[0].pid)); ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        try {
            reader.copy(policy);
        } catch (const Error& e) {
            r["dead_error"] = e.message();
        }
    }
    std::ofstream(out / "results.json") << r.dump(1);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: rl_ipc_rank OUT\n";
        return 2;
    }
    try {
        const fs::path out = argv[1];
        const RoleProcesses p = test::processes_from_environment("cuda", 120);
        RunConfig c = test::small_config(out);
        c.ep_ranks = 1;
        c.train_device = "cuda";
        c.train_dtype = "bf16";
        return p.rank == 0 ? trainer(p, out, c) : rollout(p, out, c);
    } catch (const std::exception& e) {
        std::cerr << "rank " << std::getenv("RANK") << ": " << e.what() << "\n";
        return 1;
    }
}
