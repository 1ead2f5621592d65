// Tokenizer, tasks and verifiers, sampling, experience records, config errors, and the rollout
// engine on a CUDA device against the CPU.
#include "moerl/rl/env.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "group_admission.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/generator.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/metrics.hpp"
#include "moerl/rl/roles.hpp"
#include "moerl/rl/rollout.hpp"

using namespace moerl::rl;

TEST(Tokenizer, RoundTripAndErrors) {
    const auto& t = Tokenizer::get();
    auto ids = t.encode("s312=");
    EXPECT_EQ(t.decode(ids), "s312=");
    ids.push_back(Tokenizer::kEos);
    ids.push_back(t.encode("9")[0]);
    EXPECT_EQ(t.decode(ids), "s312=");  // stops at eos
    EXPECT_THROW(t.encode("x"), moerl::Error);
}

TEST(Tasks, SortAndAddVerify) {
    TaskSpec s;
    s.kind = "sort";
    s.length = 4;
    auto sort = make_task_generator(s);
    Problem p = sort->make(7);
    EXPECT_EQ(p.prompt.size(), 6u);
    EXPECT_TRUE(std::is_sorted(p.answer.begin(), p.answer.end()));
    EXPECT_EQ(sort->make(7).prompt, p.prompt);  // deterministic
    EXPECT_DOUBLE_EQ(sort->verify(p, p.answer, true), 1.0);
    EXPECT_LT(sort->verify(p, p.answer, false), 1.0);  // no eos
    Problem q{"sort", "s3142=", "1234"};
    // length 0.2 + all digits present 0.3 + 2 of 4 positions 0.25
    EXPECT_NEAR(sort->verify(q, "1243", true), 0.75, 1e-12);
    EXPECT_NEAR(sort->verify(q, "1243", false), 0.5 * (0.3 + 0.25),
                1e-12);                                            // no eos: no length credit, halved
    EXPECT_NEAR(sort->verify(q, "12", true), 0.15 + 0.25, 1e-12);  // wrong length
    EXPECT_DOUBLE_EQ(sort->verify(q, "", true), 0.0);

    TaskSpec a;
    a.kind = "add";
    a.digits = 2;
    a.partial_credit = false;
    auto add = make_task_generator(a);
    Problem r = add->make(3);
    auto plus = r.prompt.find('+');
    int x = std::stoi(r.prompt.substr(0, plus)), y = std::stoi(r.prompt.substr(plus + 1));
    EXPECT_EQ(r.answer, std::to_string(x + y));
    EXPECT_DOUBLE_EQ(add->verify(r, r.answer, true), 1.0);
    EXPECT_DOUBLE_EQ(add->verify(r, r.answer + "1", true), 0.0);
}

// Straightforward per-row sampling (sort, truncate, walk the cumulative mass; untruncated, walk it in
// vocabulary order) to check the batched one.
std::pair<int, double> reference_sample(const std::vector<float>& logits, const SamplingParams& p, double u) {
    const int V = static_cast<int>(logits.size());
    std::vector<double> z(V);
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; ++i) mx = std::max(mx, z[i] = logits[i] / p.temperature);
    for (int i = 0; i < V; ++i) sum += std::exp(z[i] - mx);
    const double log_norm = mx + std::log(sum);
    if ((p.top_k <= 0 || p.top_k >= V) && p.top_p >= 1.0) {  // untruncated: in vocabulary order
        double total = 0, acc = 0;
        for (int i = 0; i < V; ++i) total += std::exp(z[i] - log_norm);
        for (int i = 0; i < V; ++i)
            if (u * total < (acc += std::exp(z[i] - log_norm))) return {i, z[i] - log_norm};
        return {V - 1, z[V - 1] - log_norm};
    }
    std::vector<int> order(V);
    for (int i = 0; i < V; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    int keep = p.top_k > 0 ? std::min(p.top_k, V) : V;
    double mass = 0;
    for (int i = 0; i < keep && p.top_p < 1.0; ++i)
        if ((mass += std::exp(z[order[i]] - log_norm)) >= p.top_p) keep = i + 1;
    double kept = 0, acc = 0;
    for (int i = 0; i < keep; ++i) kept += std::exp(z[order[i]] - log_norm);
    for (int i = 0; i < keep; ++i)
        if (u * kept < (acc += std::exp(z[order[i]] - log_norm))) return {order[i], z[order[i]] - log_norm};
    return {order[keep - 1], z[order[keep - 1]] - log_norm};
}

