// The host side of the CUDA IPC weight handoff (src/rl/cuda_ipc.hpp): descriptions, the copy plan
// a rollout model takes from one, and the errors that name what is wrong. The copies themselves run
// on the GPU machine (rl_gpu_test, rollout_processes_test).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

#include "cuda_ipc.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/process.hpp"
#include "rl_test_util.hpp"

using namespace moerl;
using namespace moerl::rl;
using namespace moerl::rl::detail;

namespace {

std::string this_host() {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return name;
}

model::MoeModel small_model() {
    const RunConfig c = test::small_config("/tmp");
    return model::MoeModel(c.model, model::ModelOptions{});
}

// What `num_ranks` trainer ranks of `model`'s shape would export, each in a process of its own (this
// one's pid for rank 0), every weight in one allocation a rank, packed in order, in bf16.
IpcPolicy policy_of(const model::MoeModel& model, int num_ranks) {
    const int E = model.config().num_experts;
    IpcPolicy p;
    p.version = 3;
    p.publisher = "test";
    p.writes = 5;
    for (int r = 0; r < num_ranks; ++r) {
        IpcProcess q;
        q.host = this_host();
        q.pid = ::getpid();
        q.pid_namespace = pid_namespace();
        uint64_t offset = 0;
        for (const auto& w : model.named_parameters()) {
            std::vector<int64_t> shape(w.tensor.sizes().begin(), w.tensor.sizes().end());
            int first = -1;
            if (w.expert) {
                shape[0] = E / num_ranks;
                first = r * (E / num_ranks);
            }
            int64_t n = 1;
            for (int64_t d : shape) n *= d;
            q.tensors.push_back({w.name, r, 0, offset, shape, "bf16", first});
            offset += static_cast<uint64_t>(n) * 2;
        }
        q.allocations.push_back({std::string(128, 'a' + r), 0x1000000ull * (r + 1), offset});
        p.processes.push_back(q);
    }
    return p;
}

IpcTensor& tensor_named(IpcPolicy& p, size_t process, const std::string& name) {
    for (IpcTensor& t : p.processes[process].tensors)
        if (t.name == name) return t;
    ADD_FAILURE() << "no " << name;
    return p.processes[process].tensors.front();
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
    try {
        fn();
        ADD_FAILURE() << "no error; expected one saying " << parts.front();
    } catch (const Error& e) {
        for (const std::string& part : parts)
            EXPECT_NE(e.message().find(part), std::string::npos) << e.message();
    }
}

const char* kGate = "model.layers.0.mlp.experts.gate_proj";

}  // namespace

TEST(RlIpc, DescriptionsRoundTrip) {
    const model::MoeModel m = small_model();
    const IpcPolicy p = policy_of(m, 2);
    const IpcPolicy q = ipc_policy_from_json(ipc_policy_to_json(p), "policy.json");
    EXPECT_EQ(q.version, 3);
    EXPECT_EQ(q.publisher, "test");
    EXPECT_EQ(q.writes, 5);
    ASSERT_EQ(q.processes.size(), 2u);
    EXPECT_EQ(q.processes[1].allocations[0].handle, p.processes[1].allocations[0].handle);
    EXPECT_EQ(q.processes[1].allocations[0].base, p.processes[1].allocations[0].base);
    ASSERT_EQ(q.processes[1].tensors.size(), p.processes[1].tensors.size());
    EXPECT_EQ(q.processes[1].tensors[3].offset, p.processes[1].tensors[3].offset);
    EXPECT_EQ(q.processes[1].tensors[3].shape, p.processes[1].tensors[3].shape);
    const IpcProcess one = ipc_process_from_json(ipc_process_to_json(p.processes[0]));
    EXPECT_EQ(one.pid, ::getpid());
    EXPECT_EQ(one.tensors.back().name, p.processes[0].tensors.back().name);
    expect_error([] { ipc_policy_from_json("{\"version\": 1}", "/x/ipc-v1.json"); },
                 {"/x/ipc-v1.json", "not a CUDA IPC policy"});
}

// Dense weights once (from this process's rank), each expert stack from the two ranks holding half.
TEST(RlIpc, ThePlanTakesEveryWeightOnceAndEachExpertFromItsRank) {
    const model::MoeModel m = small_model();
    const IpcPolicy p = policy_of(m, 2);
    const std::vector<IpcCopy> plan = plan_ipc_copies(p, m);
    size_t dense = 0, stacks = 0;
    int64_t bytes = 0;
    for (const auto& w : m.named_parameters()) (w.expert ? stacks : dense) += 1;
    size_t gate_parts = 0;
    for (const IpcCopy& c : plan) {
        bytes += static_cast<int64_t>(c.bytes);
        EXPECT_EQ(c.src_dtype, at::kBFloat16);
        if (c.name != kGate) continue;
        ++gate_parts;
        // Experts 0-1 from rank 0, 2-3 from rank 1: each the rank's whole stack, into rows 0-1 / 2-3.
        const IpcTensor& src = tensor_named(const_cast<IpcPolicy&>(p), c.process, kGate);
        EXPECT_EQ(c.offset, src.offset);
        EXPECT_EQ(c.dst.size(0), 2);
        const at::Tensor whole = [&] {
            for (const auto& w : m.named_parameters())
                if (w.name == kGate) return w.tensor;
            return at::Tensor();
        }();
        EXPECT_EQ(static_cast<const char*>(c.dst.data_ptr()) - static_cast<const char*>(whole.data_ptr()),
                  static_cast<int64_t>(c.process * 2 * whole[0].numel() * whole.element_size()));
    }
    EXPECT_EQ(gate_parts, 2u);
    EXPECT_EQ(plan.size(), dense + 2 * stacks);
    EXPECT_EQ(bytes, m.weight_bytes() / 2) << "every weight once, in bf16";

    // Four trainer ranks of one expert each: a stack in four copies, the rows of each one expert.
    const IpcPolicy four = policy_of(m, 4);
    size_t parts = 0;
    for (const IpcCopy& c : plan_ipc_copies(four, m)) parts += c.name == kGate ? 1 : 0;
    EXPECT_EQ(parts, 4u);
}

