// Exact match, format (PCRE2) and weighted mixes of verifiers.
#include <gtest/gtest.h>

#include "data_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/text/verifier.hpp"

namespace moerl::text {
namespace {

using testing::with_answer;

double exact(const std::string& response, const std::string& answer, ExactOptions o = {}) {
    VerifierSpec spec{.kind = "exact"};
    spec.exact = o;
    return make_verifier(spec)->score(response, with_answer(answer)).reward;
}

TEST(ExactVerifier, Normalisation) {
    EXPECT_EQ(exact("Paris", "Paris"), 1);
    EXPECT_EQ(exact("paris", "Paris"), 0);
    EXPECT_EQ(exact("paris", "Paris", {.ignore_case = true}), 1);
    EXPECT_EQ(exact("STRASSE", "stra\u00DFe", {.ignore_case = true}), 1);  // full case folding
    EXPECT_EQ(exact("  New   York \n", "New York"), 1);
    EXPECT_EQ(exact("  New   York \n", "New York", {.normalize_whitespace = false}), 0);
    EXPECT_EQ(exact("caf\u00E9", "cafe\u0301"), 1);  // NFC: composed equals decomposed
    EXPECT_EQ(exact("Paris.", "Paris"), 0);
    EXPECT_EQ(exact("\xff\xfe", "x"), 0);  // invalid UTF-8 compares as bytes, no error
}

TEST(ExactVerifier, ExtractPatternTakesTheLastMatch) {
    ExactOptions o{.extract = "<answer>(.*?)</answer>"};
    EXPECT_EQ(exact("<answer>Rome</answer> hmm <answer> Paris </answer>", "Paris", o), 1);
    EXPECT_EQ(exact("Paris", "Paris", o), 0);                                  // nothing extracted
    EXPECT_THROW(exact("x", "x", {.extract = "<answer>.*</answer>"}), Error);  // no group
    EXPECT_THROW(exact("x", "x", {.extract = "(unclosed"}), Error);
}

double format(const std::string& response, FormatOptions o = {}) {
    VerifierSpec spec{.kind = "format"};
    spec.format = o;
    return make_verifier(spec)->score(response, with_answer("1")).reward;
}

TEST(FormatVerifier, DefaultThinkPattern) {
    EXPECT_EQ(format("<think>2+2 is 4</think> The answer is 4."), 1);
    EXPECT_EQ(format("  <think>\nmany\nlines\n</think>\n\n\\boxed{4}"), 1);
    EXPECT_EQ(format("The answer is 4."), 0);
    EXPECT_EQ(format("<think>no answer after</think>  \n"), 0);
    EXPECT_EQ(format("first <think>x</think> 4"), 0);
    EXPECT_EQ(format("<think>a</think><think>b</think> 4"), 0);
    EXPECT_EQ(format("<think>unclosed 4"), 0);
    EXPECT_EQ(format("<think>x</think> 4 </think>"), 0);
}

TEST(FormatVerifier, CustomPatternsAndLimits) {
    EXPECT_EQ(format("Answer: 12", {.pattern = R"(^Answer: \d+$)"}), 1);
    EXPECT_EQ(format("Answer: 12 apples", {.pattern = R"(^Answer: \d+$)"}), 0);
    try {
        format("x", {.pattern = "a(b"});
        FAIL() << "compiled a broken pattern";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("verifier format.pattern: the pattern 'a(b' does not compile at offset 3"),
                  std::string::npos)
            << e.message();
    }
    // Catastrophic backtracking ends at the match limit with reward 0 instead of hanging.
    VerifierSpec spec{.kind = "format"};
    spec.format.pattern = "^(a+)+$";
    const Verdict v = make_verifier(spec)->score(std::string(40, 'a') + "b", with_answer("1"));
    EXPECT_EQ(v.reward, 0);
    EXPECT_EQ(v.details.at("error"), "the pattern hit the match limit");
    // A search deeper than the JIT's stack (each repetition of (x|xy) keeps a backtracking point)
    // runs again interpreted and matches, as it did before the patterns were JIT-compiled.
    VerifierSpec deep{.kind = "format"};
    deep.format.pattern = "^(x|xy)*z$";
    std::string xs;
    for (int i = 0; i < 5000; ++i) xs += "xy";
    const Verdict d = make_verifier(deep)->score(xs + "z", with_answer("1"));
    EXPECT_EQ(d.reward, 1) << d.details.dump();
}

TEST(CompositeVerifier, WeightedSumWithEachPartInDetails) {
    VerifierSpec math{.kind = "math"};
    VerifierSpec fmt{.kind = "format", .weight = 0.2};
    VerifierSpec fmt2{.kind = "format", .weight = 0.5};
    fmt2.format.pattern = "4";
    auto v = make_verifier(std::vector<VerifierSpec>{math, fmt, fmt2});
    EXPECT_EQ(v->name(), "composite");
    const Verdict both = v->score("<think>sum</think> \\boxed{4}", with_answer("4"));
    EXPECT_DOUBLE_EQ(both.reward, 1.7);
    EXPECT_EQ(both.details.at("math").at("reward"), 1.0);
    EXPECT_EQ(both.details.at("format").at("weight"), 0.2);
    EXPECT_EQ(both.details.at("format#2").at("reward"), 1.0);
    const Verdict wrong = v->score("<think>sum</think> \\boxed{5}", with_answer("4"));
    EXPECT_DOUBLE_EQ(wrong.reward, 0.2);
    const Example ex = with_answer("4");
    const auto batch = v->score_batch({{"\\boxed{4}", &ex}, {"nothing", &ex}});
    ASSERT_EQ(batch.size(), 2u);
    EXPECT_DOUBLE_EQ(batch[0].reward, 1.5);
    EXPECT_DOUBLE_EQ(batch[1].reward, 0.0);
    // One spec of weight 1 is the verifier itself.
    EXPECT_EQ(make_verifier(std::vector<VerifierSpec>{math})->name(), "math");
    EXPECT_THROW(make_verifier(std::vector<VerifierSpec>{}), Error);
    EXPECT_THROW(make_verifier(VerifierSpec{.kind = "regex"}), Error);
    EXPECT_THROW(make_verifier(VerifierSpec{.kind = "math", .weight = -1}), Error);
}

}  // namespace
}  // namespace moerl::text
