// The env role's pieces: a character tokenizer, task generators with rule-based verifiers, and the
// reward interface (verifiers, a reward model with a scalar head, or a weighted mix).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moerl::rl {

// A fixed character vocabulary: pad, bos, eos, then "0123456789+=s, ". Ids are stable across runs.
class Tokenizer {
  public:
    static constexpr int kPad = 0;
    static constexpr int kBos = 1;
    static constexpr int kEos = 2;
    static const Tokenizer& get();
    int vocab_size() const;
    // Throws naming the first character outside the vocabulary.
    std::vector<int> encode(const std::string& text) const;
    // Special tokens are dropped; decoding stops at the first eos.
    std::string decode(const std::vector<int>& ids) const;
};

// One prompt and its reference answer.
struct Problem {
    std::string kind;    // "add" | "sort" | "data"
    std::string prompt;  // e.g. "s3142=", or the dataset line's prompt (the rendered chat for messages)
    std::string answer;  // e.g. "1234"
    // data: "file:line" and the whole JSON line (what verifiers read: answer, nums, target, ...),
    // carried in the task payload so that a rollout worker elsewhere scores without the dataset.
    std::string where;
    nlohmann::json fields;  // null for the built-in tasks
};

// Task family and difficulty. Limits are checked by validate().
struct TaskSpec {
    std::string kind = "sort";   // add | sort
    int digits = 2;              // add: digits per operand, 1..6
    int length = 4;              // sort: list length, 2..8
    int max_value = 9;           // sort: values in [0, max_value], 1..9
    bool partial_credit = true;  // reward matching positions, not only exact answers

    void validate() const;
};

class TaskGenerator {
  public:
    virtual ~TaskGenerator() = default;
    // The problem for `seed` (deterministic).
    virtual Problem make(uint64_t seed) const = 0;
    // Rule-based reward in [0, 1] for a decoded response (text before eos); `terminated` says
    // whether the response ended with eos.
    virtual double verify(const Problem& problem, const std::string& response, bool terminated) const = 0;
    // Longest answer in tokens, eos included (sizes generation).
    virtual int max_answer_tokens() const = 0;
    virtual int max_prompt_tokens() const = 0;
};

std::unique_ptr<TaskGenerator> make_task_generator(const TaskSpec& spec);

// Reward for a batch of finished responses.
struct Scored {
    Problem problem;
    std::vector<int> prompt_tokens;
    std::vector<int> response_tokens;
    bool terminated = false;
};

class Rewarder {
  public:
    virtual ~Rewarder() = default;
    virtual std::vector<double> score(const std::vector<Scored>& batch) = 0;
    // The rewards and whether each response is correct (eval's pass@1): by default a reward of at
    // least 1; the dataset's verifier mix asks its first verifier.
    virtual std::vector<double> score_and_check(const std::vector<Scored>& batch, std::vector<bool>& correct);
};

// Rewards from the task's verifier.
std::unique_ptr<Rewarder> make_verifier_rewarder(const TaskSpec& spec);
// A weighted sum of rewarders (e.g. verifier + reward model).
std::unique_ptr<Rewarder> make_mixed_rewarder(std::vector<std::unique_ptr<Rewarder>> parts,
                                              std::vector<double> weights);

}  // namespace moerl::rl
