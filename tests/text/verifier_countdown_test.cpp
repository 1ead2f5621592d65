// The countdown verifier: which numbers an expression uses, exact arithmetic, hostile input.
#include <gtest/gtest.h>

#include "moerl/core/error.hpp"
#include "moerl/text/verifier.hpp"

namespace moerl::text {
namespace {

Example game(std::vector<int64_t> nums, int64_t target) {
    Example ex;
    ex.where = "countdown.jsonl:1";
    ex.fields = {{"prompt", "make the target"}, {"nums", nums}, {"target", target}};
    return ex;
}

struct Case {
    std::string response;
    std::vector<int64_t> nums;
    int64_t target;
    double reward;
    const char* error;  // a part of details.error when the reward is 0 (nullptr: do not check)
};

TEST(CountdownVerifier, Table) {
    const std::vector<Case> cases = {
        {"<answer>2*(3+4)</answer>", {2, 3, 4}, 14, 1, nullptr},
        {"<think>try</think> <answer> (3 + 4) * 2 = 14 </answer>", {2, 3, 4}, 14, 1, nullptr},
        {"<answer>(3+4)*2</answer> no wait <answer>3*4+2</answer>",
         {2, 3, 4},
         14,
         1,
         nullptr},                                                       // the last tag
        {"Let me think.\nSo: 2*(3+4) = 14", {2, 3, 4}, 14, 1, nullptr},  // the last line
        {R"(\boxed{2 \times (3+4)})", {2, 3, 4}, 14, 1, nullptr},
        {"<answer>2\u00D7(3+4)</answer>", {2, 3, 4}, 14, 1, nullptr},
        {"<answer>(4 - 2) * 3</answer>", {2, 3, 4}, 6, 1, nullptr},
        {"<answer>3*4+2</answer>", {2, 3, 4}, 15, 0, "reaches 14, not the target"},
        // each number exactly once (use_all)
        {"<answer>2*(3+4)+2-2</answer>", {2, 3, 4}, 14, 0, "uses 2 more often than it is given"},
        {"<answer>3+4</answer>", {2, 3, 4}, 7, 0, "does not use [2]"},
        {"<answer>7*2</answer>", {2, 3, 4}, 14, 0, "uses 7, which is not among the numbers"},
        {"<answer>2+2</answer>", {2, 2}, 4, 1, nullptr},  // a number given twice may be used twice
        // exact fractions: non-integer intermediate results are allowed by default
        {"<answer>6/(1-3/4)</answer>", {1, 3, 4, 6}, 24, 1, nullptr},
        {"<answer>4/(2-2)</answer>", {4, 2, 2}, 1, 0, "division by zero"},
        {"<answer>(3/2)*4</answer>", {2, 3, 4}, 6, 1, nullptr},
        // what the grammar refuses
        {"<answer>-3+5</answer>", {3, 5}, 2, 0, "unary '-' is not allowed"},
        {"<answer>2**3</answer>", {2, 3}, 8, 0, "unexpected '*'"},
        {"<answer>2.5*2</answer>", {2, 2}, 5, 0, "only integers"},
        {"<answer>__import__('os').system('true')</answer>", {1}, 1, 0, "unexpected '_'"},
        {"<answer>(2+3</answer>", {2, 3}, 5, 0, "missing ')'"},
        {"<answer>2+</answer>", {2}, 2, 0, "ends early"},
        {"<answer>" + std::string(200, '(') + "1" + std::string(200, ')') + "</answer>",
         {1},
         1,
         0,
         "nested deeper"},
        {"<answer>" + std::string(3000, '1') + "</answer>", {1}, 1, 0, "longer than"},
        {"<answer>9223372036854775807*9223372036854775807*9223372036854775807</answer>",
         {9223372036854775807LL, 9223372036854775807LL, 9223372036854775807LL},
         1,
         0,
         "overflow"},
        {"I give up.", {2, 3}, 5, 0, "no expression found"},
        {"", {2, 3}, 5, 0, "no expression found"},
    };
    auto v = make_verifier(VerifierSpec{.kind = "countdown"});
    for (const auto& c : cases) {
        const Verdict got = v->score(c.response, game(c.nums, c.target));
        SCOPED_TRACE(c.response.substr(0, 120) + "\ndetails: " + got.details.dump());
        EXPECT_EQ(got.reward, c.reward);
        if (c.error != nullptr) {
            ASSERT_TRUE(got.details.contains("error"));
            EXPECT_NE(got.details["error"].get<std::string>().find(c.error), std::string::npos);
        }
    }
}

TEST(CountdownVerifier, Options) {
    VerifierSpec spec{.kind = "countdown"};
    spec.countdown.use_all = false;
    EXPECT_EQ(make_verifier(spec)->score("<answer>3+4</answer>", game({2, 3, 4}, 7)).reward, 1);
    spec.countdown.integer_only = true;
    const Verdict v = make_verifier(spec)->score("<answer>6/(1-3/4)</answer>", game({1, 3, 4, 6}, 24));
    EXPECT_EQ(v.reward, 0);
    EXPECT_NE(v.details.at("error").get<std::string>().find("non-integer intermediate result 3/4"),
              std::string::npos);
    spec.countdown.numbers_field = "numbers";
    Example ex;
    ex.where = "c.jsonl:9";
    ex.fields = {{"numbers", {1, 2}}, {"target", 3}};
    EXPECT_EQ(make_verifier(spec)->score("1+2", ex).reward, 1);
}

TEST(CountdownVerifier, BadMetadataIsAnErrorNamingTheExample) {
    auto v = make_verifier(VerifierSpec{.kind = "countdown"});
    Example ex;
    ex.where = "c.jsonl:4";
    ex.fields = {{"nums", {"1", "2"}}, {"target", 3}};
    try {
        v->score("1+2", ex);
        FAIL() << "scored with string numbers";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("c.jsonl:4: \"nums\" must hold integers"), std::string::npos)
            << e.message();
    }
    ex.fields = {{"nums", {1, 2}}};
    EXPECT_THROW(v->score("1+2", ex), Error);
}

}  // namespace
}  // namespace moerl::text
