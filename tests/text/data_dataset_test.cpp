// JSONL datasets: parsing, errors with file:line, shuffles by seed, eval splits, resume, streaming.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "data_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/text/dataset.hpp"

namespace moerl::text {
namespace {

using testing::ScratchDir;

std::string numbered_lines(int n) {
    std::string s;
    for (int i = 0; i < n; ++i)
        s += R"({"prompt": "q)" + std::to_string(i) + R"(", "answer": ")" + std::to_string(i) + "\"}\n";
    return s;
}

// The error message of opening `text` as a dataset, or "" when it opens.
std::string open_error(const ScratchDir& dir, const std::string& text, JsonlFormat format = {}) {
    const std::string path = dir.write("bad.jsonl", text);
    return testing::error_of([&] { JsonlFile f(path, format); });
}

// Options for a file of `n` numbered examples.
DatasetOptions numbered(const ScratchDir& dir, int n, uint64_t seed = 0) {
    DatasetOptions o;
    o.path = dir.write("d.jsonl", numbered_lines(n));
    o.seed = seed;
    return o;
}

TEST(Jsonl, ReadsPromptAnswerMessagesAndMetadata) {
    ScratchDir dir;
    const std::string path =
        dir.write("d.jsonl",
                  "{\"prompt\": \"2+2?\", \"answer\": 4, \"level\": 1}\n"
                  "\n"
                  "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"answer\": \"x\", "
                  "\"id\": \"ex-7\"}\r\n"
                  "{\"prompt\": \"no newline at the end\", \"answer\": \"1.5\"}");
    JsonlFile f(path);
    ASSERT_EQ(f.size(), 3u);
    Example a = f.read(0);
    EXPECT_EQ(a.prompt, "2+2?");
    EXPECT_EQ(a.answer, "4");
    EXPECT_EQ(a.fields.at("level"), 1);
    EXPECT_EQ(a.where, path + ":1");
    EXPECT_EQ(a.id, path + ":1");
    Example b = f.read(1);
    EXPECT_TRUE(b.prompt.empty());
    ASSERT_TRUE(b.messages.is_array());
    EXPECT_EQ(b.messages[0].at("content"), "hi");
    EXPECT_EQ(b.id, "ex-7");
    EXPECT_EQ(b.where, path + ":3");  // the blank line 2 is skipped but counted
    EXPECT_EQ(f.read(2).answer, "1.5");
    EXPECT_EQ(f.line_number(2), 4u);
}

TEST(Jsonl, ByteOrderMarkAndConfigurableFieldNames) {
    ScratchDir dir;
    JsonlFormat fmt;
    fmt.prompt_field = "question";
    fmt.answer_field = "solution";
    const std::string path =
        dir.write("d.jsonl", "\xEF\xBB\xBF{\"question\": \"q\", \"solution\": \"#### 3\"}\n");
    JsonlFile f(path, fmt);
    EXPECT_EQ(f.read(0).prompt, "q");
    EXPECT_EQ(f.read(0).answer, "#### 3");
    EXPECT_NE(open_error(dir, "{\"prompt\": \"q\", \"answer\": \"1\"}\n", fmt).find("no \"question\""),
              std::string::npos);
}

TEST(Jsonl, MalformedLinesNameFileAndLine) {
    ScratchDir dir;
    const std::string good = "{\"prompt\": \"p\", \"answer\": \"1\"}\n";
    struct Case {
        std::string text;
        std::string line;  // ":N" expected in the message
        std::string what;  // and this
    };
    const std::vector<Case> cases = {
        {good + good + "{\"prompt\": \"p\", \"answer\": }\n", ":3", "not valid JSON"},
        {good + "{\"prompt\": \"unterminated}\n", ":2", "not valid JSON"},
        {"[1, 2]\n", ":1", "expected a JSON object, got array"},
        {good + "{\"answer\": \"1\"}\n", ":2", "no \"prompt\" and no \"messages\""},
        {"{\"prompt\": 5, \"answer\": \"1\"}\n", ":1", "\"prompt\" must be a string, got number"},
        {"{\"prompt\": \"p\", \"answer\": [1]}\n", ":1",
         "\"answer\" must be a string or a number, got array"},
        {"{\"prompt\": \"p\"}\n", ":1", "no \"answer\" field"},
        {"{\"messages\": \"hi\", \"answer\": \"1\"}\n", ":1", "\"messages\" must be a non-empty array"},
        {"{\"messages\": [], \"answer\": \"1\"}\n", ":1", "got an empty array"},
        {"{\"messages\": [{\"content\": \"hi\"}], \"answer\": \"1\"}\n", ":1", "needs a string \"role\""},
        {"{\"prompt\": \"p\", \"messages\": [], \"answer\": \"1\"}\n", ":1", "both"},
        {good + "\n\n{\"prompt\": \"p\", \"answer\": \"1\", \"id\": [1]}\n", ":4", "\"id\" must be a string"},
        {"{\"prompt\": \"\xff\", \"answer\": \"1\"}\n", ":1", "not valid JSON"},
    };
    for (const auto& c : cases) {
        const std::string msg = open_error(dir, c.text);
        SCOPED_TRACE(c.text);
        EXPECT_NE(msg.find(dir.path("bad.jsonl") + c.line + ":"), std::string::npos) << msg;
        EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
    }
}

TEST(Jsonl, EmptyAndMissingFiles) {
    ScratchDir dir;
    EXPECT_NE(open_error(dir, "").find("holds no examples (the file is empty)"), std::string::npos);
    EXPECT_NE(open_error(dir, "\n  \n\r\n").find("only blank lines"), std::string::npos);
    const std::string m = testing::error_of([&] { JsonlFile f(dir.path("missing.jsonl")); });
    EXPECT_NE(m.find("missing.jsonl': No such file"), std::string::npos) << m;
}

TEST(Jsonl, WithoutValidationErrorsComeAtReadWithTheLine) {
    ScratchDir dir;
    const std::string path = dir.write("d.jsonl", numbered_lines(2) + "\n{oops\n" + numbered_lines(1));
    JsonlFile f(path, {}, /*validate=*/false);
    ASSERT_EQ(f.size(), 4u);
    EXPECT_EQ(f.read(3).prompt, "q0");
    try {
        f.read(2);
        FAIL() << "read a malformed line";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find(path + ":4: not valid JSON"), std::string::npos) << e.message();
    }
}

