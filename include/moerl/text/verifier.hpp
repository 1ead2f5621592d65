// Rule-based rewards: a verifier scores a response text against its example and says why.
// Kinds: math (final numeric answer), countdown (an arithmetic expression reaching a target),
// exact (string match with optional normalisation), format (a PCRE2 regex over the response),
// external (a user's program over JSON lines, verifier_external.hpp), and a weighted mix of these.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "moerl/text/dataset.hpp"

namespace moerl::text {

struct Verdict {
    double reward = 0.0;     // in [0, 1] for every kind but a composite (see CompositeVerifier)
    nlohmann::json details;  // what was extracted and compared, or why the reward is 0
};

// One response to score; `example` must outlive the call.
struct Scoring {
    std::string_view response;
    const Example* example = nullptr;
};

class Verifier {
  public:
    virtual ~Verifier() = default;
    virtual std::string name() const = 0;
    virtual Verdict score(std::string_view response, const Example& example) = 0;
    // Scores in the order given; the external verifier pipelines a batch through its process.
    virtual std::vector<Verdict> score_batch(const std::vector<Scoring>& batch);
};

// Math: the response's final answer (the last \boxed{...}, else the text after the last "####",
// else the last number) against the example's answer (the same extraction when it holds \boxed or
// ####). Numbers compare as exact fractions: integers, decimals, a/b, \frac{a}{b}, \dfrac, \tfrac,
// signs, thousands separators ("1,234"), a percent sign (50% equals 50 and 0.5), and "$", "\$",
// \text{...} and trailing unit words stripped. Answers that are not numbers compare as text with
// spaces removed.
struct MathOptions {
    double relative_tolerance = 0.0;  // 0 = exact; > 0 also accepts |a-b| <= tol * max(|a|,|b|)
    void validate() const;
};

// Countdown: the expression in the response's last <answer>...</answer> (else its last \boxed{},
// else its last non-empty line; the left side when it holds "=") built from + - * / and
// parentheses over the example's numbers must equal its target. No unary minus, integers only.
// Arithmetic is exact over fractions: 6/4*2 = 3 passes unless integer_only; division by zero scores 0.
struct CountdownOptions {
    std::string numbers_field = "nums";   // an array of integers in the example
    std::string target_field = "target";  // an integer in the example
    bool use_all = true;        // true: each number exactly once (TinyZero's rule); false: at most once
    bool integer_only = false;  // every intermediate result must be an integer (the TV game's rule)
    void validate() const;
};

// Exact match of the response (or of the last match of `extract`'s first group) and the answer.
struct ExactOptions {
    std::string extract;  // PCRE2 pattern with one capture group, e.g. "<answer>(.*?)</answer>"; empty = all
    bool ignore_case = false;          // Unicode case folding (utf8proc)
    bool normalize_whitespace = true;  // trim, and collapse runs of white space into one space
    void validate() const;
};

// Format: 1 when the PCRE2 pattern matches the response (anywhere; anchor it with ^ and $), else 0.
// The default asks for one <think>...</think> block first and some answer after it.
struct FormatOptions {
    std::string pattern = kThinkPattern;
    bool dotall = true;  // "." matches newlines
    void validate() const;
    static constexpr const char* kThinkPattern =
        R"(^\s*<think>(?:(?!</?think>).)*</think>(?=(?:(?!</?think>).)*\S)(?:(?!</?think>).)*$)";
};

// The external verifier's options (verifier_external.hpp describes the protocol).
struct ExternalOptions {
    std::vector<std::string> command;  // argv; a single string holding spaces runs through /bin/sh -c
    double timeout_s = 30.0;           // per item: each answer must come within this of the previous one
    double startup_timeout_s = 60.0;   // added for the first answer after a start (imports, model loading)
    int max_restarts = 3;              // restarts in a row without an answer in between, then an error
    std::string working_dir;           // empty = the current directory
    void validate() const;
};

// One verifier of a mix; `kind` picks which options apply.
struct VerifierSpec {
    std::string kind;  // math | countdown | exact | format | external
    double weight = 1.0;
    MathOptions math;
    CountdownOptions countdown;
    ExactOptions exact;
    FormatOptions format;
    ExternalOptions external;
    void validate() const;
};

std::unique_ptr<Verifier> make_verifier(const VerifierSpec& spec);

// The weighted sum of its parts' rewards (like reward_weights in TRL): in [0, sum of weights].
// Details hold each part's verdict under its name.
class CompositeVerifier final : public Verifier {
  public:
    CompositeVerifier(std::vector<std::unique_ptr<Verifier>> parts, std::vector<double> weights);
    std::string name() const override { return "composite"; }
    Verdict score(std::string_view response, const Example& example) override;
    std::vector<Verdict> score_batch(const std::vector<Scoring>& batch) override;

  private:
    std::vector<std::unique_ptr<Verifier>> parts_;
    std::vector<double> weights_;
};

// One verifier for a list of specs: the verifier itself for one spec of weight 1, else a composite.
std::unique_ptr<Verifier> make_verifier(const std::vector<VerifierSpec>& specs);

}  // namespace moerl::text
