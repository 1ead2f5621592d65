// Chat templates: formats a conversation into a prompt string with the Jinja template from a
// Hugging Face tokenizer_config.json, as transformers.js's apply_chat_template does (the same
// render context, rendered by moerl::text::jinja, which matches @huggingface/jinja byte for byte).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moerl/text/jinja.hpp"

namespace moerl::text {

struct ChatTemplateOptions {
    // End the prompt with the header of an assistant turn (what generation continues from).
    bool add_generation_prompt = false;
    // Tool JSON schemas (a list) for templates with tool use; null passes none.
    nlohmann::ordered_json tools = nullptr;
    // Retrieval documents for templates that take them; null passes none.
    nlohmann::ordered_json documents = nullptr;
    // The template's own variables, e.g. {"enable_thinking": false} for Qwen3. They may also
    // override the special tokens.
    nlohmann::ordered_json variables = nlohmann::ordered_json::object();
    // For configs with several named templates: the one to use; empty picks "tool_use" when
    // tools are given and "default" otherwise.
    std::string template_name;
};

class ChatTemplate {
  public:
    // `path` is a tokenizer_config.json or a directory holding one. A chat_template.jinja file
    // beside it replaces the config's chat_template (newer transformers save it that way).
    // Special tokens (bos_token, eos_token, ...) come from the config, as strings or AddedToken
    // objects. Throws moerl::Error naming the file on a missing file, bad JSON or no template,
    // and jinja::TemplateError (prefixed by the file) on a template that does not parse.
    static ChatTemplate load(const std::filesystem::path& path);

    // One template source and the special tokens it sees (an object: {"bos_token": "<s>", ...}).
    ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens);

    // `messages`: a list of {"role": ..., "content": ..., "tool_calls": [...], "reasoning_content": ...}.
    // Throws jinja::TemplateError when rendering fails (raise_exception in the template included).
    std::string apply(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options = {}) const;

    // Names of the templates ("" for a config with a single template).
    std::vector<std::string> template_names() const;
    const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

  private:
    ChatTemplate() = default;
    const jinja::Template& pick(const ChatTemplateOptions& options) const;

    std::vector<std::pair<std::string, jinja::Template>> templates_;
    nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
};

// ChatTemplate::load(config).apply(messages, options), for a one-off prompt; load once and
// reuse the ChatTemplate when formatting many.
std::string apply_chat_template(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options,
                                const std::filesystem::path& config);

}  // namespace moerl::text
