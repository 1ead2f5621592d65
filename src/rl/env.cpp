// Tokenizer, task generators and verifiers (no LibTorch).
#include "moerl/rl/env.hpp"

#include <algorithm>
#include <random>

#include "moerl/core/error.hpp"

namespace moerl::rl {

namespace {
constexpr const char* kChars = "0123456789+=s, ";
constexpr int kFirstChar = 3;

// Reward: 1 for the exact answer with eos. Partial credit, so that learning from scratch gets a
// signal early: 0.2 for the right length ending in eos, 0.3 x the fraction of the answer's
// characters present in the response (as a multiset), 0.5 x the fraction of positions that match
// (over the longer of the two); halved when the response did not end with eos.
double compare(const std::string& answer, const std::string& response, bool terminated, bool partial) {
    if (response == answer && terminated) return 1.0;
    if (!partial || response.empty()) return 0.0;
    size_t matches = 0;
    for (size_t i = 0; i < std::min(answer.size(), response.size()); ++i) matches += answer[i] == response[i];
    int counts[256] = {};
    for (unsigned char c : answer) ++counts[c];
    size_t present = 0;
    for (unsigned char c : response)
        if (counts[c] > 0) --counts[c], ++present;
    const double n = static_cast<double>(answer.size());
    double r =
        (terminated && response.size() == answer.size() ? 0.2 : 0.0) + 0.3 * present / n +
        0.5 * static_cast<double>(matches) / static_cast<double>(std::max(answer.size(), response.size()));
    return terminated ? r : 0.5 * r;
}

class AddTask final : public TaskGenerator {
  public:
    explicit AddTask(const TaskSpec& s) : spec_(s) {}
    Problem make(uint64_t seed) const override {
        std::mt19937_64 rng(seed);
        int64_t hi = 1;
        for (int i = 0; i < spec_.digits; ++i) hi *= 10;
        std::uniform_int_distribution<int64_t> d(0, hi - 1);
        int64_t a = d(rng), b = d(rng);
        return {"add", std::to_string(a) + "+" + std::to_string(b) + "=", std::to_string(a + b)};
    }
    double verify(const Problem& p, const std::string& r, bool terminated) const override {
        return compare(p.answer, r, terminated, spec_.partial_credit);
    }
    int max_answer_tokens() const override { return spec_.digits + 2; }
    int max_prompt_tokens() const override { return 2 * spec_.digits + 3; }

  private:
    TaskSpec spec_;
};

class SortTask final : public TaskGenerator {
  public:
    explicit SortTask(const TaskSpec& s) : spec_(s) {}
    Problem make(uint64_t seed) const override {
        std::mt19937_64 rng(seed);
        std::uniform_int_distribution<int> d(0, spec_.max_value);
        std::string list;
        for (int i = 0; i < spec_.length; ++i) list += static_cast<char>('0' + d(rng));
        std::string sorted = list;
        std::sort(sorted.begin(), sorted.end());
        return {"sort", "s" + list + "=", sorted};
    }
    double verify(const Problem& p, const std::string& r, bool terminated) const override {
        return compare(p.answer, r, terminated, spec_.partial_credit);
    }
    int max_answer_tokens() const override { return spec_.length + 1; }
    int max_prompt_tokens() const override { return spec_.length + 3; }

  private:
    TaskSpec spec_;
};

class VerifierRewarder final : public Rewarder {
  public:
    explicit VerifierRewarder(const TaskSpec& s) : task_(make_task_generator(s)) {}
    std::vector<double> score(const std::vector<Scored>& batch) override {
        std::vector<double> out;
        for (const auto& s : batch)
            out.push_back(task_->verify(s.problem, Tokenizer::get().decode(s.response_tokens), s.terminated));
        return out;
    }

  private:
    std::unique_ptr<TaskGenerator> task_;
};

class MixedRewarder final : public Rewarder {
  public:
    MixedRewarder(std::vector<std::unique_ptr<Rewarder>> parts, std::vector<double> weights)
        : parts_(std::move(parts)), weights_(std::move(weights)) {
        MOERL_CHECK(!parts_.empty() && parts_.size() == weights_.size(), "mixed rewarder: ", parts_.size(),
                    " rewarders but ", weights_.size(), " weights");
    }
    std::vector<double> score(const std::vector<Scored>& batch) override {
        std::vector<bool> correct;
        return score_and_check(batch, correct);
    }
    // Correctness is the first part's (the verifier; a reward model has no notion of it).
    std::vector<double> score_and_check(const std::vector<Scored>& batch,
                                        std::vector<bool>& correct) override {
        std::vector<double> total(batch.size(), 0.0);
        for (size_t p = 0; p < parts_.size(); ++p) {
            auto s = p == 0 ? parts_[p]->score_and_check(batch, correct) : parts_[p]->score(batch);
            for (size_t i = 0; i < s.size(); ++i) total[i] += weights_[p] * s[i];
        }
        return total;
    }

  private:
    std::vector<std::unique_ptr<Rewarder>> parts_;
    std::vector<double> weights_;
};

}  // namespace

std::vector<double> Rewarder::score_and_check(const std::vector<Scored>& batch, std::vector<bool>& correct) {
    std::vector<double> r = score(batch);
    correct.assign(r.size(), false);
    for (size_t i = 0; i < r.size(); ++i) correct[i] = r[i] >= 1.0;
    return r;
}

const Tokenizer& Tokenizer::get() {
    static const Tokenizer t;
    return t;
}

int Tokenizer::vocab_size() const { return kFirstChar + static_cast<int>(std::string(kChars).size()); }

std::vector<int> Tokenizer::encode(const std::string& text) const {
    static const std::string chars = kChars;
    std::vector<int> ids;
    for (size_t i = 0; i < text.size(); ++i) {
        auto pos = chars.find(text[i]);
        MOERL_CHECK(pos != std::string::npos, "tokenizer: character '", text[i], "' at ", i, " of \"", text,
                    "\" is not in the vocabulary \"", chars, "\"");
        ids.push_back(kFirstChar + static_cast<int>(pos));
    }
    return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
    static const std::string chars = kChars;
    std::string out;
    for (int id : ids) {
        if (id == kEos) break;
        if (id >= kFirstChar && id < vocab_size()) out += chars[id - kFirstChar];
    }
    return out;
}

void TaskSpec::validate() const {
    MOERL_CHECK(kind == "add" || kind == "sort", "task.kind: expected 'add' or 'sort', got '", kind, "'");
    MOERL_CHECK(digits >= 1 && digits <= 6, "task.digits: expected an integer in [1, 6], got ", digits);
    MOERL_CHECK(length >= 2 && length <= 8, "task.length: expected an integer in [2, 8], got ", length);
    MOERL_CHECK(max_value >= 1 && max_value <= 9, "task.max_value: expected an integer in [1, 9], got ",
                max_value);
}

std::unique_ptr<TaskGenerator> make_task_generator(const TaskSpec& spec) {
    spec.validate();
    if (spec.kind == "add") return std::make_unique<AddTask>(spec);
    return std::make_unique<SortTask>(spec);
}

std::unique_ptr<Rewarder> make_verifier_rewarder(const TaskSpec& spec) {
    return std::make_unique<VerifierRewarder>(spec);
}

std::unique_ptr<Rewarder> make_mixed_rewarder(std::vector<std::unique_ptr<Rewarder>> parts,
                                              std::vector<double> weights) {
    return std::make_unique<MixedRewarder>(std::move(parts), std::move(weights));
}

}  // namespace moerl::rl