// Batched sampling equals the per-row reference: random logits, draws and parameters.
TEST(Sampling, BatchedEqualsPerRow) {
    std::mt19937 rng(3);
    std::normal_distribution<float> logit(0.0f, 2.0f);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const int V = 50, B = 64;
    for (SamplingParams p : {SamplingParams{}, SamplingParams{0.7, 0.9, 0}, SamplingParams{1.3, 1.0, 5},
                             SamplingParams{1.0, 0.5, 10}}) {
        std::vector<float> flat;
        std::vector<double> u;
        for (int i = 0; i < B * V; ++i) flat.push_back(logit(rng));
        for (int b = 0; b < B; ++b) u.push_back(unit(rng));
        const auto got = sample_tokens(at::from_blob(flat.data(), {B, V}, at::kFloat), p, u);
        ASSERT_EQ(static_cast<int>(got.size()), B);
        for (int b = 0; b < B; ++b) {
            const auto want = reference_sample(
                std::vector<float>(flat.begin() + b * V, flat.begin() + (b + 1) * V), p, u[b]);
            EXPECT_EQ(got[b].first, want.first)
                << "row " << b << " top_k " << p.top_k << " top_p " << p.top_p;
            EXPECT_NEAR(got[b].second, want.second, 1e-5) << "row " << b;
        }
    }
    EXPECT_THROW(sample_tokens(at::zeros({2, 4}), SamplingParams{}, {0.5}), moerl::Error);
}

TEST(Sampling, TopKTopPAndTemperature) {
    std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
    SamplingParams p;
    // Untruncated: inverse CDF over 0.5 / 0.3 / 0.2.
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.49).first, 0);
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.51).first, 1);
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.85).first, 2);
    EXPECT_NEAR(sample_token(logits.data(), 3, p, 0.85).second, std::log(0.2), 1e-6);
    p.top_k = 2;  // token 2 is never drawn; its mass goes to the others
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.99).first, 1);
    p.top_k = 0;
    p.top_p = 0.5;  // only the top token
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.99).first, 0);
    p.top_p = 1.0;
    p.temperature = 0.01;  // nearly greedy
    EXPECT_EQ(sample_token(logits.data(), 3, p, 0.99).first, 0);
    // Draws are reproducible and roughly uniform.
    EXPECT_EQ(uniform_draw(5, 9), uniform_draw(5, 9));
    double mean = 0;
    for (int i = 0; i < 10000; ++i) mean += uniform_draw(42, i);
    EXPECT_NEAR(mean / 10000, 0.5, 0.02);
}

TEST(Experience, JsonRoundTrip) {
    ExperienceRecord e;
    e.task_id = task_id(3, 1, 2);
    EXPECT_EQ(e.task_id, "s3-p1-g2");
    e.attempt = 1;
    e.task.step = 3;
    e.task.seed = 123456789012345ULL;
    e.task.problem = {"sort", "s21=", "12"};
    e.task.prompt_tokens = {1, 5, 4};
    e.trajectory.tokens = {4, 5, 2};
    e.trajectory.logprobs = {-0.5f, -0.25f, -1.0f};
    e.trajectory.versions = {4, 5, 5};
    e.trajectory.routing = {0, 1, -1, 3};
    e.trajectory.terminated = true;
    e.reward = 0.75;
    ExperienceRecord f = experience_from_json(to_json(e));
    EXPECT_EQ(f.task_id, e.task_id);
    EXPECT_EQ(f.task.seed, e.task.seed);
    EXPECT_EQ(f.trajectory.tokens, e.trajectory.tokens);
    EXPECT_EQ(f.trajectory.logprobs, e.trajectory.logprobs);
    EXPECT_EQ(f.trajectory.routing, e.trajectory.routing);
    EXPECT_EQ(f.oldest_version(), 4);
    EXPECT_DOUBLE_EQ(f.reward, 0.75);
    EXPECT_FALSE(f.correct);
    // The verifier's call travels apart from the reward; a record written before it had one counts
    // as correct when its reward reaches 1.
    e.correct = true;
    EXPECT_TRUE(experience_from_json(to_json(e)).correct);
    auto without_correct = [](const ExperienceRecord& r) {
        std::string text = to_json(r);
        const std::string field = std::string("\"correct\":") + (r.correct ? "true" : "false") + ",";
        const size_t at = text.find(field);
        EXPECT_NE(at, std::string::npos) << text;
        return text.erase(at, field.size());
    };
    e.correct = false;
    EXPECT_FALSE(experience_from_json(without_correct(e)).correct);
    e.reward = 1.0;
    EXPECT_TRUE(experience_from_json(without_correct(e)).correct);
    EXPECT_THROW(experience_from_json("{\"task_id\": 1}"), moerl::Error);
}

