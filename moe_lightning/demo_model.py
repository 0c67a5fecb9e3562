"""Built-in demo checkpoints: HF-format models of any family (Mixtral by default) with random weights,
deterministic by seed.

They need no download, load in transformers as they are, and come with a real byte-level BPE
tokenizer trained on a generated corpus, so text in and text out work end to end.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moe_lightning.families import Randoms, by_architecture, by_name
from moe_lightning.spec import ModelSpec
from moe_lightning.torch_dtypes import DTYPES

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Mixtral

# ChatML's layout, with the checkpoint's own BOS first (the template writes it, so prompts are
# tokenized without special tokens, as in transformers) and EOS closing each turn: generation stops
# at EOS, so a reply ends exactly where the template ends a turn. The markers are plain text to the
# demo tokenizer, which keeps its vocabulary, and so every demo checkpoint's token ids, unchanged.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    # a few MB: unit and end-to-end tests
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=1024,
    ),
    # ~0.8 B parameters, ~3.2 GB in fp32: benchmarks on a 2-core machine
    "bench": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Mixtral 8x7B's shapes with 4 of its 32 layers, ~6.1 B parameters, ~12 GB in bf16: the GPU check
    # (bench/gpu_check.py); build it on the GPU (`device="cuda"`), on a CPU it takes minutes
    "mixtral-8x7b-4l": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
    ),
}


def _preset(preset: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    return preset


def mixtral_config(preset: str | dict[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """An HF config.json dict for a preset name or a dict of overrides."""
    return demo_config(preset, "mixtral", dtype)


def demo_config(preset: str | dict[str, Any], arch: str = "mixtral", dtype: str = "float32") -> dict[str, Any]:
    """config.json of the family `arch` with a preset's shapes (presets are written in Mixtral's field names)."""
    return by_name(arch).demo_config(_preset(preset), dtype)


def _random_state_dict(
    spec: ModelSpec, seed: int, dtype: torch.dtype, progress: bool, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights under the family's own names, generated on `device` (a GPU makes billions
    of them in a second; the values then differ from the CPU's for the same seed, but are as deterministic)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).mul_(0.02).to(dtype)  # in place: one 3 GB pass less

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen, device=device)).to(dtype)

    return by_architecture(spec.architecture).random_weights(spec, Randoms(normal, norm), progress)


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ar", "en", "is", "on")]


def _corpus(seed: int, n_words: int) -> list[str]:
    # A deterministic pseudo-language with Zipf-like word frequencies, so BPE learns real merges.
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    weights = [1.0 / (r + 1) for r in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=n_words)
    lines, line = [], []
    for w in words:
        line.append(w)
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line).capitalize() + rng.choice([".", "?", "!", ","]))
            line = []
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE whose vocabulary is exactly `vocab_size` (padded with reserved tokens);
    `extra_special`: a family's chat markers, special tokens after SPECIAL_TOKENS' three."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, n_words=min(400_000, 40 * vocab_size)), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<reserved_{i}>" for i in range(missing)])
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def write_demo_model(
    out_dir: str | Path,
    preset: str | dict[str, Any] = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    progress: bool = True,
    with_tokenizer: bool = True,
    device: str = "cpu",
    arch: str = "mixtral",
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and generation_config.json of `arch`
    (a family name: families.FAMILY_NAMES) with the preset's shapes.

    `device`: where the random weights are generated (see `_random_state_dict`); they are saved from
    host memory either way."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config(preset, arch, dtype)
    spec = ModelSpec.from_hf_config(config)
    sd = _random_state_dict(spec, seed, DTYPES[dtype], progress, device)
    if torch.device(device).type != "cpu":
        sd = {name: t.cpu() for name, t in sd.items()}  # safetensors serializes host memory
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    del sd
    family = by_name(arch)
    tok = build_tokenizer(spec.vocab_size, seed, family.special_tokens) if with_tokenizer else None
    eos: int | list[int] = 2
    if tok is not None and family.stop_tokens:  # the family's own ends of a generation, beside </s>
        eos = [2, *(tok.token_to_id(t) for t in family.stop_tokens)]
        config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tok is not None:
        tok.save(str(out / "tokenizer.json"))
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": spec.max_position_embeddings,
            "chat_template": family.chat_template or CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