TEST(Permute, IsABijectionForManySizesAndKeys) {
    for (uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 100ull, 257ull, 1000ull, 4097ull}) {
        for (uint64_t key : {0ull, 1ull, 0xDEADBEEFull}) {
            std::vector<bool> seen(n, false);
            for (uint64_t i = 0; i < n; ++i) {
                const uint64_t p = permute(i, n, key);
                ASSERT_LT(p, n);
                ASSERT_FALSE(seen[p]) << "n=" << n << " key=" << key << " i=" << i;
                seen[p] = true;
            }
        }
    }
    // A shuffle moves most elements: fewer than 5% fixed points on 1000 elements.
    int fixed = 0;
    for (uint64_t i = 0; i < 1000; ++i) fixed += permute(i, 1000, 42) == i;
    EXPECT_LT(fixed, 50);
    EXPECT_THROW(permute(5, 5, 0), Error);
}

std::vector<std::string> read_prompts(const Dataset& d, DataPosition pos, int count) {
    std::vector<std::string> out;
    for (int i = 0; i < count; ++i) {
        auto ex = d.next(pos);
        if (!ex) break;
        out.push_back(ex->prompt);
    }
    return out;
}

TEST(Dataset, ShuffleIsDeterministicBySeedAndEachEpochIsAPermutation) {
    ScratchDir dir;
    DatasetOptions o = numbered(dir, 50, 7);
    const auto a = read_prompts(Dataset(o), {}, 100);
    const auto b = read_prompts(Dataset(o), {}, 100);
    EXPECT_EQ(a, b);
    o.seed = 8;
    const auto c = read_prompts(Dataset(o), {}, 100);
    EXPECT_NE(a, c);
    const std::vector<std::string> epoch0(a.begin(), a.begin() + 50), epoch1(a.begin() + 50, a.end());
    EXPECT_NE(epoch0, epoch1);  // each epoch has its own order
    for (const auto& e : {epoch0, epoch1}) {
        std::set<std::string> distinct(e.begin(), e.end());
        EXPECT_EQ(distinct.size(), 50u);
    }
    o.shuffle = false;
    const auto in_order = read_prompts(Dataset(o), {}, 3);
    EXPECT_EQ(in_order, (std::vector<std::string>{"q0", "q1", "q2"}));
}

TEST(Dataset, EpochsEndTheStreamAndAdvanceMatchesNext) {
    ScratchDir dir;
    DatasetOptions o = numbered(dir, 7);
    o.epochs = 2;
    Dataset d(o);
    EXPECT_EQ(read_prompts(d, {}, 100).size(), 14u);
    DataPosition pos;
    for (int i = 0; i < 9; ++i) d.next(pos);
    EXPECT_EQ(pos, d.advance({}, 9));
    EXPECT_EQ(pos, (DataPosition{1, 2}));
    EXPECT_THROW(d.train({2, 0}), Error);
    EXPECT_THROW(d.train({0, 7}), Error);
}

