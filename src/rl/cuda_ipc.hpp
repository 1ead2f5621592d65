// Trainer -> rollout weight handoff by CUDA IPC between the processes of one machine (roles.cpp).
// Each trainer process exports a handle on every allocation that holds its weights and the place
// of each weight in it (IpcProcess); the trainer publishes them with the version as a cuda-ipc://
// policy (IpcPolicy, a small JSON file). A rollout process opens each allocation once, copies
// device to device into its own weights (its experts only; dense weights from any trainer rank)
// and waits for the copies.
//
// Handles on the trainer's own allocations rather than one flat export buffer: a sync then costs
// one copy of the weight bytes and no memory beyond the weights, where a buffer costs a second
// copy and a second set of weights on every trainer GPU. The trainer updates its weights in place,
// so the handles are taken once; when a weight moves (a reallocation) the export takes new ones and
// readers open those, closing the ones no policy names any more.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "moerl/model/model.hpp"

namespace moerl::rl::detail {

// Whether this build can export and open CUDA IPC handles (compiled with the CUDA runtime).
bool cuda_ipc_compiled();

// One cudaMalloc allocation of a trainer process.
struct IpcAllocation {
    std::string handle;  // cudaIpcMemHandle_t, hex
    uint64_t base = 0;   // its address in the exporting process (a reader there uses it as it is)
    uint64_t bytes = 0;
};

// One weight of a trainer rank: contiguous, `offset` bytes into allocation `allocation` of its
// process. Expert stacks ("model.layers.N.mlp.experts.gate_proj" [L, I, H]) hold experts
// first_expert .. first_expert + L - 1; first_expert is -1 for dense weights.
struct IpcTensor {
    std::string name;
    int rank = 0;  // the trainer's EP rank
    int allocation = 0;
    uint64_t offset = 0;
    std::vector<int64_t> shape;
    std::string dtype;  // "bf16", "fp16" or "fp32"
    int first_expert = -1;
};

// What one trainer process exports.
struct IpcProcess {
    std::string host;
    int64_t pid = 0;
    std::string pid_namespace;  // pids compare only within one
    int device = 0;             // the CUDA device of its weights
    std::vector<IpcAllocation> allocations;
    std::vector<IpcTensor> tensors;
};

// A published policy version: the contents of a cuda-ipc:// policy file.
struct IpcPolicy {
    int64_t version = 0;
    std::string publisher;  // the trainer in the publishing process (roles.cpp's InProcessPolicies)
    int64_t writes = 0;     // PolicyTrainer::weight_writes() when exported
    std::vector<IpcProcess> processes;
};

std::string ipc_process_to_json(const IpcProcess& p);
IpcProcess ipc_process_from_json(const std::string& text);
std::string ipc_policy_to_json(const IpcPolicy& p);
// `what` names the text in errors (its file).
IpcPolicy ipc_policy_from_json(const std::string& text, const std::string& what);

// ---- trainer side ----
struct IpcSource {
    int rank = 0;          // the trainer's EP rank
    int first_expert = 0;  // of its expert stacks
    std::vector<model::NamedParameter> weights;
};

class IpcExporter {
  public:
    // Waits for the device's pending work (the update's writes), then describes `sources`, taking
    // the handles again only when a weight moved since the last call. Throws moerl::Error saying why
    // the weights cannot be exported (on the CPU, not contiguous, cudaIpcGetMemHandle failing, a
    // build without CUDA).
    IpcProcess export_weights(const std::vector<IpcSource>& sources);

  private:
    std::vector<const void*> pointers_;  // of the last export's weights, in order
    IpcProcess last_;
};

// ---- rollout side ----
// One copy into the rollout model: `bytes` from `offset` of allocation `allocation` of process
// `process` (src_dtype) into `dst` (a contiguous view of a rollout weight, its own dtype).
struct IpcCopy {
    std::string name;
    size_t process = 0;
    int allocation = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;  // source bytes
    at::ScalarType src_dtype = at::kFloat;
    at::Tensor dst;
};

// Rows of an expert stack holding experts first .. first + rows - 1, copied from the trainer rank
// (`source`, an index into the list given) that holds them.
struct ExpertRows {
    size_t source = 0;
    int64_t src_row = 0, dst_row = 0, rows = 0;
};
// Where the experts first .. first + L - 1 of `name` come from, given each trainer rank's stack as
// (first expert, experts): every one from exactly one rank. Throws, prefixed by `what`, naming an
// expert that no rank or two ranks hold.
std::vector<ExpertRows> expert_rows(int64_t first, int64_t L,
                                    const std::vector<std::pair<int64_t, int64_t>>& held,
                                    const std::string& what, const std::string& name);

// The copies that fill every weight of `model` from `policy`, checked on the host: every weight
// found (dense weights from a trainer rank of this process where there is one, else the first;
// each of the model's experts from the rank holding it), shapes equal, every trainer weight with a
// place in the model, every weight inside its allocation. Throws naming what is wrong.
std::vector<IpcCopy> plan_ipc_copies(const IpcPolicy& policy, const model::MoeModel& model);

// Every trainer process of `policy` runs on this machine, in this PID namespace, and is alive;
// throws naming the first that is not.
void check_ipc_processes(const IpcPolicy& policy);

// Copies published policies into one model (on a CUDA device). A handle may be opened only once
// in a process, so opened allocations are shared by every reader of the process, each opened on
// first use and closed when no reader's latest policy names it (the trainer reallocated) or the
// readers are gone.
class IpcImporter {
  public:
    explicit IpcImporter(const model::MoeModel& model) : model_(model) {}
    ~IpcImporter();
    IpcImporter(const IpcImporter&) = delete;
    IpcImporter& operator=(const IpcImporter&) = delete;

    // Checks the trainer processes and the plan, copies, and waits for the copies. Returns the
    // bytes written into the model.
    int64_t copy(const IpcPolicy& policy);
    // Allocations of other processes this reader holds open.
    size_t num_open() const { return held_.size(); }

  private:
    const model::MoeModel& model_;
    std::set<std::string> held_;  // handles
};

}  // namespace moerl::rl::detail
