// One rank of a rollout engine over processes, started by rollout_processes_test with torchrun's
// environment (RANK, WORLD_SIZE, MASTER_PORT). Rank 0 generates a fixed set of requests greedily
// on an engine of 12 sequences in all (12 / WORLD_SIZE a rank): some resumed from a partial
// trajectory, the weights reloaded after 3 steps, then 3 more requests preempted by drain() after
// 2 steps and resumed. It writes OUT/results.json: each request's tokens, log-probs, versions and
// routing.
//   rl_rollout_rank OUT TRANSPORT
// MOERL_TEST_DEVICE=cuda generates on the GPU (fp32), MOERL_TEST_GRAPHS=0 there launching every
// decode kernel instead of replaying CUDA graphs; MOERL_TEST_COLLECTIVES picks how rank 0's
// calls travel (RoleProcesses::collectives). MOERL_TEST_DIE=1: rank 1 exits when asked
// to load the new weights, and rank 0 writes OUT/failure.json instead (what each call said next).
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/rollout.hpp"
#include "rank_launcher.hpp"
#include "rl_test_util.hpp"

using namespace moerl;
using namespace moerl::rl;

int main(int argc, char** argv) {
    if (argc != 3) {
        std::cerr << "usage: rl_rollout_rank OUT TRANSPORT\n";
        return 2;
    }
    try {
        const std::filesystem::path out = argv[1];
        const RoleProcesses p = test::processes_from_environment(argv[2], 20);
        const int W = p.world_size;
        const bool die = std::getenv("MOERL_TEST_DIE") != nullptr;

        const RunConfig c = test::small_config(out);
        const int max_batch = 12 / W, max_seq_len = 32;
        model::ModelOptions mo;
        if (const char* device = std::getenv("MOERL_TEST_DEVICE"); device && std::string(device) == "cuda")
            mo.device = at::Device(at::kCUDA, 0);
        std::unique_ptr<ep::C10dStore> ep_store;
        std::unique_ptr<ep::Buffer> buffer;
        if (W > 1) {
            ep_store = std::make_unique<ep::C10dStore>(c10::make_intrusive<c10d::PrefixStore>("ep", p.store));
            ep::Config ec = model::ep_config_for(c.model, at::kFloat, W, p.rank, max_batch * max_seq_len);
            ec.set_transport(p.ep_transport);
            if (mo.device.is_cuda()) ec.device = 0;
            ec.job_id = "rollout-test";
            ec.timeout_s = p.timeout_s;
            buffer = std::make_unique<ep::Buffer>(ec, ep_store.get());
            mo.ep = buffer.get();
        }
        model::MoeModel m(c.model, mo);
        m.init_random(7);
        SamplingParams greedy = c.sampling;
        greedy.top_k = 1;
        const char* graphs = std::getenv("MOERL_TEST_GRAPHS");
        RolloutEngine engine(m, greedy,
                             {.max_batch = max_batch,
                              .record_routing = true,
                              .max_seq_len = max_seq_len,
                              .processes = W > 1 ? &p : nullptr,
                              .cuda_graphs = graphs == nullptr || std::string(graphs) != "0"});
        if (p.rank > 0) {
            engine.follow([&](const std::string& seed) {
                if (die && p.rank == 1) _exit(9);
                m.init_random(std::stoull(seed));
                return int64_t{0};
            });
            return 0;  // the engine, then the buffers go, in rank 0's order (their teardown is collective)
        }

        const int V = c.model.vocab_size;
        auto request = [&](uint64_t id) {
            GenRequest r;
            r.id = id;
            for (uint64_t i = 0; i <= id % 6; ++i)
                r.prompt.push_back(static_cast<int>(1 + (id * 5 + i * 3) % (V - 1)));
            r.seed = 100 + id;
            r.max_new_tokens = 4 + static_cast<int>(id % 9);
            if (id == 2) {  // resumed: two tokens generated before
                r.prefix.tokens = {3, 4};
                r.prefix.logprobs = {-1.0f, -1.5f};
                r.prefix.versions = {0, 0};
            }
            return r;
        };
        nlohmann::json results = nlohmann::json::object();
        auto keep = [&](std::vector<GenResult> done) {
            for (GenResult& d : done)
                results[std::to_string(d.id)] = {{"tokens", d.trajectory.tokens},
                                                 {"logprobs", d.trajectory.logprobs},
                                                 {"versions", d.trajectory.versions},
                                                 {"routing", d.trajectory.routing},
                                                 {"terminated", d.trajectory.terminated}};
        };
        for (uint64_t id = 0; id < 7; ++id) engine.add(request(id));
        for (int s = 0; s < 3; ++s) keep(engine.step(0));
        m.init_random(8);
        if (die) {
            nlohmann::json f;
            try {
                engine.refresh_weights("8");
            } catch (const std::exception& e) {
                f["refresh_error"] = e.what();
            }
            f["healthy"] = engine.healthy();
            try {
                engine.step(1);
            } catch (const std::exception& e) {
                f["step_error"] = e.what();
            }
            engine.add(request(20));
            f["drained"] = engine.drain().size();
            std::ofstream(out / "failure.json") << f.dump(1);
            (void)buffer.release();  // its teardown is collective: rank 1 would never answer
            return 0;
        }
        engine.refresh_weights("8");
        keep(engine.run_to_completion(1));
        for (uint64_t id = 7; id < 10; ++id) engine.add(request(id));
        for (int s = 0; s < 2; ++s) keep(engine.step(1));
        for (GenResult& r : engine.drain()) {  // preempted: resumed from the partial trajectory
            GenRequest again = request(r.id);
            again.id = r.id + 100;
            again.prefix = r.trajectory;
            engine.add(std::move(again));
        }
        keep(engine.run_to_completion(1));
        nlohmann::json summary = {
            {"results", results}, {"tokens", engine.tokens_generated()}, {"capacity", engine.capacity()}};
        std::ofstream(out / "results.json") << summary.dump(1);
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "rank " << std::getenv("RANK") << ": " << e.what() << "\n";
        return 1;
    }
}
