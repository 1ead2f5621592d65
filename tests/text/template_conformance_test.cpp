// Every case template_reference.mjs rendered with @huggingface/jinja, rendered again here and
// compared byte for byte: the real Qwen3, DeepSeek-V3 and Llama 3 templates over conversations
// (through ChatTemplate, as an RL run formats prompts) and focused cases of each construct.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "moerl/text/chat_template.hpp"

namespace {

using moerl::text::ChatTemplate;
using moerl::text::ChatTemplateOptions;
using nlohmann::ordered_json;

std::string escaped(const std::string& s, std::size_t from, std::size_t n) {
    std::string out;
    for (std::size_t i = from; i < s.size() && i < from + n; ++i) {
        char c = s[i];
        if (c == '\n')
            out += "\\n";
        else if (c == '\t')
            out += "\\t";
        else
            out += c;
    }
    return out;
}

// "" when equal, else where and how they first differ.
std::string first_difference(const std::string& expected, const std::string& actual) {
    if (expected == actual) return "";
    std::size_t i = 0;
    while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
    std::size_t from = i > 40 ? i - 40 : 0;
    std::ostringstream os;
    os << "first difference at byte " << i << " (expected " << expected.size() << " bytes, got "
       << actual.size() << ")\n  expected: ..." << escaped(expected, from, 100) << "\n  actual:   ..."
       << escaped(actual, from, 100);
    return os.str();
}

TEST(TemplateConformance, MatchesHuggingFaceJinja) {
#ifdef MOERL_TEMPLATE_NO_REFERENCE
    GTEST_SKIP() << "node was not found at configure time, so there is no reference rendering";
#endif
    std::ifstream in(MOERL_TEMPLATE_EXPECTED);
    ASSERT_TRUE(in) << "missing " << MOERL_TEMPLATE_EXPECTED
                    << ": run the text_template_reference test first";
    ordered_json all = ordered_json::parse(in);
    const auto& cases = all.at("cases");
    ASSERT_GT(cases.size(), 400u);

    std::map<std::string, ChatTemplate> models;
    int mismatches = 0, rejected = 0, model_cases = 0;
    for (const auto& c : cases) {
        const std::string name = c.at("name");
        std::string actual, error;
        try {
            if (c.contains("model")) {
                ++model_cases;
                std::string dir = std::string(MOERL_SOURCE_DIR) + "/" + c.at("model").get<std::string>();
                auto it = models.find(dir);
                if (it == models.end()) it = models.emplace(dir, ChatTemplate::load(dir)).first;
                ChatTemplateOptions options;
                options.add_generation_prompt = c.at("add_generation_prompt");
                options.tools = c.at("tools");
                options.variables = c.at("variables");
                actual = it->second.apply(c.at("messages"), options);
            } else {
                actual = moerl::text::jinja::Template(c.at("template")).render(c.at("context"));
            }
        } catch (const moerl::text::jinja::TemplateError& e) {
            error = e.what();
        }
        if (c.contains("error")) {
            ++rejected;
            if (error.empty()) {
                ++mismatches;
                ADD_FAILURE() << name << ": the reference fails (" << c.at("error").get<std::string>()
                              << ") but this rendered:\n"
                              << actual;
            }
            continue;
        }
        if (!error.empty()) {
            ++mismatches;
            ADD_FAILURE() << name << ": the reference renders, this failed: " << error;
            continue;
        }
        std::string diff = first_difference(c.at("expected"), actual);
        if (!diff.empty()) {
            ++mismatches;
            ADD_FAILURE() << name << ": " << diff;
        }
    }
    std::cout << cases.size() << " cases (" << model_cases << " conversations through real templates, "
              << rejected << " rejected by both), " << mismatches << " mismatches\n";
    EXPECT_EQ(mismatches, 0);
}

}  // namespace
