// One rank of the trainer over processes, started by trainer_processes_test with torchrun's
// environment: three GRPO updates of the small configuration on a fixed batch, a checkpoint
// (weights and optimizer) loaded again, and a fourth update.
//   rl_trainer_rank OUT TRANSPORT        (RANK, WORLD_SIZE, MASTER_PORT from the environment)
// Rank 0 writes OUT/stats.json (each update's loss, gradient norm, KL, clip fraction and token
// counts) and the checkpoint OUT/weights. MOERL_TEST_DEVICE=cuda trains on
// the GPU (fp32), MOERL_TEST_MICRO_TOKENS packs micro-batches, MOERL_TEST_COLLECTIVES picks the
// sums (RoleProcesses::collectives), MOERL_TEST_WIDE widens the model.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "moerl/rl/grpo.hpp"
#include "moerl/rl/trainer.hpp"
#include "rank_launcher.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;

int main(int argc, char** argv) {
    if (argc != 3) {
        std::cerr << "usage: rl_trainer_rank OUT TRANSPORT\n";
        return 2;
    }
    try {
        const std::filesystem::path out = argv[1];
        const std::string transport = argv[2];
        const RoleProcesses p = test::processes_from_environment(
            transport,
            std::getenv("MOERL_TEST_TIMEOUT_S") ? std::atof(std::getenv("MOERL_TEST_TIMEOUT_S")) : 60);

        RunConfig c = test::small_config(out);
        c.ep_ranks = p.world_size;
        c.grpo.kl_coef = 0.05;  // the reference model's forward too
        // The load-balancing loss is a mean per rank and micro-batch of a product of means, not a
        // sum over tokens: it depends on how the batch is split, so it is left out here.
        c.model.router_aux_loss_coef = 0;
        if (const char* device = std::getenv("MOERL_TEST_DEVICE")) c.train_device = device;  // fp32
        if (std::getenv("MOERL_TEST_WIDE")) {  // dense gradients of ~9 MB: sums of several store parts
            c.model.hidden_size = 512;
            c.model.num_attention_heads = c.model.num_key_value_heads = 8;
            c.model.head_dim = 64;
        }
        if (const char* micro = std::getenv("MOERL_TEST_MICRO_TOKENS")) {
            c.micro_batch_tokens = std::atoi(micro);
        }
        const auto batch = test::synthetic_batch(
            c, [](int q, int g) { return 1 + (q + 2 * g) % 5; },
            [](const ExperienceRecord&, int q, int g, int j) { return 3 + (q * 7 + g * 3 + j) % 12; },
            [](int j) { return -1.0f - 0.1f * static_cast<float>(j); },
            [](int q, int g) { return ((q + g) % 4) / 3.0; });
        std::vector<double> rewards;
        for (const auto& e : batch) rewards.push_back(e.reward);
        const std::vector<double> adv = group_advantages(rewards, c.group_size);

        PolicyTrainer trainer(c, (out / ("work" + std::to_string(p.rank))).string(), &p);
        const char* die = std::getenv("MOERL_TEST_DIE_RANK");
        if (die && std::atoi(die) == p.rank) _exit(9);  // joined, then gone: a killed rank
        if (p.rank != 0) {
            trainer.follow();
            return 0;
        }
        nlohmann::json steps = nlohmann::json::array();
        auto update = [&] {
            const TrainStats st = trainer.update(batch, adv);
            steps.push_back({{"loss", st.loss},
                             {"grad_norm", st.grad_norm},
                             {"kl", st.kl},
                             {"clip_fraction", st.clip_fraction},
                             {"aux_loss", st.aux_loss},
                             {"num_tokens", st.num_tokens},
                             {"total_tokens", st.total_tokens}});
        };
        for (int s = 0; s < 3; ++s) update();
        // A checkpoint, loaded again (a resume), and one more update from it.
        const std::string ckpt = (out / "weights").string();
        trainer.save_weights(ckpt);
        trainer.save_optimizer(ckpt);
        trainer.load(ckpt);
        update();
        std::ofstream(out / "stats.json") << steps.dump();
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "rank " << (std::getenv("RANK") ? std::getenv("RANK") : "?") << ": " << e.what() << "\n";
        return 1;
    }
}
