#include "moerl/text/chat_template.hpp"

#include <fstream>
#include <sstream>

#include "moerl/core/error.hpp"

namespace moerl::text {

namespace {

// The special-token keys transformers.js passes to the template, in its order.
const char* kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                "pad_token", "cls_token", "mask_token"};

std::string read_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in, "cannot read ", path.string());
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

jinja::Template compile(const std::string& source, const std::string& where) {
    try {
        return jinja::Template(source);
    } catch (const jinja::TemplateError& e) {
        throw jinja::TemplateError(where + ": " + e.message(), e.template_line(), e.template_column(),
                                   __FILE__, __LINE__);
    }
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens)
    : special_tokens_(std::move(special_tokens)) {
    MOERL_CHECK(special_tokens_.is_object(), "chat template special tokens must be a JSON object, got ",
                special_tokens_.type_name());
    templates_.emplace_back("", jinja::Template(source));
}

ChatTemplate ChatTemplate::load(const std::filesystem::path& path) {
    std::filesystem::path config =
        std::filesystem::is_directory(path) ? path / "tokenizer_config.json" : path;
    MOERL_CHECK(std::filesystem::exists(config), "no tokenizer config at ", config.string());
    nlohmann::ordered_json j;
    try {
        j = nlohmann::ordered_json::parse(read_file(config));
    } catch (const nlohmann::json::exception& e) {
        MOERL_FAIL(config.string(), ": not valid JSON: ", e.what());
    }
    MOERL_CHECK(j.is_object(), config.string(), ": expected a JSON object");

    ChatTemplate t;
    for (const char* key : kSpecialTokens) {
        if (!j.contains(key)) continue;
        const auto& v = j[key];
        if (v.is_string() && !v.get<std::string>().empty()) {
            t.special_tokens_[key] = v;
        } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
            if (!v["content"].get<std::string>().empty()) t.special_tokens_[key] = v["content"];
        } else if (!v.is_null()) {
            MOERL_FAIL(config.string(), ": ", key, " must be a string or an AddedToken object, got ",
                       v.dump());
        }
    }

    std::filesystem::path jinja_file = config.parent_path() / "chat_template.jinja";
    if (std::filesystem::exists(jinja_file)) {
        t.templates_.emplace_back("", compile(read_file(jinja_file), jinja_file.string()));
        return t;
    }
    MOERL_CHECK(j.contains("chat_template") && !j["chat_template"].is_null(), config.string(),
                ": no chat_template (and no chat_template.jinja beside it)");
    const auto& ct = j["chat_template"];
    std::string where = config.string() + " chat_template";
    if (ct.is_string()) {
        t.templates_.emplace_back("", compile(ct.get<std::string>(), where));
    } else if (ct.is_array()) {  // transformers (Python) writes [{"name": ..., "template": ...}]
        for (const auto& e : ct) {
            MOERL_CHECK(e.is_object() && e.contains("name") && e["name"].is_string() &&
                            e.contains("template") && e["template"].is_string(),
                        where, ": each entry must be {\"name\": string, \"template\": string}");
            std::string name = e["name"].get<std::string>();
            t.templates_.emplace_back(name,
                                      compile(e["template"].get<std::string>(), where + " '" + name + "'"));
        }
    } else if (ct.is_object()) {  // {"default": ..., "tool_use": ...}
        for (auto it = ct.begin(); it != ct.end(); ++it) {
            MOERL_CHECK(it.value().is_string(), where, " '", it.key(), "' must be a string");
            t.templates_.emplace_back(it.key(),
                                      compile(it.value().get<std::string>(), where + " '" + it.key() + "'"));
        }
    } else {
        MOERL_FAIL(where, " must be a string, a list of named templates or an object, got ", ct.type_name());
    }
    MOERL_CHECK(!t.templates_.empty(), where, " is empty");
    return t;
}

std::vector<std::string> ChatTemplate::template_names() const {
    std::vector<std::string> names;
    for (const auto& [name, t] : templates_) names.push_back(name);
    return names;
}

const jinja::Template& ChatTemplate::pick(const ChatTemplateOptions& options) const {
    if (templates_.size() == 1 && templates_[0].first.empty()) {
        MOERL_CHECK(options.template_name.empty(), "no chat template named '", options.template_name,
                    "': this config has a single unnamed template");
        return templates_[0].second;
    }
    auto find = [&](const std::string& name) -> const jinja::Template* {
        for (const auto& [n, t] : templates_)
            if (n == name) return &t;
        return nullptr;
    };
    std::string names;
    for (const auto& [n, t] : templates_) names += (names.empty() ? "" : ", ") + n;
    if (!options.template_name.empty()) {
        const auto* t = find(options.template_name);
        MOERL_CHECK(t, "no chat template named '", options.template_name, "' (there are: ", names, ")");
        return *t;
    }
    if (!options.tools.is_null())
        if (const auto* t = find("tool_use")) return *t;
    const auto* t = find("default");
    MOERL_CHECK(t, "several chat templates and none named 'default': pick one of ", names,
                " with ChatTemplateOptions::template_name");
    return *t;
}

std::string ChatTemplate::apply(const nlohmann::ordered_json& messages,
                                const ChatTemplateOptions& options) const {
    MOERL_CHECK(messages.is_array(), "chat messages must be a JSON list, got ", messages.type_name());
    MOERL_CHECK(options.variables.is_object(), "chat template variables must be a JSON object, got ",
                options.variables.type_name());
    nlohmann::ordered_json context = nlohmann::ordered_json::object();
    context["messages"] = messages;
    context["add_generation_prompt"] = options.add_generation_prompt;
    context["tools"] = options.tools;
    context["documents"] = options.documents;
    for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) context[it.key()] = it.value();
    for (auto it = options.variables.begin(); it != options.variables.end(); ++it)
        context[it.key()] = it.value();
    return pick(options).render(context);
}

std::string apply_chat_template(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options,
                                const std::filesystem::path& config) {
    return ChatTemplate::load(config).apply(messages, options);
}

}  // namespace moerl::text
