// The example dataset in examples/data: it loads, every answer checks, and all levels are there.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "moerl/text/dataset.hpp"
#include "moerl/text/verifier.hpp"

namespace moerl::text {
namespace {

TEST(ExampleData, ArithmeticProblemsLoadAndTheirAnswersVerify) {
    DatasetOptions o;
    o.path = MOERL_SOURCE_DIR "/examples/data/arith.jsonl";
    o.eval_path = MOERL_SOURCE_DIR "/examples/data/arith_eval.jsonl";
    Dataset d(o);
    EXPECT_GE(d.train_size(), 1000u);
    EXPECT_GE(d.eval_size(), 100u);
    auto math = make_verifier(VerifierSpec{.kind = "math"});
    std::map<int, int> per_level;
    std::set<std::string> train_prompts;
    DataPosition pos;
    for (uint64_t i = 0; i < d.train_size(); ++i) {
        const Example ex = *d.next(pos);
        train_prompts.insert(ex.prompt);
        ++per_level[ex.fields.at("level").get<int>()];
        ASSERT_EQ(math->score("The answer is " + ex.answer + ".", ex).reward, 1.0) << ex.where;
        ASSERT_EQ(math->score("The answer is " + ex.answer + "1.", ex).reward, 0.0) << ex.where;
    }
    EXPECT_EQ(per_level.size(), 5u);
    EXPECT_GT(per_level[1], per_level[5]);  // the easiest level is the most common
    for (uint64_t i = 0; i < d.eval_size(); ++i) EXPECT_EQ(train_prompts.count(d.eval(i).prompt), 0u);
}

}  // namespace
}  // namespace moerl::text