// The per-token arrays travel packed (base64 of their bytes): every length round-trips, whatever
// padding it needs; records of earlier versions (JSON arrays) are still read; a damaged array is an
// error naming it.
TEST(Experience, PackedArraysRoundTripAndOldRecordsAreRead) {
    for (int n = 0; n < 7; ++n) {
        Trajectory t;
        for (int i = 0; i < n; ++i) {
            t.tokens.push_back(151000 + i);
            t.logprobs.push_back(-0.1f * static_cast<float>(i) - 1e-7f);
            t.versions.push_back(int64_t{1} << (33 + i));
        }
        for (int i = 0; i < 3 * n; ++i) t.routing.push_back(static_cast<int16_t>(i % 2 ? -1 : 127 + i));
        const Trajectory u = trajectory_from_json(to_json(t));
        EXPECT_EQ(u.tokens, t.tokens) << n;
        EXPECT_EQ(u.logprobs, t.logprobs) << n;
        EXPECT_EQ(u.versions, t.versions) << n;
        EXPECT_EQ(u.routing, t.routing) << n;
    }
    nlohmann::json old = nlohmann::json::parse(to_json(Trajectory{}));
    old.erase("arrays");
    old["tokens"] = {4, 5};
    old["logprobs"] = {-0.5, -0.25};
    old["versions"] = {7, 8};
    old["routing"] = {0, -1, 3, 2};
    const Trajectory o = trajectory_from_json(old.dump());
    EXPECT_EQ(o.tokens, (std::vector<int>{4, 5}));
    EXPECT_EQ(o.versions, (std::vector<int64_t>{7, 8}));
    EXPECT_EQ(o.routing, (std::vector<int16_t>{0, -1, 3, 2}));
    auto error = [&](const char* key, const char* value) {
        nlohmann::json bad = nlohmann::json::parse(to_json(Trajectory{}));
        bad["arrays"][key] = value;
        try {
            trajectory_from_json(bad.dump());
        } catch (const moerl::Error& e) {
            return e.message();
        }
        return std::string("(no error)");
    };
    EXPECT_NE(error("routing", "AAA").find("routing is not base64"), std::string::npos);
    EXPECT_NE(error("tokens", "A!A=").find("tokens is not base64"), std::string::npos);
    EXPECT_NE(error("versions", "AAAA").find("versions holds 3 bytes, not a whole number of 8-byte values"),
              std::string::npos);
    // A record rewritten by a JSON library (other spacing) reads the same, and a dataset field
    // named like the arrays' member is only a field.
    ExperienceRecord e;
    e.task.problem.fields = {{"arrays", {{"tokens", "AAAA"}}}};
    e.trajectory.tokens = {7, 8, 9};
    e.trajectory.logprobs = {-1, -2, -3};
    e.trajectory.versions = {1, 1, 2};
    e.trajectory.routing = {5, 6};
    for (const std::string& text : {to_json(e), nlohmann::json::parse(to_json(e)).dump(2)}) {
        const ExperienceRecord f = experience_from_json(text);
        EXPECT_EQ(f.trajectory.tokens, e.trajectory.tokens);
        EXPECT_EQ(f.trajectory.routing, e.trajectory.routing);
        EXPECT_EQ(f.task.problem.fields, e.task.problem.fields);
    }
}

namespace {
std::string config_error(const std::string& yaml) {
    try {
        RunConfig::from_yaml_text(yaml, "quickstart.yaml");
    } catch (const moerl::Error& e) {
        return e.message();
    }
    return "(no error)";
}
}  // namespace

