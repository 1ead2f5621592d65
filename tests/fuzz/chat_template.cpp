// Fuzz target: the Jinja source of a chat template (tokenizer_config.json's chat_template), parsed
// and rendered over a fixed conversation the way a run formats its prompts. A template that does
// not parse or fails to render is refused with a jinja::TemplateError (a moerl::Error); one that
// would render without end must be stopped by the renderer's limits, within the fuzz timeout.
#include "moerl/text/chat_template.hpp"

#include <nlohmann/json.hpp>

#include "fuzz_target.hpp"

namespace {

using json = nlohmann::ordered_json;

// Every message shape a chat template is asked to format: system, user, an assistant turn with
// reasoning and a tool call, the tool's answer, content as a list of parts.
const json& conversation() {
    static const json messages = json::parse(R"([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 3? Use the calculator."},
        {"role": "assistant", "content": "", "reasoning_content": "Add them.",
         "tool_calls": [{"type": "function", "id": "call_1",
                         "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\n2 + 3 = 5."},
        {"role": "user", "content": [{"type": "text", "text": "And 2 * 3?"}]}
    ])");
    return messages;
}

const json& tools() {
    static const json schemas = json::parse(R"([{"type": "function", "function": {
        "name": "add", "description": "Adds two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}}])");
    return schemas;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    return moerl::fuzz::parse_or_refuse([&] {
        const json special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"pad_token", "<pad>"}};
        const moerl::text::ChatTemplate chat(moerl::fuzz::as_text(data, size), special_tokens);
        moerl::text::ChatTemplateOptions prompt;
        prompt.add_generation_prompt = true;
        prompt.tools = tools();
        prompt.variables = {{"enable_thinking", false}};
        (void)chat.apply(conversation(), prompt);
        // The same template over a turn without tools, as the rollout's plain prompts are formatted.
        (void)chat.apply(json::array({conversation()[1]}));
    });
}
