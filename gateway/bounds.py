"""What a body may hold, checked before it is modelled (issue 54): its lists and objects counted on the
parsed JSON (len() of each is O(1)), so that 250,000 empty chat messages are refused before pydantic
builds a model of each (four such 8.3 MB bodies held the event loop 5 s), and numbers that JSON spells
as booleans refused (pydantic's lax mode took `max_tokens: true` as 1). Each limit is OpenAI's where it
publishes one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from gateway.fields import UnsupportedField
from moe_lightning.sampling import MAX_LOGIT_BIAS_TOKENS, MAX_STOP_TOKEN_IDS
from moe_lightning.validation import MAX_BATCH_PROMPTS, MAX_STOP_STRINGS

MAX_MESSAGES = 2048  # OpenAI's: "Expected an array with maximum length 2048"
MAX_TOOLS = 128  # OpenAI's
# an assistant's tool calls and a message's content parts, all messages together: each is a model of
# its own, and a few per message is what clients send
MAX_MESSAGE_PARTS = 4 * MAX_MESSAGES
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# field -> its longest list or object, whichever route takes it (a route that does not take a field
# refuses it by name after this)
_LENGTHS = {
    "messages": MAX_MESSAGES,
    "tools": MAX_TOOLS,
    "stop": MAX_STOP_STRINGS,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "logit_bias": MAX_LOGIT_BIAS_TOKENS,
    "metadata": MAX_METADATA_KEYS,
}


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError(
            "number_type", "a number is expected, got the boolean {value}", {"value": str(value).lower()}
        )
    return value


# a numeric field's validator: JSON's true is not 1 (pydantic's lax mode takes it as 1)
NUMBER = BeforeValidator(_not_a_boolean)


def check_lengths(data: Any) -> None:
    """Refuses a body whose lists are longer than any request may have, before it is modelled:
    UnsupportedField naming the field (its message says the rest: the model's error puts the name
    before it)."""
    if not isinstance(data, Mapping):
        return  # the model's own error
    for name, limit in _LENGTHS.items():
        value = data.get(name)
        if isinstance(value, list | dict) and len(value) > limit:
            kind = "keys" if isinstance(value, dict) else "items"
            raise UnsupportedField(name, f"{len(value)} {kind}; at most {limit} are allowed")
    prompt = data.get("prompt")
    # a list of token ids is one prompt (its length is the context's to bound, at C speed); of strings
    # or of lists, each item is a prompt
    if isinstance(prompt, list) and len(prompt) > MAX_BATCH_PROMPTS and not isinstance(prompt[0], int):
        raise UnsupportedField(
            "prompt",
            f"{len(prompt)} prompts; one request takes at most {MAX_BATCH_PROMPTS} (the server's "
            "max_batch_prompts): send fewer prompts per request",
        )
    messages = data.get("messages")
    if isinstance(messages, list):
        turns = [m for m in messages if isinstance(m, dict)]
        parts = sum(len(v) for m in turns for v in (m.get("content"), m.get("tool_calls")) if isinstance(v, list))
        if parts > MAX_MESSAGE_PARTS:
            raise UnsupportedField(
                "messages",
                f"{parts} content parts and tool calls in all; at most {MAX_MESSAGE_PARTS} are allowed",
            )


def check_metadata(metadata: Mapping[str, Any] | None) -> None:
    """OpenAI's rule for `metadata` (which this server keeps no use of): 16 string pairs at most."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise UnsupportedField("metadata", "must be an object of strings")
    if len(metadata) > MAX_METADATA_KEYS:
        raise UnsupportedField("metadata", f"{len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise UnsupportedField(
                "metadata", f"a key has {len(key)} characters; at most {MAX_METADATA_KEY_CHARS} are allowed"
            )
        if not isinstance(value, str):
            raise UnsupportedField(f"metadata.{key}", f"must be a string, got {type(value).__name__}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise UnsupportedField(
                f"metadata.{key}",
                f"{len(value)} characters; at most {MAX_METADATA_VALUE_CHARS} are allowed",
            )
