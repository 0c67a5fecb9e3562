"""GPT-OSS's chat format, harmony (docs/openai.md, "Harmony"), as our own Jinja chat template for the
GPT-OSS demo checkpoint; a real checkpoint ships its own, which is used instead.

Written from OpenAI's description of the format (the openai-harmony guide) and the behaviour of the
published GPT-OSS template, so that what the model is shown, and what it writes back, is what
moe_lightning.reasoning (`gpt_oss`) and moe_lightning.tool_calls (`harmony`) read:

- a system message with the model's identity, the dates, `Reasoning: {reasoning_effort}` (low, medium
  or high: chat_template_kwargs; medium by default) and the channels, and, with tools, that calls go
  to the commentary channel;
- a developer message with the conversation's first system (or developer) message as its
  instructions, and the tools as a TypeScript-like `namespace functions { ... }`;
- user turns; assistant turns in the final channel, a tool-calling one as its calls, each a message
  `to=functions.NAME` in the commentary channel ending with `<|call|>`, after its content as a
  preamble (commentary without a recipient, as the model writes one); tool results as messages of
  `functions.NAME to=assistant`, NAME that of the call their tool_call_id answers;
- an assistant's reasoning (`thinking`, which transformers and moe_lightning.chat_template fill from
  `reasoning_content`) only where the published template keeps it: in the analysis channel of a
  tool-calling turn that no final answer has followed yet (the model goes on from its thinking), and
  in a last assistant turn rendered without a generation prompt (training); everywhere else the
  chain of thought is dropped, as harmony asks;
- the generation prompt `<|start|>assistant`: the model writes the first header itself.

Unlike the published template, a system or developer message after the first is a developer message
of its own (not dropped), each of several tool calls of one turn is rendered (not the first alone),
a tool result names the call it answers by id, its content is written as it is (the guide's form, not
a JSON string), and an unknown reasoning_effort is refused. Jinja's whitespace control (`{%-`, `-%}`)
is on every tag, so the output is the same with transformers' trim_blocks and lstrip_blocks.

A family module uses it as `chat_template` in the demo checkpoint's tokenizer_config.json; the
markers (HARMONY_TOKENS) are special tokens of GPT-OSS's tokenizer, and `<|return|>` and `<|call|>`
(STOP_TOKENS) end a generation (generation_config.json's eos_token_id).
"""

from __future__ import annotations

# What moe_lightning.tool_calls.detect_format and moe_lightning.reasoning.detect_reasoning read from
# CHAT_TEMPLATE (tests/test_harmony.py checks it), spelled out rather than imported: the family
# registry is imported by commands that start without the parsers (and jinja2) loaded
TOOL_CALL_FORMAT = "harmony"
REASONING_FORMAT = "gpt_oss"
# the markers the template and the model write: special tokens of o200k_harmony
HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
STOP_TOKENS = ("<|return|>", "<|call|>")  # the model's end of an answer, and of a call