TEST(RlIpc, APlanNamesWhatIsWrong) {
    const model::MoeModel m = small_model();
    {
        IpcPolicy p = policy_of(m, 2);
        for (IpcProcess& q : p.processes)
            std::erase_if(q.tensors, [](const IpcTensor& t) { return t.name == "model.norm.weight"; });
        expect_error([&] { plan_ipc_copies(p, m); },
                     {"cuda-ipc policy v3", "the trainer exported no weight model.norm.weight"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        tensor_named(p, 0, "model.embed_tokens.weight").shape[1] += 1;
        expect_error([&] { plan_ipc_copies(p, m); },
                     {"model.embed_tokens.weight is [", "in the trainer but [", "in the rollout model"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        tensor_named(p, 1, kGate).shape[2] += 1;
        expect_error([&] { plan_ipc_copies(p, m); }, {"the experts of ", kGate, "in the trainer but"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        std::erase_if(p.processes[1].tensors, [](const IpcTensor& t) { return t.name == kGate; });
        expect_error([&] { plan_ipc_copies(p, m); }, {"no trainer rank exported expert 2 of ", kGate});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        IpcTensor extra = p.processes[0].tensors.front();
        extra.name = "model.layers.9.mlp.gate.weight";
        p.processes[0].tensors.push_back(extra);
        expect_error(
            [&] { plan_ipc_copies(p, m); },
            {"the trainer's weight model.layers.9.mlp.gate.weight has no place in the rollout model"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        p.processes[0].allocations[0].bytes -= 2;  // its last weight, a dense one, read from rank 0
        expect_error([&] { plan_ipc_copies(p, m); }, {"of trainer rank 0 lies outside its allocation"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        tensor_named(p, 1, kGate).first_expert = 0;  // experts 0-1 twice, 2-3 nowhere
        expect_error([&] { plan_ipc_copies(p, m); }, {"expert 0 of ", "is exported by two trainer ranks"});
    }
    {
        IpcPolicy p = policy_of(m, 1);
        tensor_named(p, 0, "model.norm.weight").allocation = 4;
        expect_error([&] { ipc_policy_from_json(ipc_policy_to_json(p), "ipc-v3.json"); },
                     {"ipc-v3.json", "model.norm.weight of trainer rank 0 names allocation 4 of 1"});
        tensor_named(p, 0, "model.norm.weight").allocation = 0;
        tensor_named(p, 0, "model.norm.weight").dtype = "int8";
        expect_error([&] { ipc_policy_from_json(ipc_policy_to_json(p), "ipc-v3.json"); },
                     {"model.norm.weight: dtype 'int8'; expected bf16, fp16 or fp32"});
    }
}

// Trainer processes on another machine, in another PID namespace, or gone: named, before any
// handle is opened.
TEST(RlIpc, TrainerProcessesElsewhereOrGoneAreNamed) {
    const model::MoeModel m = small_model();
    {
        IpcPolicy p = policy_of(m, 2);
        p.processes[1].host = "elsewhere";
        expect_error([&] { check_ipc_processes(p); },
                     {"trainer rank 1 run on host elsewhere", "CUDA IPC needs one machine"});
    }
    {
        IpcPolicy p = policy_of(m, 2);
        p.processes[1].pid_namespace = "pid:[1]";
        expect_error([&] { check_ipc_processes(p); }, {"trainer rank 1 run in another PID namespace"});
    }
    {
        const pid_t child = ::fork();
        if (child == 0) ::_exit(0);
        int status = 0;
        ::waitpid(child, &status, 0);
        IpcPolicy p = policy_of(m, 2);
        p.processes[1].pid = child;
        expect_error([&] { check_ipc_processes(p); },
                     {"trainer rank 1 (pid " + std::to_string(child) + ") has exited"});
        IpcImporter reader(m);
        expect_error([&] { reader.copy(p); }, {"has exited"});
    }
    const IpcPolicy alive = policy_of(m, 2);
    EXPECT_NO_THROW(check_ipc_processes(alive));
}

// CPU weights take no CUDA IPC, on either side: the trainer's export and the rollout's copy say so.
TEST(RlIpc, CpuWeightsAreRefusedSayingWhy) {
    const model::MoeModel m = small_model();
    IpcExporter exporter;
    expect_error(
        [&] {
            exporter.export_weights({{0, 0, m.named_parameters()}});
        },
        {"the trainer's weight model.embed_tokens.weight is on the cpu, not on a CUDA device"});
    IpcImporter reader(m);
    expect_error([&] { reader.copy(policy_of(m, 2)); },
                 {"the rollout model is on the CPU; CUDA IPC copies into GPU weights only"});
    EXPECT_EQ(reader.num_open(), 0u);
}
