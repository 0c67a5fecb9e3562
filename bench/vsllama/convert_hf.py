"""Runs llama.cpp's own converter (convert_hf_to_gguf.py, as llama-cpp-python's source ships it) on a
demo checkpoint: `python -m bench.vsllama.convert_hf CONVERTER_DIR MODEL_DIR [converter arguments]`.

The one thing the converter cannot do alone is name the demo tokenizer's pre-tokenizer: it recognises
a BPE pre-tokenizer by hashing what the tokenizer makes of a test string, against a list of published
models, and the demo tokenizer (moe_lightning/demo_model.py) is trained on this machine, so its hash
is on no list. Its pre-tokenizer is tokenizers' ByteLevel with GPT-2's split pattern, which llama.cpp
calls "gpt-2"; when the tokenizer.json says exactly that, the unknown hash gets that name. Anything else
still fails as the converter would. (The benchmark sends token ids, so the tokenizer never runs.)"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

GPT2_PRE_TOKENIZER = "gpt-2"


def is_gpt2_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    """tokenizers' ByteLevel pre-tokenizer with its regex on: GPT-2's split pattern, then bytes to
    characters (a prefix space or not changes no split of a prompt llama.cpp is given as ids)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main(argv: list[str]) -> None:
    converter, model = Path(argv[0]), Path(argv[1])
    sys.path.insert(0, str(converter))
    sys.path.insert(1, str(converter / "gguf-py"))  # the gguf package of the same llama.cpp, as the script does
    from conversion.base import TextModel  # the converter's own package: ty: ignore

    known = TextModel.get_vocab_base_pre
    gpt2 = is_gpt2_byte_level(json.loads((model / "tokenizer.json").read_text()))

    def name_pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not gpt2:
                raise
            return GPT2_PRE_TOKENIZER

    TextModel.get_vocab_base_pre = name_pre_tokenizer
    script = converter / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(model), *argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
