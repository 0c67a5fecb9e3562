"""The part of a step's time its decode rows are charged with, so decode tokens per second mean decode
whatever the step schedule (docs/cgopipe-and-benchmarks.md, "Decode time").

A decode step is all decode and a prefill step none. A mixed step decodes N rows and prefills P prompt
tokens in one weight pass; its decode part is what the HRM's mixed-step model (hrm/schedule_cost.py)
says the decode pass alone would have cost, scaled to the step as measured: per resource, its measured
busy time in the step, the device's and the host's compute split between decode rows and prompt tokens
by their count (a prompt token costs the device what a decode row does, and the host at most what its
attention does). With the overlap on, resources overlap and the step is the busiest of them:

    share = max(link, f device, f host) / max(link, device, host),   f = N / (N + P)

with the overlap off they add up: (link + f (device + host)) / (link + device + host). Where the device
is the host's own cores (a CPU "device") its compute and attention's share them, so they count as one
resource. So where the link binds and the prompt tokens fit in its slack (the budget the HRM gives a
mixed step), a mixed step is charged whole to decoding, as a decode step of the same rows would have
taken as long; where compute binds, decoding is charged its rows' share of it. Without this, decode
tokens of mixed steps were divided by the time of pure decode steps only, which a short-generation
run with most of its decodes inside mixed steps read as 1.02x where the link-bound claim was 1.71x.
"""

from __future__ import annotations

from moe_lightning.step_protocol import StepKind


def decode_share(
    kind: StepKind,
    decodes: int,
    prompt_tokens: int,
    link: float,
    device: float,
    host: float,
    overlap: bool = True,
    shared_cores: bool = False,
) -> float:
    """The fraction of a step's time charged to its `decodes` decode rows, in [0, 1]. `link`, `device`,
    `host`: each resource's measured busy time in the step (any one unit); `prompt_tokens`: the step's
    prompt tokens beside its decodes; `shared_cores`: the device computes on the host's cores."""
    if kind is StepKind.DECODE:
        return 1.0
    if kind is StepKind.PREFILL or decodes <= 0:
        return 0.0
    f = decodes / (decodes + max(0, prompt_tokens))
    compute = [device + host] if shared_cores else [device, host]
    if overlap:
        whole = max(link, *compute)
        alone = max(link, *(f * c for c in compute))
    else:
        whole = link + sum(compute)
        alone = link + f * sum(compute)
    return min(1.0, alone / whole) if whole > 0 else f