TEST(Config, DefaultsAreValid) {
    RunConfig c = RunConfig::from_yaml_text("", "empty.yaml");
    EXPECT_EQ(c.group_size, 8);
    EXPECT_EQ(c.model.vocab_size, Tokenizer::get().vocab_size());
}

TEST(Config, BadInputNamesTheKey) {
    EXPECT_EQ(config_error("train:\n  group_size: abc\n"),
              "quickstart.yaml: train.group_size: expected an integer >= 2, got 'abc'");
    EXPECT_EQ(config_error("train:\n  group_size: 1\n"),
              "quickstart.yaml: train.group_size: expected an integer >= 2, got 1");
    std::map<std::string, std::string> cases = {
        {"train:\n  grup_size: 4\n", "quickstart.yaml: train.grup_size: unknown key"},
        {"trian:\n  group_size: 4\n", "quickstart.yaml: trian: unknown key"},
        {"rollout:\n  temperature: hot\n", "quickstart.yaml: rollout.temperature: expected a number > 0"},
        {"rollout:\n  top_p: 1.5\n", "quickstart.yaml: rollout.top_p"},
        {"task:\n  kind: multiply\n",
         "quickstart.yaml: task.kind: expected one of add, sort, got 'multiply'"},
        {"ranks:\n  ep: 3\n", "quickstart.yaml: ranks.ep: 3 does not divide model.num_experts = 8"},
        {"model:\n  top_k: 9\n", "quickstart.yaml: model.top_k: 9 exceeds model.num_experts = 8"},
        {"model:\n  hidden_size: [1, 2]\n", "quickstart.yaml: model.hidden_size: expected an integer"},
        {"run:\n  seed: -4\n", "quickstart.yaml: run.seed"},
        {"train:\n  routing_replay: maybe\n",
         "quickstart.yaml: train.routing_replay: expected true or false"},
        {"train: [1, 2]\n", "quickstart.yaml: train: expected a mapping"},
        {"run: {steps: 10\n", "quickstart.yaml: not valid YAML"},
        {"rollout:\n  device: tpu\n",
         "quickstart.yaml: rollout.device: expected one of cpu, cuda, got 'tpu'"},
        {"rollout:\n  dtype: fp4\n",
         "quickstart.yaml: rollout.dtype: expected one of bf16, fp32, fp8, got 'fp4'"},
        {"rollout:\n  dtype: fp8\n",
         "quickstart.yaml: rollout.dtype: fp8 decodes from e4m3 weights in the CUDA engine; it needs "
         "rollout.device: "
         "cuda"},
        {"rollout:\n  device: cuda\n  dtype: fp8\nranks:\n  rollout: 2\n",
         "quickstart.yaml: rollout.dtype: fp8 needs every expert in one engine; ranks.rollout is 2"},
        {"rollout:\n  kv_cache_dtype: fp16\n",
         "quickstart.yaml: rollout.kv_cache_dtype: expected one of auto, fp8, got 'fp16'"},
        {"rollout:\n  kv_cache_dtype: fp8\n",
         "quickstart.yaml: rollout.kv_cache_dtype: fp8 caches keys and values as e4m3 in the CUDA engine; it "
         "needs rollout.device: cuda and rollout.dtype bf16 or fp8 (got cpu, fp32)"},
        {"rollout: {device: cuda, dtype: bf16, kv_cache_dtype: fp8}\n",
         "quickstart.yaml: rollout.kv_cache_dtype: fp8 needs 4, 8 or 16 query heads per key-value head of 64 "
         "or 128 dims; the model has 4 query heads per 2 key-value heads of 16 dims"},
        {"rollout:\n  max_seq_len: 1\n",
         "quickstart.yaml: rollout.max_seq_len: expected an integer in [2, 1048576], got 1"},
        {"rollout:\n  device: cuda\n  max_seq_len: 4\n",
         "quickstart.yaml: rollout.max_seq_len: 4 is below the longest sequence ("},
    };
    for (const auto& [yaml, expect] : cases) {
        const std::string msg = config_error(yaml);
        EXPECT_EQ(msg.rfind(expect, 0), 0u) << "input:\n" << yaml << "message: " << msg;
    }
}