TEST(Dataset, HeldOutEvalSplitIsDisjointAndFixed) {
    ScratchDir dir;
    DatasetOptions o = numbered(dir, 100, 3);
    o.eval_fraction = 0.1;
    Dataset d(o);
    ASSERT_EQ(d.train_size(), 90u);
    ASSERT_EQ(d.eval_size(), 10u);
    std::set<std::string> eval, train;
    for (uint64_t i = 0; i < d.eval_size(); ++i) eval.insert(d.eval(i).prompt);
    for (const auto& p : read_prompts(d, {}, 90)) train.insert(p);
    for (const auto& p : read_prompts(d, {5, 0}, 90)) EXPECT_EQ(eval.count(p), 0u) << p;
    EXPECT_EQ(eval.size(), 10u);
    EXPECT_EQ(train.size(), 90u);
    for (const auto& p : eval) EXPECT_EQ(train.count(p), 0u) << p;
    o.eval_limit = 4;
    EXPECT_EQ(Dataset(o).eval_size(), 4u);
    EXPECT_EQ(Dataset(o).eval(3).prompt, d.eval(3).prompt);
    o.path = dir.write("one.jsonl", numbered_lines(1));  // holding out one leaves none to train on
    o.eval_fraction = 0.5;
    EXPECT_THROW(Dataset{o}, Error);
}

TEST(Dataset, SeparateEvalFileInFileOrder) {
    ScratchDir dir;
    DatasetOptions o;
    o.path = dir.write("train.jsonl", numbered_lines(20));
    o.eval_path = dir.write(
        "eval.jsonl", "{\"prompt\": \"e0\", \"answer\": \"0\"}\n{\"prompt\": \"e1\", \"answer\": \"1\"}\n");
    Dataset d(o);
    EXPECT_EQ(d.train_size(), 20u);
    ASSERT_EQ(d.eval_size(), 2u);
    EXPECT_EQ(d.eval(0).prompt, "e0");
    EXPECT_EQ(d.eval(1).where, o.eval_path + ":2");
    o.eval_fraction = 0.5;
    EXPECT_THROW(Dataset{o}, Error);  // both given
    o.eval_fraction = 0;
    o.eval_path.clear();
    o.eval_every = 10;
    EXPECT_NE(testing::error_of([&] { Dataset{o}; }).find("data.eval_every = 10 but there is no eval split"),
              std::string::npos);
}

TEST(Dataset, ResumedFromAStoredPositionContinuesExactly) {
    ScratchDir dir;
    DatasetOptions o = numbered(dir, 23, 11);
    const auto whole = read_prompts(Dataset(o), {}, 60);
    std::string saved;
    {
        Dataset d(o);
        DataPosition pos;
        for (int i = 0; i < 37; ++i) d.next(pos);
        saved = d.state(pos).dump();
    }
    Dataset resumed(o);
    const DataPosition pos = resumed.restore(nlohmann::json::parse(saved));
    EXPECT_EQ(pos, (DataPosition{1, 14}));
    const auto rest = read_prompts(resumed, pos, 23);
    EXPECT_EQ(rest, std::vector<std::string>(whole.begin() + 37, whole.end()));

    o.seed = 12;
    EXPECT_THROW(Dataset(o).restore(nlohmann::json::parse(saved)), Error);
    o.seed = 11;
    o.path = dir.write("other.jsonl", numbered_lines(24));
    const std::string m = testing::error_of([&] { Dataset(o).restore(nlohmann::json::parse(saved)); });
    EXPECT_NE(m.find("made with 23 training examples"), std::string::npos) << m;
    EXPECT_THROW(Dataset(o).restore(nlohmann::json{{"epoch", 1}}), Error);
}

TEST(Dataset, LargeFileIsIndexedNotLoaded) {
    ScratchDir dir;
    const std::string path = dir.path("big.jsonl");
    const int n = 100000;
    const std::string pad(400, 'x');  // ~450 bytes a line: a 45 MB file
    {
        std::ofstream out(path);
        for (int i = 0; i < n; ++i)
            out << R"({"prompt": "q)" << i << R"(", "answer": ")" << i << R"(", "pad": ")" << pad << "\"}\n";
    }
    DatasetOptions o;
    o.path = path;
    Dataset d(o);
    ASSERT_EQ(d.train_size(), static_cast<uint64_t>(n));
    // The index holds 8 bytes an example and nothing of the text.
    EXPECT_LE(d.index_bytes(), 8u * n + 64);
    JsonlFile f(path, {}, false);
    EXPECT_GT(f.file_bytes(), 100u * d.index_bytes() / 2);
    EXPECT_EQ(f.read(n - 1).prompt, "q" + std::to_string(n - 1));
    EXPECT_EQ(f.read(n / 2).answer, std::to_string(n / 2));
    std::set<std::string> first;
    for (const auto& p : read_prompts(d, {}, 1000)) first.insert(p);
    EXPECT_EQ(first.size(), 1000u);
}

}  // namespace
}  // namespace moerl::text
