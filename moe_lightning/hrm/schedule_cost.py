"""Generated tokens per second over a long job with continuous admission, prefill included (the paper's
metric: generated tokens over total time), for the two step schedules (orchestrator/batcher.py).

At steady state N/n of the N running sequences finish each decode step and as many newcomers bring
P = N s / n prompt tokens. A prompt token costs the device what a decode token does (its dense GEMMs
and its share of the experts: t_gpu / N a layer) and the host at most what a decode token's attention
does (a chunk attends to a shorter prefix: t_cpu / N). Per layer:

* alternating: a decode pass, then a prefill pass for the newcomers: t_decode + max(the link for the
  experts P tokens touch, P t_gpu / N, P t_cpu / N);
* mixed: the P tokens ride in the decode pass: max(t_decode, t_link, (N + P) t_gpu / N, (N + P) t_cpu / N).

So where the link binds and P fits in its slack (hrm/prefill_budget.py), mixed steps cost no more
than decoding alone, and alternating ones up to a second pass (MoE-Lens, arXiv 2504.09345).
Not modelled: the pipeline fill of the extra tokens, and prompts' attention cost above. t_gpu / N
spreads the device's expert reads (n_ub, or g with Policy.expert_groups, passes over the touched
experts) over the tokens as if they grew with them; they do not, so where those reads bind the extra
tokens' device cost is overstated, most for many micro-batches once per micro-batch, and with it what
grouping saves in a mixed step.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lightning.hrm.costmodel import Estimate
from moe_lightning.hrm.layercost import Workload, distinct_experts
from moe_lightning.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class ScheduleThroughput:
    decode_only: float  # the plan's decode tokens/s: prefill left out
    alternating: float  # generated tokens/s, prefill passes of their own
    mixed: float  # generated tokens/s, prompts in the decode passes
    prompt_tokens_per_step: float  # P

    @property
    def mixed_vs_alternating(self) -> float:
        return self.mixed / self.alternating if self.alternating else 0.0


def schedule_throughput(spec: ModelSpec, work: Workload, est: Estimate) -> ScheduleThroughput:
    n = est.policy.batch
    t = est.resource_seconds
    prompt = n * work.prompt_len / work.gen_len
    per_gpu, per_cpu = t["gpu"] / n, t["cpu"] / n
    touched = min(1.0, distinct_experts(prompt, spec) / max(distinct_experts(n, spec), 1e-12))
    prefill = max(t["link"] * touched, prompt * per_gpu, prompt * per_cpu)
    mixed = max(est.layer_seconds, t["link"], (n + prompt) * per_gpu, (n + prompt) * per_cpu)
    layers = spec.num_layers
    return ScheduleThroughput(
        est.tokens_per_second, n / (layers * (est.layer_seconds + prefill)), n / (layers * mixed), prompt
    )
