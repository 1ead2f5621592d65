// The reward model (scalar head over the last non-padding token) against a hand computation on
// MoeModel's hidden states, with left and right padding; checkpoint checks and their errors.
#include "moerl/model/reward_model.hpp"

#include <c10/core/GradMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "moerl/model/safetensors.hpp"

namespace moerl::model {
namespace {

using namespace test;
using ::testing::HasSubstr;

constexpr int64_t kPad = 5;

// The score of one unpadded sequence, by hand: the backbone's final hidden state at `last` times
// row `label` of score.weight.
double hand_score(const RewardModel& rm, const std::vector<int>& seq, int64_t last, int label = 0) {
    ForwardOptions fo;
    fo.return_logits = false;
    fo.compute_logprobs = false;
    fo.return_hidden = true;
    at::Tensor ids = at::tensor(std::vector<int64_t>(seq.begin(), seq.end()), at::kLong).unsqueeze(0);
    c10::NoGradGuard no_grad;
    at::Tensor h = rm.backbone().forward(ids, at::Tensor(), fo).hidden[0][last];
    return at::dot(h.to(at::kDouble), rm.score_weight()[label].to(at::kDouble)).item<double>();
}

std::vector<std::vector<int>> sequences() {
    return {{3, 17, 42, 8, 61, 9, 33}, {12, 7, 90, 4}, {44, 2, 71, kPad, kPad}, {kPad, 20, 30}};
}

void rewrite_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j;
    std::ifstream(dir + "/config.json") >> j;
    edit(j);
    std::ofstream(dir + "/config.json") << j.dump(2);
}

TEST(RewardModel, LastTokenIndexFollowsPadIdAndMask) {
    at::Tensor ids = at::tensor({1, 2, 0, 0, 0, 0, 3, 4, 5, 0, 0, 0}, at::kLong).view({3, 4});
    at::Tensor mask = ids.ne(0).to(at::kLong);
    EXPECT_TRUE(at::equal(last_token_index(ids, at::Tensor(), 0), at::tensor({1, 3, 0}, at::kLong)));
    EXPECT_TRUE(at::equal(last_token_index(ids, mask, std::nullopt), at::tensor({1, 3, 0}, at::kLong)));
    // Without a pad id and mask, the last column; a row that is all padding is scored at column 0.
    EXPECT_TRUE(
        at::equal(last_token_index(ids, at::Tensor(), std::nullopt), at::tensor({3, 3, 3}, at::kLong)));
    at::Tensor all_pad = at::full({1, 3}, 7, at::kLong);
    EXPECT_EQ(last_token_index(all_pad, at::Tensor(), 7).item<int64_t>(), 0);
}

TEST(RewardModel, ScoresMatchHandComputedForwardWithRightAndLeftPadding) {
    RewardModel rm(tiny_config(2, true), 1, 0, kPad, {});
    rm.init_random(11);
    const auto seqs = sequences();
    // The pad id decides the token: sequence 2 ends in two pad-id tokens and is scored at column 2.
    const std::vector<int64_t> last = {6, 3, 2, 2};
    std::vector<double> expected;
    for (size_t i = 0; i < seqs.size(); ++i) expected.push_back(hand_score(rm, seqs[i], last[i]));

    // Right padding (score() batches that way), batches of 3 and 1.
    std::vector<double> got = rm.score(seqs, 3);
    ASSERT_EQ(got.size(), seqs.size());
    int wrong = 0;
    for (size_t i = 0; i < seqs.size(); ++i) wrong += std::abs(got[i] - expected[i]) > 1e-5;
    EXPECT_EQ(wrong, 0) << got[0] << " vs " << expected[0];
    EXPECT_GT(std::abs(expected[0] - expected[1]), 1e-4);  // the sequences really score differently

    // Left padding, through logits() with an explicit mask.
    const int64_t B = static_cast<int64_t>(seqs.size()), S = 7;
    at::Tensor ids = at::full({B, S}, kPad, at::kLong), mask = at::zeros({B, S}, at::kLong);
    for (int64_t b = 0; b < B; ++b) {
        const auto& s = seqs[b];
        const int64_t off = S - static_cast<int64_t>(s.size());
        for (size_t t = 0; t < s.size(); ++t) {
            ids[b][off + static_cast<int64_t>(t)] = s[t];
            mask[b][off + static_cast<int64_t>(t)] = 1;
        }
    }
    at::Tensor logits = rm.logits(ids, mask);
    ASSERT_EQ(logits.sizes(), (at::IntArrayRef{B, 1}));
    wrong = 0;
    for (int64_t b = 0; b < B; ++b) wrong += std::abs(logits[b][0].item<double>() - expected[b]) > 1e-5;
    EXPECT_EQ(wrong, 0);

    // Without a pad token the mask alone ends each sequence: sequence 2 is scored at its last token.
    RewardModel no_pad(tiny_config(2, true), 1, 0, std::nullopt, {});
    no_pad.init_random(11);
    std::vector<double> plain = no_pad.score(seqs, 4);
    EXPECT_NEAR(plain[0], expected[0], 1e-5);
    EXPECT_NEAR(plain[2], hand_score(no_pad, seqs[2], 4), 1e-5);
    EXPECT_GT(std::abs(plain[2] - expected[2]), 1e-6);
}

TEST(RewardModel, SaveAndLoadRoundTrip) {
    TempDir dir("reward");
    RewardModel rm(tiny_config(), 1, 0, kPad, {});
    rm.init_random(3);
    rm.save_pretrained(dir.path, "float32");
    nlohmann::json j;
    std::ifstream(dir.path + "/config.json") >> j;
    EXPECT_EQ(j["architectures"][0], "Qwen3MoeForSequenceClassification");
    EXPECT_EQ(j["id2label"].size(), 1u);
    EXPECT_EQ(j["pad_token_id"], kPad);
    CheckpointReader reader(dir.path);
    EXPECT_FALSE(reader.contains("lm_head.weight"));
    EXPECT_EQ(reader.info("score.weight").shape, (std::vector<int64_t>{1, 32}));

    RewardModel back = RewardModel::from_pretrained(dir.path, {});
    EXPECT_EQ(back.pad_token_id(), kPad);
    const auto a = rm.score(sequences()), b = back.score(sequences());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_DOUBLE_EQ(a[i], b[i]);
}

TEST(RewardModel, ChoosesALabelAmongSeveral) {
    TempDir dir("reward3");
    RewardModel rm(tiny_config(), 3, 0, kPad, {});
    rm.init_random(4);
    rm.save_pretrained(dir.path, "float32");
    EXPECT_THAT(error_of([&] { RewardModel::from_pretrained(dir.path, {}); }),
                HasSubstr("has 3 labels; a reward is one of them: choose it with reward.label (0..2)"));
    EXPECT_THAT(error_of([&] { RewardModel::from_pretrained(dir.path, {}, 3); }),
                HasSubstr("reward label 3 is out of range"));
    RewardModel two = RewardModel::from_pretrained(dir.path, {}, 2);
    const auto seqs = sequences();
    EXPECT_NEAR(two.score(seqs)[0], hand_score(rm, seqs[0], 6, 2), 1e-5);
}

TEST(RewardModel, RefusesCheckpointsThatAreNoRewardModel) {
    // A causal LM (lm_head.weight present).
    TempDir lm("causal");
    MoeModel causal(tiny_config(), {});
    causal.save_pretrained(lm.path, 0, "float32");
    EXPECT_THAT(error_of([&] { inspect_reward_checkpoint(lm.path); }),
                HasSubstr("is a causal language model (lm_head.weight), not a reward model"));
    // A tied causal LM has no lm_head tensor: its architecture says what it is.
    TempDir tied("tied");
    ModelConfig tc = tiny_config();
    tc.tie_word_embeddings = true;
    MoeModel(tc, {}).save_pretrained(tied.path, 0, "float32");
    EXPECT_THAT(error_of([&] { inspect_reward_checkpoint(tied.path); }),
                HasSubstr("(architectures Qwen3MoeForCausalLM), not a reward model"));
    // A classification config without the head.
    rewrite_config(tied.path, [](nlohmann::json& j) {
        j["architectures"] = nlohmann::json::array({"Qwen3MoeForSequenceClassification"});
    });
    EXPECT_THAT(error_of([&] { inspect_reward_checkpoint(tied.path); }),
                HasSubstr("has no tensor score.weight (architectures: Qwen3MoeForSequenceClassification)"));
    // config.json without id2label: transformers would build 2 labels for a 1-row head.
    TempDir head("head");
    RewardModel rm(tiny_config(), 1, 0, std::nullopt, {});
    rm.save_pretrained(head.path, "float32");
    rewrite_config(head.path, [](nlohmann::json& j) {
        j.erase("id2label");
        j.erase("label2id");
    });
    EXPECT_THAT(error_of([&] { inspect_reward_checkpoint(head.path); }),
                HasSubstr("score.weight has 1 rows, but config.json declares 2 labels"));
    rewrite_config(head.path, [](nlohmann::json& j) { j["num_labels"] = 1; });
    EXPECT_EQ(inspect_reward_checkpoint(head.path).num_labels, 1);
    EXPECT_FALSE(inspect_reward_checkpoint(head.path).pad_token_id.has_value());
}

TEST(RewardModel, BackboneWithoutLmHeadRefusesLogits) {
    ModelOptions o;
    o.lm_head = false;
    MoeModel m(tiny_config(), o);
    for (const auto& p : m.named_parameters()) EXPECT_NE(p.name, "lm_head.weight");
    at::Tensor ids = at::ones({1, 3}, at::kLong);
    EXPECT_THAT(error_of([&] { m.forward(ids, at::Tensor()); }), HasSubstr("built without lm_head"));
}

}  // namespace
}  // namespace moerl::model
