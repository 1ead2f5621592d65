// The external verifier against real python3 programs: the happy path, crashes, hangs, bad answers.
#include "moerl/text/verifier_external.hpp"

#include <gtest/gtest.h>

#include <chrono>

#include "data_util.hpp"
#include "moerl/core/error.hpp"

namespace moerl::text {
namespace {

using testing::ScratchDir;

// A verifier program: reward 1 when the response equals the example's answer. `extra` runs first for
// each item, with `item` (the request) and `count` (items this process has read) defined.
std::string program(const std::string& extra = "") {
    return "import json, os, sys, time\n"
           "count = 0\n"
           "for line in sys.stdin:\n"
           "    item = json.loads(line)\n"
           "    count += 1\n" +
           extra +
           "    ok = item['response'] == item['example']['answer']\n"
           "    print(json.dumps({'id': item['id'], 'reward': 1.0 if ok else 0.0, 'details': {'pid': "
           "os.getpid()}}),"
           " flush=True)\n";
}

std::vector<Example> examples(int n) {
    std::vector<Example> out;
    for (int i = 0; i < n; ++i) {
        Example ex;
        ex.where = "items.jsonl:" + std::to_string(i + 1);
        ex.answer = std::to_string(i);
        ex.fields = {{"prompt", "q" + std::to_string(i)}, {"answer", ex.answer}};
        out.push_back(ex);
    }
    return out;
}

// Responses: right for even items, wrong for odd ones (unless `responses` says otherwise).
std::vector<std::string> responses(int n) {
    std::vector<std::string> out;
    for (int i = 0; i < n; ++i) out.push_back(i % 2 == 0 ? std::to_string(i) : "wrong");
    return out;
}

std::vector<Scoring> batch_of(const std::vector<std::string>& r, const std::vector<Example>& ex) {
    std::vector<Scoring> out;
    for (size_t i = 0; i < r.size(); ++i) out.push_back({r[i], &ex[i]});
    return out;
}

ExternalOptions options(const ScratchDir& dir, const std::string& code, double timeout_s = 10) {
    ExternalOptions o;
    o.command = {"python3", dir.write("verifier.py", code)};
    o.timeout_s = timeout_s;
    o.startup_timeout_s = 5;  // python3's start on a busy machine
    return o;
}

void expect_even_right(const std::vector<Verdict>& got) {
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].reward, i % 2 == 0 ? 1.0 : 0.0) << "item " << i;
}

TEST(ExternalVerifier, ScoresBatchesThroughOneProcess) {
    ScratchDir dir;
    ExternalVerifier v(options(dir, program()));
    const auto ex = examples(200);
    const auto r = responses(200);
    const auto first = v.score_batch(batch_of(r, ex));
    ASSERT_EQ(first.size(), 200u);
    expect_even_right(first);
    const auto second = v.score_batch(batch_of(r, ex));
    expect_even_right(second);
    EXPECT_EQ(first[0].details.at("pid"), second[199].details.at("pid"));  // kept running
    EXPECT_EQ(v.score("3", ex[3]).reward, 1.0);
    EXPECT_EQ(v.stats().items, 401u);
    EXPECT_EQ(v.stats().restarts, 0u);
}

TEST(ExternalVerifier, AnswersOutOfOrderAreMatchedById) {
    ScratchDir dir;
    // Answers each pair of items in reverse order.
    const std::string code =
        "import json, sys\n"
        "held = None\n"
        "for line in sys.stdin:\n"
        "    item = json.loads(line)\n"
        "    if held is None:\n"
        "        held = item\n"
        "        continue\n"
        "    for it in (item, held):\n"
        "        ok = it['response'] == it['example']['answer']\n"
        "        print(json.dumps({'id': it['id'], 'reward': 1 if ok else 0}), flush=True)\n"
        "    held = None\n";
    ExternalVerifier v(options(dir, code));
    const auto ex = examples(10);
    expect_even_right(v.score_batch(batch_of(responses(10), ex)));
}

TEST(ExternalVerifier, ShellCommandLine) {
    ScratchDir dir;
    ExternalOptions o = options(dir, program());
    o.command = {"python3 " + o.command[1]};  // one string with a space: run by /bin/sh -c
    ExternalVerifier v(o);
    const auto ex = examples(4);
    expect_even_right(v.score_batch(batch_of(responses(4), ex)));
}

TEST(ExternalVerifier, CrashOnEveryThirdItemIsRestartedAndLosesNothing) {
    ScratchDir dir;
    ExternalVerifier v(options(dir, program("    if count == 3:\n        sys.exit(3)\n")));
    const auto ex = examples(10);
    const auto got = v.score_batch(batch_of(responses(10), ex));
    ASSERT_EQ(got.size(), 10u);
    expect_even_right(got);
    // Each process answers two items and dies on its third: items 2, 4, 6 and 8 each cost a restart.
    EXPECT_EQ(v.stats().restarts, 4u);
    EXPECT_EQ(v.stats().items, 10u);
}

