// The math verifier: final-answer extraction and numeric equivalence, as tables of tricky cases.
#include "moerl/text/verifier_math.hpp"

#include <gtest/gtest.h>

#include "data_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/text/verifier.hpp"

namespace moerl::text {
namespace {

using testing::with_answer;

struct Case {
    const char* response;
    const char* answer;
    double reward;
};

TEST(MathVerifier, Table) {
    const std::vector<Case> cases = {
        // fractions, decimals, \frac and friends
        {R"(So the result is \boxed{\frac{1}{2}}.)", "0.5", 1},
        {R"(\boxed{0.5})", R"(\frac{1}{2})", 1},
        {R"(\boxed{\dfrac{3}{4}})", "0.75", 1},
        {R"(\boxed{\tfrac{6}{8}})", "3/4", 1},
        {R"(\boxed{\frac12})", "0.5", 1},
        {R"(\boxed{2/4})", "1/2", 1},
        {R"(\boxed{0.333})", "1/3", 0},
        {R"(\boxed{3.0})", "3", 1},
        {R"(\boxed{3.10})", "3.1", 1},
        {R"(\boxed{1\frac{1}{2}})", "1.5", 1},  // a mixed number
        {R"(\boxed{1/0})", "0", 0},
        // signs
        {R"(\boxed{-5})", "-5", 1},
        {R"(\boxed{5})", "-5", 0},
        {R"(\boxed{-\frac{1}{2}})", "-0.5", 1},
        {R"(\boxed{\frac{-1}{2}})", "-1/2", 1},
        {"The temperature fell to \u22127 degrees.", "-7", 1},  // Unicode minus
        {"x-5 is what we want, so 3-2=1", "1", 1},              // '-' after a word or digit is not a sign
        // thousands separators
        {"1,234", "1234", 1},
        {"The total is 1,234.", "1234", 1},
        {"The answer is 1,000,000", "1000000", 1},
        {R"(\boxed{1{,}234})", "1234", 1},
        {R"(\boxed{1,234.5})", "1234.5", 1},
        // GSM8K style
        {"#### 72", "72", 1},
        {"She sold 48/2 = 24 in May.\n#### 72\n", "72", 1},
        {"The answer is 72.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1},
        {"#### $1,000", "1000", 1},
        // the last number when nothing marks the answer
        {"3 + 4 = 7, then 7 * 2 = 14", "14", 1},
        {"3 + 4 = 7, then 7 * 2 = 14", "7", 0},
        {"The answer is 19.", "19", 1},
        {"I do not know.", "19", 0},
        {"", "19", 0},
        // the last \boxed{} wins; nested braces; a broken one falls back to the last number
        {R"(First \boxed{3}, then correcting myself: \boxed{4})", "4", 1},
        {R"(\boxed{\frac{\sqrt{4}}{2}})", R"(\frac{\sqrt{4}}{2})", 1},
        {R"(\boxed{{12}})", "12", 1},
        {R"(\boxed{5 and then)", "5", 1},
        {R"(\boxed 7)", "7", 1},
        {R"(\fbox{7})", "7", 1},
        {"\\boxed{7}", "\\boxed{7}", 1},
        // units and currency stripped
        {R"(\boxed{\$18})", "18", 1},
        {"It costs $18.00", "18", 1},
        {R"(\boxed{18 \text{ dollars}})", "18", 1},
        {R"(\boxed{19\text{ apples}})", "19", 1},
        {R"(\boxed{10cm})", "10", 1},
        {R"(\boxed{90^\circ})", "90", 1},
        {R"(\boxed{x = 5})", "5", 1},
        {R"(\boxed{2x})", "2", 0},  // algebra, not a unit
        // percentages: 50% equals 50 and 0.5
        {R"(\boxed{50\%})", "50", 1},
        {"50%", "0.5", 1},
        {R"(\boxed{50 percent})", "0.5", 1},
        {"25%", "50", 0},
        // exact big integers
        {"12345678901234567890", "12345678901234567891", 0},
        {"12345678901234567890", "12345678901234567890", 1},
        // answers that are not numbers compare as text
        {R"(\boxed{\sqrt{2}})", R"(\sqrt{2})", 1},
        {R"(\boxed{\sqrt{3}})", R"(\sqrt{2})", 0},
        {R"(\boxed{ \sqrt{2} })", R"(\sqrt {2})", 1},
        {R"(\boxed{4})", R"(\sqrt{2})", 0},
    };
    auto v = make_verifier(VerifierSpec{.kind = "math"});
    for (const auto& c : cases) {
        const Verdict got = v->score(c.response, with_answer(c.answer));
        EXPECT_EQ(got.reward, c.reward)
            << "response: " << c.response << "\nanswer: " << c.answer << "\ndetails: " << got.details.dump();
    }
}

TEST(MathVerifier, DetailsSayWhatWasCompared) {
    auto v = make_verifier(VerifierSpec{.kind = "math"});
    Verdict a = v->score("so \\boxed{18}", with_answer("#### 18"));
    EXPECT_EQ(a.details.at("answer"), "18");
    EXPECT_EQ(a.details.at("source"), "boxed");
    EXPECT_EQ(a.details.at("expected"), "18");
    Verdict b = v->score("no idea", with_answer("18"));
    EXPECT_EQ(b.reward, 0);
    EXPECT_EQ(b.details.at("error"), "no final answer found");
    // Invalid UTF-8 in a response still gives details that serialise.
    Verdict c = v->score("\xff\xfe 12", with_answer("12"));
    EXPECT_EQ(c.reward, 1);
    EXPECT_NO_THROW(c.details.dump());
}

TEST(MathVerifier, ToleranceIsOptIn) {
    VerifierSpec spec{.kind = "math"};
    spec.math.relative_tolerance = 1e-2;
    EXPECT_EQ(make_verifier(spec)->score("0.333", with_answer("1/3")).reward, 1);
    spec.math.relative_tolerance = -1;
    EXPECT_THROW(make_verifier(spec), Error);
}

TEST(MathAnswer, Extraction) {
    using math::extract_final_answer;
    EXPECT_EQ(extract_final_answer(R"(a \boxed{\frac{a}{\{b\}}} c)")->text, R"(\frac{a}{\{b\}})");
    EXPECT_EQ(extract_final_answer("#### 12 apples\nmore text 99")->text, "12 apples");
    EXPECT_EQ(extract_final_answer("#### 12 apples\nmore text 99")->source, "####");
    EXPECT_EQ(extract_final_answer("about 3/4 of them, i.e. 0.75")->text, "0.75");
    EXPECT_EQ(extract_final_answer("about 3/4 of them")->text, "3/4");
    EXPECT_EQ(extract_final_answer("we get \\frac{2}{3} here")->text, "\\frac{2}{3}");
    EXPECT_EQ(extract_final_answer("it is -12 degrees")->text, "-12");
    EXPECT_EQ(extract_final_answer("it rose 40%")->text, "40%");
    EXPECT_EQ(extract_final_answer("value.5")->text, ".5");
    EXPECT_FALSE(extract_final_answer("no digits here").has_value());
    EXPECT_EQ(math::reference_answer("work...\n#### 1,234"), "1,234");
}

TEST(MathAnswer, ParseNumber) {
    auto n = math::parse_number("-1,234.50");
    ASSERT_TRUE(n);
    EXPECT_EQ(n->str(), "-2469/2");
    EXPECT_EQ(math::parse_number("\\frac{3}{6}")->str(), "1/2");
    EXPECT_TRUE(math::parse_number("50%")->percent);
    EXPECT_FALSE(math::parse_number("1,23").has_value());
    EXPECT_FALSE(math::parse_number("x+1").has_value());
    EXPECT_FALSE(math::parse_number("5 + 3").has_value());
    // More digits than 128 bits hold: compared approximately.
    auto big = math::parse_number(std::string(50, '9'));
    ASSERT_TRUE(big);
    EXPECT_FALSE(big->exact);
    EXPECT_TRUE(math::answers_equal(std::string(50, '9'), std::string(50, '9')));
}

}  // namespace
}  // namespace moerl::text
