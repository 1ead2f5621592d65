// The verifier interface's shared parts: option checks, the math verifier, the weighted mix, the factory.
#include "moerl/text/verifier.hpp"

#include <cmath>
#include <map>

#include "moerl/core/error.hpp"
#include "moerl/text/verifier_external.hpp"
#include "verifiers.hpp"

namespace moerl::text {

std::vector<Verdict> Verifier::score_batch(const std::vector<Scoring>& batch) {
    std::vector<Verdict> out;
    out.reserve(batch.size());
    for (const auto& s : batch) {
        MOERL_CHECK(s.example != nullptr, name(), " verifier: a batch item has no example");
        out.push_back(score(s.response, *s.example));
    }
    return out;
}

void MathOptions::validate() const {
    MOERL_CHECK(std::isfinite(relative_tolerance) && relative_tolerance >= 0 && relative_tolerance < 1,
                "verifier math.relative_tolerance: expected a number in [0, 1), got ", relative_tolerance);
}

void CountdownOptions::validate() const {
    MOERL_CHECK(!numbers_field.empty() && !target_field.empty(),
                "verifier countdown: numbers_field and target_field must not be empty");
}

void ExactOptions::validate() const {}  // the extract pattern is checked when it compiles

void FormatOptions::validate() const {
    MOERL_CHECK(!pattern.empty(), "verifier format.pattern: must not be empty");
}

void ExternalOptions::validate() const {
    MOERL_CHECK(!command.empty() && !command[0].empty(),
                "verifier external.command: the program to run is required");
    MOERL_CHECK(std::isfinite(timeout_s) && timeout_s > 0,
                "verifier external.timeout_s: expected a number > 0, got ", timeout_s);
    MOERL_CHECK(std::isfinite(startup_timeout_s) && startup_timeout_s >= 0,
                "verifier external.startup_timeout_s: expected a number >= 0, got ", startup_timeout_s);
    MOERL_CHECK(max_restarts >= 0, "verifier external.max_restarts: expected an integer >= 0, got ",
                max_restarts);
}

void VerifierSpec::validate() const {
    MOERL_CHECK(std::isfinite(weight) && weight >= 0, "verifier ", kind,
                ": weight must be a number >= 0, got ", weight);
    if (kind == "math") return math.validate();
    if (kind == "countdown") return countdown.validate();
    if (kind == "exact") return exact.validate();
    if (kind == "format") return format.validate();
    if (kind == "external") return external.validate();
    MOERL_FAIL("verifier kind: expected math, countdown, exact, format or external, got '", kind, "'");
}

std::string valid_utf8(std::string_view s) {
    return nlohmann::json::parse(
               nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
        .get<std::string>();
}

namespace {

class MathVerifier final : public Verifier {
  public:
    explicit MathVerifier(const MathOptions& o) : o_(o) { o_.validate(); }
    std::string name() const override { return "math"; }
    Verdict score(std::string_view response, const Example& ex) override {
        Verdict v;
        const std::string expected = math::reference_answer(ex.answer);
        v.details["expected"] = valid_utf8(expected);
        auto got = math::extract_final_answer(response);
        if (!got) {
            v.details["error"] = "no final answer found";
            return v;
        }
        v.details["answer"] = valid_utf8(got->text);
        v.details["source"] = got->source;
        v.reward = math::answers_equal(expected, got->text, o_.relative_tolerance) ? 1.0 : 0.0;
        return v;
    }

  private:
    MathOptions o_;
};

}  // namespace

std::unique_ptr<Verifier> make_math_verifier(const MathOptions& options) {
    return std::make_unique<MathVerifier>(options);
}

CompositeVerifier::CompositeVerifier(std::vector<std::unique_ptr<Verifier>> parts,
                                     std::vector<double> weights)
    : parts_(std::move(parts)), weights_(std::move(weights)) {
    MOERL_CHECK(!parts_.empty() && parts_.size() == weights_.size(), "composite verifier: ", parts_.size(),
                " verifiers but ", weights_.size(), " weights");
    for (double w : weights_)
        MOERL_CHECK(std::isfinite(w) && w >= 0, "composite verifier: weight must be a number >= 0, got ", w);
}

Verdict CompositeVerifier::score(std::string_view response, const Example& example) {
    Example const* ex = &example;
    return score_batch({{response, ex}})[0];
}

std::vector<Verdict> CompositeVerifier::score_batch(const std::vector<Scoring>& batch) {
    std::vector<Verdict> out(batch.size());
    for (auto& v : out) v.details = nlohmann::json::object();
    std::map<std::string, int> seen;
    for (size_t p = 0; p < parts_.size(); ++p) {
        std::string key = parts_[p]->name();
        if (const int n = ++seen[key]; n > 1) key += "#" + std::to_string(n);
        std::vector<Verdict> part = parts_[p]->score_batch(batch);
        for (size_t i = 0; i < batch.size(); ++i) {
            out[i].reward += weights_[p] * part[i].reward;
            out[i].details[key] = {
                {"reward", part[i].reward}, {"weight", weights_[p]}, {"details", part[i].details}};
        }
    }
    return out;
}

std::unique_ptr<Verifier> make_verifier(const VerifierSpec& spec) {
    spec.validate();
    if (spec.kind == "math") return make_math_verifier(spec.math);
    if (spec.kind == "countdown") return make_countdown_verifier(spec.countdown);
    if (spec.kind == "exact") return make_exact_verifier(spec.exact);
    if (spec.kind == "format") return make_format_verifier(spec.format);
    return std::make_unique<ExternalVerifier>(spec.external);
}

std::unique_ptr<Verifier> make_verifier(const std::vector<VerifierSpec>& specs) {
    MOERL_CHECK(!specs.empty(), "verifiers: at least one is needed");
    if (specs.size() == 1 && specs[0].weight == 1.0) return make_verifier(specs[0]);
    std::vector<std::unique_ptr<Verifier>> parts;
    std::vector<double> weights;
    for (const auto& s : specs) {
        parts.push_back(make_verifier(s));
        weights.push_back(s.weight);
    }
    return std::make_unique<CompositeVerifier>(std::move(parts), std::move(weights));
}

}  // namespace moerl::text
