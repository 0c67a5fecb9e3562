"""How the model writes tool calls and reasoning, which the HTTP gateway parses out of its outputs
(GetServerMetadata): the operator's --tool-call-parser / --reasoning-parser, or, with auto, what the
chat template's source shows (docs/openai.md, "Tools")."""

from __future__ import annotations

from moe_lightning.chat_template import ChatTemplate
from moe_lightning.config.choices import AUTO
from moe_lightning.reasoning import detect_reasoning
from moe_lightning.tool_calls import detect_format


def output_formats(template: ChatTemplate | None, tool_parser: str, reasoning_parser: str) -> tuple[str, str]:
    """(tool call format, reasoning format), "" for none."""
    source = "" if template is None else (template.tool_source or template.source)
    tools = (detect_format(source) or "") if tool_parser == AUTO else tool_parser
    reasoning = (detect_reasoning(source) or "") if reasoning_parser == AUTO else reasoning_parser
    return ("" if tools == "none" else tools), ("" if reasoning == "none" else reasoning)
