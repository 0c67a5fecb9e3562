"""Plain requests' latency beside structured-output ones, with the grammar masks filled while each step's
layers run (the default) and before each step is sent (--no-grammar-mask-overlap): issue 54.

Two stacks of the tiny demo model, one per mode, run side by side; each round measures, on each stack in
turn (the order alternating), 8 plain requests' mean latency alone, beside 32 more plain ones (the same
batch without grammars: what the batch's size alone costs) and beside 32 guided ones (a regex that
never lets them end early: every guided request lasts its whole budget). The machine is shared and noisy:
compare the modes within one run.

    python bench/mask_overlap.py [--rounds 3] [--plain 8] [--guided 32] [--tokens 48] [--vocab 512] [--json OUT]

--vocab: the tiny model's shapes with this vocabulary (a mask's fill grows with it; 512 is the tiny's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.demo_model import PRESETS, write_demo_model
from moe_lightning.launcher import Stack

GUIDED = ("regex", "[a-z ]{400}")  # longer than any budget: the budget ends each guided request


def latencies(address: str, plain: int, guided: int, tokens: int, grammar: bool = True) -> list[float]:
    """Seconds each of `plain` requests took, sent at once with `guided` structured ones (`grammar`
    False: as many more plain ones, the same batch without grammars)."""
    prompts = [Prompt(text=f"Plain {i}:", max_new_tokens=tokens, ignore_eos=True, seed=i) for i in range(plain)]
    prompts += [
        Prompt(text=f"Guided {i}:", max_new_tokens=tokens, temperature=1.0, seed=i, grammar=GUIDED if grammar else None)
        for i in range(guided)
    ]

    def one(prompt: Prompt) -> float:
        t0 = time.perf_counter()
        with GenerationClient(address, timeout=600) as c:
            c.generate(prompt)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(prompts)) as pool:
        took = list(pool.map(one, prompts))
    return took[:plain]


def _wait(stack: Stack) -> tuple[float, float]:
    """(seconds, times) gpu_expert's head waited for masks that followed their step."""
    text = urllib.request.urlopen(stack.endpoints()["gpu_expert"]["metrics"], timeout=10).read().decode()
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("moe_lightning_grammar_mask_wait")
    )
    return float(values.get("moe_lightning_grammar_mask_wait_seconds_sum", 0)), float(
        values.get("moe_lightning_grammar_mask_wait_seconds_count", 0)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain", type=int, default=8)
    ap.add_argument("--guided", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=PRESETS["tiny"]["vocab_size"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mask_overlap"))
    model = write_demo_model(tmp / "tiny", PRESETS["tiny"] | {"vocab_size": args.vocab}, seed=0, progress=False)
    modes = {"overlap": [], "no-overlap": ["--no-grammar-mask-overlap"]}
    stacks = {}
    try:
        for i, (mode, flags) in enumerate(modes.items()):
            config = StackConfig(
                model=model,
                port=0,
                run_id=f"maskovl{i}",
                kv_cache_memory="64MiB",
                max_batch_size=64,
                log_dir=tmp / f"logs-{mode}",
                extra={"orchestrator": flags},
            )
            stacks[mode] = Stack(config)
            stacks[mode].start(timeout=300)
        results: dict[str, dict[str, list[float]]] = {
            m: {"alone": [], "beside_plain": [], "beside_guided": []} for m in modes
        }
        for r in range(args.rounds):
            for mode in list(modes)[:: 1 if r % 2 == 0 else -1]:
                address = stacks[mode].api_address
                alone = statistics.mean(latencies(address, args.plain, 0, args.tokens))
                plain = statistics.mean(latencies(address, args.plain, args.guided, args.tokens, grammar=False))
                beside = statistics.mean(latencies(address, args.plain, args.guided, args.tokens))
                results[mode]["alone"].append(alone)
                results[mode]["beside_plain"].append(plain)
                results[mode]["beside_guided"].append(beside)
                print(
                    f"round {r} {mode:>10}: {args.plain} plain alone {alone:6.2f} s, beside {args.guided} plain "
                    f"{plain:6.2f} s, beside {args.guided} guided {beside:6.2f} s (mean latency)",
                    flush=True,
                )
        summary = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in results.items()}
        for mode, s in summary.items():
            print(
                f"median {mode:>10}: alone {s['alone']:.2f} s, beside plain {s['beside_plain']:.2f} s, "
                f"beside guided {s['beside_guided']:.2f} s"
            )
        waits = _wait(stacks["overlap"])
        print(
            f"overlap: the head waited for masks {waits[1]:.0f} times, {1e3 * waits[0] / max(1, waits[1]):.2f} ms each"
        )
        if args.json is not None:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rounds": results}))
    finally:
        for stack in stacks.values():
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