// rollout.kv_cache_dtype: fp8 on a model the FP8 cache serves reaches the rollout engine's options;
// auto (the default) leaves the cache in the rollout dtype.
TEST(Config, Fp8KvCacheReachesTheRolloutEngine) {
    const RunConfig fp8 = RunConfig::from_yaml_text(
        "model: {num_heads: 8, num_kv_heads: 2, head_dim: 64}\n"
        "rollout: {device: cuda, dtype: bf16, kv_cache_dtype: fp8}\n",
        "quickstart.yaml");
    EXPECT_EQ(fp8.rollout_kv_cache_dtype, "fp8");
    EXPECT_TRUE(rollout_engine_options(fp8).fp8_kv_cache);
    EXPECT_FALSE(rollout_engine_options(fp8).fp8_weights);
    const RunConfig plain =
        RunConfig::from_yaml_text("rollout: {device: cuda, dtype: bf16}\n", "quickstart.yaml");
    EXPECT_EQ(plain.rollout_kv_cache_dtype, "auto");
    EXPECT_FALSE(rollout_engine_options(plain).fp8_kv_cache);
}

// rollout.device: cuda. Without a CUDA device it is refused naming the key; with one, greedy
// rollouts (top_k 1, fp32) on the GPU — through model::Generator where the build has it — give the
// CPU's tokens and log-probabilities, under continuous batching (more requests than slots).
TEST(Rollout, CudaMatchesCpuOrIsRefused) {
    RunConfig c = RunConfig::from_yaml_text("rollout: {device: cuda, record_routing: false, top_k: 1}\n",
                                            "quickstart.yaml");
    if (!at::hasCUDA()) {
        try {
            bench_rollout(c, 2, 2);
            ADD_FAILURE() << "rollout.device: cuda accepted without a CUDA device";
        } catch (const moerl::Error& e) {
            EXPECT_NE(e.message().find("quickstart.yaml: rollout.device: cuda, but"), std::string::npos)
                << e.message();
        }
        return;
    }
    moerl::model::MoeModel cpu(c.model, {});
    moerl::model::ModelOptions on_gpu;
    on_gpu.device = at::Device(at::kCUDA, 0);
    moerl::model::MoeModel gpu(c.model, on_gpu);
    cpu.init_random(7);
    gpu.init_random(7);
    RolloutEngine a(cpu, c.sampling,
                    {.max_batch = 3, .record_routing = false, .max_seq_len = c.rollout_max_seq_len});
    RolloutEngine b(gpu, c.sampling,
                    {.max_batch = 3, .record_routing = false, .max_seq_len = c.rollout_max_seq_len});
    EXPECT_FALSE(a.uses_generator());
    EXPECT_EQ(b.uses_generator(), moerl::model::Generator::available());
    for (int i = 0; i < 7; ++i) {
        const TaskPayload p = make_task_payload(c, 0, i, 0);
        const int max_new = 2 + i % 5;  // sequences leave at different steps
        a.add({static_cast<uint64_t>(i), p.prompt_tokens, {}, p.seed, max_new});
        b.add({static_cast<uint64_t>(i), p.prompt_tokens, {}, p.seed, max_new});
    }
    auto by_id = [](std::vector<GenResult> v) {
        std::sort(v.begin(), v.end(), [](const GenResult& x, const GenResult& y) { return x.id < y.id; });
        return v;
    };
    const std::vector<GenResult> want = by_id(a.run_to_completion(0)), got = by_id(b.run_to_completion(0));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].trajectory.tokens, want[i].trajectory.tokens) << "request " << want[i].id;
        ASSERT_EQ(got[i].trajectory.logprobs.size(), want[i].trajectory.logprobs.size());
        for (size_t t = 0; t < want[i].trajectory.logprobs.size(); ++t)
            EXPECT_NEAR(got[i].trajectory.logprobs[t], want[i].trajectory.logprobs[t], 1e-3)
                << "request " << want[i].id << " token " << t;
    }
    EXPECT_TRUE(b.idle());
}

TEST(Config, DuplicateKeysAreErrorsNamingTheLine) {
    EXPECT_EQ(config_error("run: {name: a}\ntrain:\n  lr: 0.1\nrun: {name: b}\n"),
              "quickstart.yaml:4: run: duplicate key (first given on line 1)");
    EXPECT_EQ(config_error("train:\n  lr: 0.1\n  group_size: 4\n  lr: 0.2\n"),
              "quickstart.yaml:4: train.lr: duplicate key (first given on line 2)");
}