CHAT_TEMPLATE = r"""
{#- moe-lightning's harmony template for GPT-OSS: see moe_lightning/families/gpt_oss_template.py -#}
{#- A JSON schema as a TypeScript-like type. (An undefined value passes Jinja's `sequence` test:
    every test of one is after `is defined`.) -#}
{%- macro ts_type(s) -%}
    {%- if s is not mapping -%}
        {{- "any" -}}
    {%- elif s["enum"] is defined and s["enum"] is sequence and s["enum"] is not string -%}
        {{- s["enum"] | map("tojson") | join(" | ") -}}
    {%- elif s["const"] is defined -%}
        {{- s["const"] | tojson -}}
    {%- elif s["anyOf"] is defined or s["oneOf"] is defined -%}
        {%- set alternatives = s["anyOf"] if s["anyOf"] is defined else s["oneOf"] -%}
        {%- for a in alternatives -%}
            {{- ts_type(a) -}}{{- " | " if not loop.last else "" -}}
        {%- endfor -%}
    {%- elif s["type"] is defined and s["type"] is not string and s["type"] is sequence -%}
        {%- for t in s["type"] -%}
            {{- ts_named(t, s) -}}{{- " | " if not loop.last else "" -}}
        {%- endfor -%}
    {%- elif s["type"] is defined -%}
        {{- ts_named(s["type"], s) -}}
    {%- else -%}
        {{- ts_named("object" if s["properties"] is mapping else none, s) -}}
    {%- endif -%}
    {%- if s is mapping and s["nullable"] is true -%}
        {{- " | null" -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts_named(t, s) -%}
    {%- if t == "string" -%}
        {{- "string" -}}
    {%- elif t == "number" or t == "integer" -%}
        {{- "number" -}}
    {%- elif t == "boolean" -%}
        {{- "boolean" -}}
    {%- elif t == "null" -%}
        {{- "null" -}}
    {%- elif t == "array" -%}
        {%- if s["items"] is mapping -%}
            {%- set item = ts_type(s["items"]) -%}
            {{- ("(" ~ item ~ ")" if " | " in item else item) ~ "[]" -}}
        {%- else -%}
            {{- "any[]" -}}
        {%- endif -%}
    {%- elif t == "object" and s["properties"] is mapping and s["properties"] -%}
        {{- "{\n" ~ ts_fields(s) ~ "}" -}}
    {%- elif t == "object" -%}
        {{- "object" -}}
    {%- else -%}
        {{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{#- An object schema's properties, one a line: its description above it, its default after it -#}
{%- macro ts_fields(s) -%}
    {%- if s["required"] is defined and s["required"] is not string and s["required"] is sequence -%}
        {%- set required = s["required"] -%}
    {%- else -%}
        {%- set required = [] -%}
    {%- endif -%}
    {%- for name, spec in s["properties"].items() -%}
        {%- if spec is mapping and spec["description"] is string and spec["description"] -%}
            {{- "// " ~ spec["description"] | replace("\n", "\n// ") ~ "\n" -}}
        {%- endif -%}
        {{- name ~ ("" if name in required else "?") ~ ": " ~ ts_type(spec) ~ "," -}}
        {%- if spec is mapping and spec["default"] is defined -%}
            {{- " // default: " ~ (spec["default"] if spec["default"] is string else spec["default"] | tojson) -}}
        {%- endif -%}
        {{- "\n" -}}
    {%- endfor -%}
{%- endmacro -%}
{#- The variables chat_template_kwargs may set -#}
{%- if reasoning_effort is defined and reasoning_effort is not none -%}
    {%- set effort = reasoning_effort -%}
{%- else -%}
    {%- set effort = "medium" -%}
{%- endif -%}
{%- if effort not in ("low", "medium", "high") -%}
    {{- raise_exception("reasoning_effort must be low, medium or high, not " ~ effort | tojson) -}}
{%- endif -%}
{%- if model_identity is defined and model_identity is string -%}
    {%- set identity = model_identity -%}
{%- else -%}
    {%- set identity = "You are ChatGPT, a large language model trained by OpenAI." -%}
{%- endif -%}
{#- The system message -#}
{{- "<|start|>system<|message|>" ~ identity ~ "\nKnowledge cutoff: 2024-06\n" -}}
{{- "Current date: " ~ strftime_now("%Y-%m-%d") ~ "\n\nReasoning: " ~ effort ~ "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{#- The developer message: the first system message's instructions, and the tools -#}
{%- if messages and messages[0]["role"] in ("system", "developer") -%}
    {%- set instructions = messages[0]["content"] -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}
        {{- "# Instructions\n\n" ~ instructions -}}
        {{- "\n\n" if tools else "" -}}
    {%- endif -%}
    {%- if tools -%}
        {{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" -}}
        {%- for tool in tools -%}
            {%- set f = tool["function"] if tool["function"] is defined else tool -%}
            {%- if f["description"] is string and f["description"] -%}
                {{- "// " ~ f["description"] | replace("\n", "\n// ") ~ "\n" -}}
            {%- endif -%}
            {%- set p = f["parameters"] -%}
            {%- if p is mapping and p["properties"] is mapping and p["properties"] -%}
                {{- "type " ~ f["name"] ~ " = (_: {\n" ~ ts_fields(p) ~ "}) => any;\n\n" -}}
            {%- else -%}
                {{- "type " ~ f["name"] ~ " = () => any;\n\n" -}}
            {%- endif -%}
        {%- endfor -%}
        {{- "} // namespace functions" -}}
    {%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}
{#- The conversation -#}
{%- for m in turns -%}
    {%- if m["role"] in ("system", "developer") -%}
        {{- "<|start|>developer<|message|># Instructions\n\n" ~ m["content"] ~ "<|end|>" -}}
    {%- elif m["role"] == "user" -%}
        {{- "<|start|>user<|message|>" ~ m["content"] ~ "<|end|>" -}}
    {%- elif m["role"] == "assistant" -%}
        {%- set content = m["content"] if m["content"] is string else "" -%}
        {%- set thinking = m["thinking"] if m["thinking"] is string else "" -%}
        {%- if "<|channel|>" in content or "<|channel|>" in thinking -%}
            {{- raise_exception(
                "an assistant message's content and reasoning_content are its text, without harmony's "
                ~ "<|channel|> headers: pass the analysis channel's text as reasoning_content and the final "
                ~ "channel's as content"
            ) -}}
        {%- endif -%}
        {%- if m["tool_calls"] -%}
            {#- its thinking, while the model is still working from it: no final answer came after it -#}
            {%- set later = namespace(final=false) -%}
            {%- for n in turns[loop.index:] -%}
                {%- if n["role"] == "assistant" and not n["tool_calls"] -%}
                    {%- set later.final = true -%}
                {%- endif -%}
            {%- endfor -%}
            {%- if thinking and not later.final -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ thinking ~ "<|end|>" -}}
            {%- endif -%}
            {%- if content -%}
                {{- "<|start|>assistant<|channel|>commentary<|message|>" ~ content ~ "<|end|>" -}}
            {%- endif -%}
            {%- for call in m["tool_calls"] -%}
                {%- set f = call["function"] if call["function"] is defined else call -%}
                {{- "<|start|>assistant<|channel|>commentary to=functions." ~ f["name"] -}}
                {{- " <|constrain|>json<|message|>" -}}
                {{- f["arguments"] if f["arguments"] is string else f["arguments"] | tojson -}}
                {{- "<|call|>" -}}
            {%- endfor -%}
        {%- elif loop.last and not add_generation_prompt -%}
            {#- the answer being trained on: its thinking, and <|return|>, the model's end of an answer -#}
            {%- if thinking -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ thinking ~ "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" ~ content ~ "<|return|>" -}}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" ~ content ~ "<|end|>" -}}
        {%- endif -%}
    {%- elif m["role"] == "tool" -%}
        {#- the function of the call it answers: by its id, else the latest call's -#}
        {%- set called = namespace(by_id=none, latest=none) -%}
        {%- for prev in turns[:loop.index0] -%}
            {%- if prev["role"] == "assistant" and prev["tool_calls"] -%}
                {%- for call in prev["tool_calls"] -%}
                    {%- set f = call["function"] if call["function"] is defined else call -%}
                    {%- set called.latest = f["name"] -%}
                    {%- if m["tool_call_id"] is defined and call["id"] == m["tool_call_id"] -%}
                        {%- set called.by_id = f["name"] -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set name = called.by_id if called.by_id is not none else called.latest -%}
        {%- if name is none -%}
            {{- raise_exception("a tool message answers a tool call, but no assistant message before it made one") -}}
        {%- endif -%}
        {{- "<|start|>functions." ~ name ~ " to=assistant<|channel|>commentary<|message|>" -}}
        {{- m["content"] ~ "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|start|>assistant" -}}
{%- endif -%}
"""