TEST(ExternalVerifier, AnItemThatCrashesItTwiceIsAnErrorNamingIt) {
    ScratchDir dir;
    ExternalVerifier v(options(dir, program("    if item['response'] == 'poison':\n"
                                            "        print('poison pill', file=sys.stderr, flush=True)\n"
                                            "        sys.exit(5)\n")));
    const auto ex = examples(6);
    auto r = responses(6);
    r[4] = "poison";
    try {
        v.score_batch(batch_of(r, ex));
        FAIL() << "scored a batch whose item 4 always crashes the program";
    } catch (const Error& e) {
        const std::string m = e.message();
        EXPECT_NE(m.find("external verifier 'python3 "), std::string::npos) << m;
        EXPECT_NE(m.find("exited with status 5 on item 4 (items.jsonl:5) a second time"), std::string::npos)
            << m;
        EXPECT_NE(m.find("poison pill"), std::string::npos) << m;
    }
    EXPECT_EQ(v.stats().restarts, 1u);
    // The next batch starts a fresh process.
    r[4] = "4";
    expect_even_right(v.score_batch(batch_of(r, ex)));
}

TEST(ExternalVerifier, KilledBySignal) {
    ScratchDir dir;
    ExternalVerifier v(options(dir, program("    if count == 1:\n        os.kill(os.getpid(), 11)\n")));
    const auto ex = examples(1);
    const std::string m = testing::error_of([&] { v.score("0", ex[0]); });
    EXPECT_NE(m.find("was killed by signal 11"), std::string::npos) << m;
}

TEST(ExternalVerifier, HangIsTimedOutAndRetriedOnce) {
    ScratchDir dir;
    // The first process hangs on item 1; the restarted one answers it.
    const std::string marker = dir.path("hung-once");
    ExternalVerifier v(
        options(dir,
                program("    if item['example']['answer'] == '1' and not os.path.exists('" + marker +
                        "'):\n"
                        "        open('" +
                        marker +
                        "', 'w').close()\n"
                        "        time.sleep(60)\n"),
                0.5));
    const auto ex = examples(4);
    expect_even_right(v.score_batch(batch_of(responses(4), ex)));
    EXPECT_EQ(v.stats().restarts, 1u);
    EXPECT_EQ(v.stats().items, 4u);
}

TEST(ExternalVerifier, HangTwiceIsATimeoutError) {
    ScratchDir dir;
    ExternalVerifier v(
        options(dir, program("    if item['response'] == 'slow':\n        time.sleep(60)\n"), 0.3));
    const auto ex = examples(3);
    auto r = responses(3);
    r[1] = "slow";
    const auto start = std::chrono::steady_clock::now();
    try {
        v.score_batch(batch_of(r, ex));
        FAIL() << "scored a batch with an item that hangs";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("gave no answer within 0.3"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("on item 1 (items.jsonl:2) a second time"), std::string::npos)
            << e.message();
    }
    // Two attempts of 0.3 s, not the program's 60 s sleep.
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(ExternalVerifier, RestartsInARowAreBounded) {
    ScratchDir dir;
    ExternalOptions o = options(dir, "import sys\nsys.exit(1)\n");
    o.max_restarts = 0;
    ExternalVerifier v(o);
    const auto ex = examples(1);
    const std::string m = testing::error_of([&] { v.score("0", ex[0]); });
    EXPECT_NE(m.find("exited with status 1"), std::string::npos) << m;
    EXPECT_NE(m.find("max_restarts"), std::string::npos) << m;
}

TEST(ExternalVerifier, ProtocolErrors) {
    ScratchDir dir;
    const auto ex = examples(2);
    struct Case {
        std::string code;
        std::string what;
    };
    const std::vector<Case> cases = {
        {"import sys\nfor line in sys.stdin:\n    print('hello', flush=True)\n",
         "not JSON in the answer line 'hello'"},
        {"import json, sys\nfor line in sys.stdin:\n    i = json.loads(line)\n"
         "    print(json.dumps({'id': i['id'], 'reward': 2}), flush=True)\n",
         "no reward in [0, 1] for item 0"},
        {"import json, sys\nfor line in sys.stdin:\n    i = json.loads(line)\n"
         "    print(json.dumps({'id': i['id'], 'reward': 1}), flush=True)\n"
         "    print(json.dumps({'id': i['id'], 'reward': 1}), flush=True)\n",
         "an answer for item 0 that was already answered"},
        {"import json, sys\nfor line in sys.stdin:\n    print(json.dumps({'id': 99, 'reward': 1}), "
         "flush=True)\n",
         "an answer for item 99 that was never sent"},
    };
    for (const auto& c : cases) {
        SCOPED_TRACE(c.code);
        ExternalVerifier v(options(dir, c.code));
        try {
            v.score_batch(batch_of({"0", "1"}, ex));
            FAIL() << "accepted a bad answer";
        } catch (const Error& e) {
            EXPECT_NE(e.message().find(c.what), std::string::npos) << e.message();
        }
    }
}

TEST(ExternalVerifier, ProgramThatCannotStart) {
    ExternalOptions o;
    o.command = {"/nonexistent/verifier"};
    try {
        ExternalVerifier v(o);
        FAIL() << "started a missing program";
    } catch (const Error& e) {
        EXPECT_NE(
            e.message().find("external verifier '/nonexistent/verifier': cannot start it: No such file"),
            std::string::npos)
            << e.message();
    }
    o.command = {};
    EXPECT_THROW(ExternalVerifier{o}, Error);
    o.command = {"true"};
    o.timeout_s = 0;
    EXPECT_THROW(ExternalVerifier{o}, Error);
}

}  // namespace
}  // namespace moerl::text