TEST(Config, OversizedTextIsRefusedBeforeParsing) {
    const std::string big(2 << 20, '#');
    EXPECT_NE(config_error(big).find("2097152 bytes; a config is at most 1048576 bytes"), std::string::npos);
}

TEST(Config, RunNameIsAPathAndNamespaceSafeWord) {
    EXPECT_EQ(config_error("run: {name: ok.name_1-2}\n"), "(no error)");
    EXPECT_EQ(
        config_error("run: {name: ../../etc/x}\n"),
        "quickstart.yaml: run.name: '../../etc/x' has the character '/'; expected letters, digits, '.', "
        "'_' and '-' only");
    EXPECT_EQ(config_error("run: {name: \"R&D run\"}\n").substr(0, 37),
              "quickstart.yaml: run.name: 'R&D run' ");
    EXPECT_EQ(config_error("run: {name: " + std::string(65, 'a') + "}\n"),
              "quickstart.yaml: run.name: expected 1 to 64 characters, got 65");
    EXPECT_EQ(config_error("run: {name: ..}\n"), "quickstart.yaml: run.name: '..' is not a usable name");
}

TEST(RewardSvg, TitleIsXmlEscaped) {
    const std::string path = ::testing::TempDir() + "/escaped-" + std::to_string(::getpid()) + ".svg";
    write_reward_svg(path, {0, 1}, {0.1, 0.2}, "R&D </text><script>alert(1)</script>");
    std::ifstream in(path);
    const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::remove(path.c_str());
    EXPECT_NE(svg.find("R&amp;D &lt;/text&gt;&lt;script&gt;"), std::string::npos) << svg;
    EXPECT_EQ(svg.find("<script>"), std::string::npos);
}

// Which waiting requests join the CUDA engine together: a GRPO group's samples (consecutive, same
// prompt) are not split between prefills unless the group is larger than the engine; an idle engine
// takes what fits; a resumed sample (its own partial response) is a group of its own.
TEST(GroupAdmission, WholeGroupsJoinTogether) {
    using moerl::rl::detail::same_context_run;
    using moerl::rl::detail::whole_groups;
    std::deque<GenRequest> q;
    auto add = [&](std::vector<int> prompt, int n, std::vector<int> resumed = {}) {
        for (int i = 0; i < n; ++i) {
            GenRequest r;
            r.id = q.size();
            r.prompt = prompt;
            r.prefix.tokens = resumed;
            q.push_back(r);
        }
    };
    add({1, 5, 6}, 4);
    add({1, 7}, 4);
    add({1, 7}, 1, {3});  // the same prompt, resumed: another context
    add({1, 8}, 10);
    EXPECT_EQ(same_context_run(q, 0), 4u);
    EXPECT_EQ(same_context_run(q, 4), 4u);
    EXPECT_EQ(same_context_run(q, 8), 1u);
    EXPECT_EQ(same_context_run(q, 9), 10u);
    EXPECT_EQ(same_context_run(q, 12), 7u);
    // 6 free slots of 16: the first group, not half of the second.
    EXPECT_EQ(whole_groups(q, 6, 16, false, true), 4u);
    EXPECT_EQ(whole_groups(q, 8, 16, false, true), 8u);
    EXPECT_EQ(whole_groups(q, 9, 16, false, true), 9u);
    // The group of 10 waits for 10 slots; larger than an engine of 8, it is split.
    EXPECT_EQ(whole_groups(q, 15, 16, false, true), 9u);
    EXPECT_EQ(whole_groups(q, 19, 16, false, true), 19u);
    std::deque<GenRequest> big(q.begin() + 9, q.end());
    EXPECT_EQ(whole_groups(big, 8, 8, false, true), 8u);
    EXPECT_EQ(whole_groups(big, 5, 16, false, true), 0u);
    EXPECT_EQ(whole_groups(big, 5, 16, /*idle=*/true, true), 5u);
    // Without sharing (the CPU engine): what fits.
    EXPECT_EQ(whole_groups(q, 6, 16, false, false), 6u);
    EXPECT_EQ(whole_groups(q, 100, 128, false, false), q.size());
}
