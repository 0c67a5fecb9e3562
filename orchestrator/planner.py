"""The HRM in the running stack: plan at start, compare predictions with what the services measure,
correct the profile and re-plan between batches when they drift apart.

The batch is sized by `kv_rule` (moe_lightning/hrm/layercost.py kv_tokens): "expected", for the
batcher's default admission (`kv_admission="need"`: sequences take KV blocks as they grow, the most
recent preempted when the cache runs out), counts each sequence at its steady-state mean s + n/2 plus
a few standard deviations of the batch's total; "max", for `kv_admission="reserve"`, at s + n.

Per layer of a decode step, the "device" and "attention" rows of moe_lightning/hrm/stage_accuracy.py:
gpu_expert's compute (pre- plus post-attention less the exposed expert-page waits, host-computed
experts included) and what it waits for attention (cpu_attention's compute plus the two
hand-offs), against the cost model at the batch and micro-batch that actually ran. When one
side is off by more than `threshold` for `patience` consecutive decode steps, that resource's roofs
are scaled by predicted/measured (so the hand-off cost folds into the attention roof, as it should
for planning) and the optimizer runs again. The workload (the prompt lengths' mean and spread, the
generation length) is learned from admitted requests the same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import structlog
from prometheus_client import Counter, Gauge, Info

from moe_lightning.config.choices import EXPERT_GROUP_CHOICES
from moe_lightning.hrm.costmodel import Estimate, Policy, estimate
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.layercost import EXPECTED_USE, MAX_CONTEXT, NO_QUANT, Workload, check_kv_rule, kv_sequences
from moe_lightning.hrm.optimizer import micro_batch_counts, optimize
from moe_lightning.hrm.schedule_cost import schedule_throughput
from moe_lightning.hrm.stage_accuracy import measured_per_layer, predicted_per_layer
from moe_lightning.kv_layout import KVLayout
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepKind, StepTimings

PREDICTED = Gauge("moe_lightning_stage_predicted_seconds", "HRM-predicted time per layer of a decode step", ["stage"])
MEASURED = Gauge("moe_lightning_stage_measured_seconds", "Measured time per layer of a decode step (EWMA)", ["stage"])
PREDICTED_TPS = Gauge("moe_lightning_predicted_decode_tokens_per_second", "HRM throughput of the current policy")
PREDICTED_IN_FORCE = Gauge(
    "moe_lightning_predicted_generated_tokens_per_second",
    "HRM generated tokens/s of a long job, prefill included, at the batch, micro-batch and expert groups in force",
    ["step_schedule"],
)
REPLANS = Counter("moe_lightning_replans_total", "Re-plans, by reason", ["reason"])
POLICY = Info("moe_lightning_policy", "The policy in force")
THRESHOLD = Gauge(
    "moe_lightning_replan_threshold_ratio", "Relative prediction error past which the planner corrects and re-plans"
)
REPLAN_REASONS = ("workload", "prediction_error")
for _reason in REPLAN_REASONS:  # exported at 0 from the start: "no re-plan yet" is a rate of 0, not "no data"
    REPLANS.labels(_reason)
EWMA = 0.2  # of the measured stage times
# The workload is learned as a running mean of the admitted requests: the expected workload counts as
# WORKLOAD_PRIOR of them, and each request then weighs 1 / (requests seen + WORKLOAD_PRIOR), down to
# 1 / WORKLOAD_WINDOW (a moving average over about the last 128). An EWMA of 0.2 per request swung
# by +-50 % within one burst of MT-Bench prompts (their spread is 0.82 of the mean) and re-planned the
# batch and micro-batches 9 times as 256 requests arrived, the plan in force when the batch filled
# decided by which came last (int8 at 256 prompts ran at 412 or 481 tok/s from one run to the next).
WORKLOAD_PRIOR = 16
WORKLOAD_WINDOW = 128
# Where host and device are the same cores, the plan keeps the fewest micro-batches whose predicted
# throughput is within this share of the fastest's: nothing overlaps there, so more micro-batches can
# only win by a few more sequences, while each pays its per-layer calls and hand-offs and its attention
# competes for the cores with the others' experts, none of which the roofline sees. A fixed batch of 256
# was planned as 7 micro-batches of 37 (259 sequences, 3 of which never come) for a predicted +1 %, and
# ran fp32 at 256 prompts 17 % slower. On a GPU box CGOPipe's overlap is what micro-batches buy, and the
# fastest prediction stands.
PLAN_TOLERANCE = 0.03
DRIFT_ROWS = ("device", "attention")  # rows of hrm.stage_accuracy: device roofs, then the CPU's


@dataclass(slots=True)
class PlannerConfig:
    threshold: float = 0.25  # relative error that counts as drift
    patience: int = 20  # consecutive drifted decode steps before correcting
    batch_cap: int = 4096
    workload_drift: float = 0.5  # relative change of the learned workload that triggers a re-plan


class Planner:
    def __init__(
        self,
        spec: ModelSpec,
        profile: HardwareProfile,
        workload: Workload,
        dtype: str,
        kv_tokens: int,
        config: PlannerConfig | None = None,
        attention: tuple[str, ...] = ("cpu",),
        experts: tuple[str, ...] = ("gpu",),
        device_kv_tokens: int = 0,
        resident_experts: int | None = None,
        max_micro_batch: int | None = None,
        kv_dtype: str | None = None,
        quant: QuantScheme = NO_QUANT,
        kv_rule: str = EXPECTED_USE,
        kv_block_size: int = 1,
        expert_groups: tuple[int, ...] = EXPERT_GROUP_CHOICES,
    ) -> None:
        """`attention` / `experts`: the placements the running services support (and the operator
        allows); `kv_tokens` is the attention service's cache, `device_kv_tokens` gpu_expert's;
        `kv_dtype` the format the attention service's cache stores (default: the weights'); `quant` the
        format of the expert pages the weight store serves (default: the model dtype). `kv_rule`:
        "expected" for the batcher's kv_admission "need", "max" for "reserve"
        (layercost.KV_RULE_FOR_ADMISSION); `kv_block_size`: the caches' tokens per block (a sequence
        leaves its last block half empty on average). `expert_groups`: the schedules of a layer's experts
        the search may pick (hrm/costmodel.py Policy.expert_groups: 0 per micro-batch, g groups)."""
        self.spec = spec
        self.profile = profile
        self.workload = workload
        self.planned_workload = workload
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.quant = quant
        self.kv_rule = check_kv_rule(kv_rule)
        self.kv_block_size = max(1, kv_block_size)
        self.kv_layout = KVLayout.of(spec, self.kv_block_size)  # `kv_tokens`: tokens in every layer (KVCapacity)
        self._prompt_var = workload.prompt_std**2  # of the prompt lengths, learned as their mean is
        self._requests = 0  # admitted so far: the workload's learning rate (WORKLOAD_PRIOR)
        self._gen_len = float(workload.gen_len)  # unrounded: a small rate's steps would round away
        self.kv_tokens = {"cpu": kv_tokens, "gpu": device_kv_tokens}
        self.attention = attention
        self.experts = experts
        self.expert_groups = expert_groups
        self.resident_experts = resident_experts  # what gpu_expert holds, when known
        self.max_micro_batch = max_micro_batch  # what one hand-off carries (decode: a token per sequence)
        self.config = config or PlannerConfig()
        THRESHOLD.set(self.config.threshold)
        self.fixed_batch: int | None = None  # set by the operator's flags: the policy does not override
        self.fixed_micro_batch: int | None = None
        self.fixed_prefill_budget: int | None = None  # --prefill-budget
        self.fixed_expert_groups: int | None = None  # --expert-groups
        self.log = structlog.get_logger()
        self._lock = threading.Lock()
        self._measured: dict[str, float] = {}
        self._drift_steps = dict.fromkeys(DRIFT_ROWS, 0)
        self.estimate = self._optimize()
        self._publish("initial plan")

    # ---- planning ------------------------------------------------------------------------------
    def sequences_held(self, tokens: int) -> int:
        """How many sequences of the current workload a cache of `tokens` KV tokens holds by the rule
        (at least one: a cache smaller than the expected request still serves shorter ones)."""
        w = self.workload
        # blocks round each sequence up: (B - 1) / 2 tokens on average, as if every prompt were longer
        blocked = replace(w, prompt_len=w.prompt_len + (self.kv_block_size - 1) / 2)
        if self.kv_rule != MAX_CONTEXT:  # taken by need: sliding layers hold only their window's blocks
            tokens = int(tokens / self.kv_layout.held_share(blocked.avg_context))
        return max(1, kv_sequences(tokens, blocked, self.kv_rule))

    @property
    def kv_cache_sequences(self) -> int:
        """The sequences the cache attention reads holds for the current workload."""
        return self.sequences_held(self.kv_tokens[self.policy.attention])

    def fix(
        self,
        batch: int | None = None,
        micro_batch: int | None = None,
        prefill_budget: int | None = None,
        expert_groups: int | None = None,
    ) -> None:
        """The operator's fixed values (None: the policy's). A fixed micro-batch size (and batch) is
        planned around, so the expert schedule, the prefill budget and the predictions are those of
        what runs: with mu fixed, grouping the micro-batches' experts can pay where a larger mu would
        have (docs/hrm.md "Experts once per group")."""
        self.fixed_batch, self.fixed_micro_batch = batch, micro_batch
        self.fixed_prefill_budget, self.fixed_expert_groups = prefill_budget, expert_groups
        if micro_batch or batch:
            with self._lock:
                self.estimate = self._optimize()
                self._publish("the operator's batch or micro-batch size")

    def _fixed_sizes(self) -> list[dict[str, tuple[int, ...]]]:
        """optimize()'s mus / n_ubs for the operator's fixed sizes, one search each ([{}]: the whole
        search). A fixed batch with the micro-batch free is searched as the micro-batches that cover it:
        the free search's (N, mu) would otherwise run as ceil(batch / mu) micro-batches of a batch it
        never planned (a CPU-only run then split its batch in two for nothing)."""
        mu, batch = self.fixed_micro_batch, self.fixed_batch
        if mu:
            return [{"mus": (mu,), "n_ubs": (-(-batch // mu),)} if batch else {"mus": (mu,)}]
        if not batch:
            return [{}]
        if mu == 0:  # one micro-batch of the whole batch
            return [{"mus": (batch,), "n_ubs": (1,)}]
        widest = min(batch, self.max_micro_batch or batch)
        sizes = {-(-batch // n_ub) for n_ub in micro_batch_counts(batch)}
        # the widest first, so that it wins a tie: the roofline sees no cost in more micro-batches where
        # each stays compute-bound, but every micro-batch pays its per-layer calls (norms, RoPE, hand-offs)
        return [{"mus": (m,), "n_ubs": (-(-batch // m),)} for m in sorted(sizes, reverse=True) if m <= widest]

    def _optimize(self) -> Estimate:
        try:
            return self._optimize_within(self._fixed_sizes())
        except ValueError:
            if self._fixed_sizes() == [{}]:
                raise
        # the fixed sizes do not fit the model's estimate of memory (the operator may know the workload
        # better): the placement of a free plan, at the sizes that will run
        free = self._optimize_within([{}])
        self.log.warning("fixed_sizes_above_the_plan", batch=self.fixed_batch, micro_batch=self.fixed_micro_batch)
        if not self.fixed_batch:
            return free
        estimates = [
            self._estimate(replace(free.policy, batch=n_ub * mu, micro_batch_size=mu, expert_groups=g))
            for sizes in self._fixed_sizes()
            for mu, n_ub in zip(sizes["mus"], sizes["n_ubs"], strict=True)
            for g in self.expert_groups
        ]
        return max(estimates, key=self._served)  # the first of the fastest, at the batch that runs

    def _estimate(self, policy: Policy) -> Estimate:
        return estimate(
            self.spec,
            self.workload,
            self.profile,
            policy,
            self.dtype,
            kv_dtype=self.kv_dtype,
            quant=self.quant,
            kv_rule=self.kv_rule,
        )

    def _optimize_within(self, searches: list[dict[str, tuple[int, ...]]]) -> Estimate:
        """The fastest plan of any of the searches (optimize()'s mus / n_ubs), over the placements."""
        best: Estimate | None = None
        self.alternatives: dict[str, float] = {}  # "attention/experts" -> best predicted tokens/s
        for att in self.attention:
            if self.kv_tokens[att] <= 0:
                continue  # no KV cache there
            cap = min(self.config.batch_cap, self.sequences_held(self.kv_tokens[att]))
            for exp in self.experts:
                found = [est for sizes in searches if (est := self._search(att, exp, cap, sizes)) is not None]
                if not found:
                    continue
                est = self._fewest_micro_batches(att, exp, cap, found, free=searches == [{}])
                self.alternatives[f"{att}/{exp}"] = round(est.tokens_per_second, 2)
                if best is None or self._served(est) > self._served(best):
                    best = est
        if best is None:
            if searches != [{}]:
                raise ValueError("no policy fits the fixed batch or micro-batch size")
            raise ValueError(f"no attention placement in {self.attention} has a KV cache")
        self.attention = (best.policy.attention,)  # the KV cache lives there now: re-plans keep it
        return best

    def _fewest_micro_batches(self, att: str, exp: str, cap: int, found: list[Estimate], free: bool) -> Estimate:
        """Of the searches' plans (the fewest micro-batches first), the first whose throughput at the
        batch that runs is within PLAN_TOLERANCE of the fastest's (on shared cores; elsewhere the
        fastest). A free search found one plan: those with fewer micro-batches are searched here, one
        count at a time, until one is within it."""
        tolerance = PLAN_TOLERANCE if self.profile.shared_host_device else 0.0
        floor = (1 - tolerance) * max(map(self._served, found))
        if free and tolerance:
            best = found[0]
            for n_ub in range(1, -(-best.policy.batch // best.policy.micro_batch_size)):
                est = self._search(att, exp, cap, {"n_ubs": (n_ub,)})
                if est is not None and self._served(est) >= floor:
                    return est
            return found[0]
        return next(est for est in found if self._served(est) >= floor)

    def _served(self, est: Estimate) -> float:
        """Predicted tokens/s of the batch that runs: a fixed batch covered by ceil(batch / n_ub)-sized
        micro-batches is planned as a few sequences more than it has, which never come."""
        if self.fixed_batch and est.policy.batch > self.fixed_batch:
            return est.tokens_per_second * self.fixed_batch / est.policy.batch
        return est.tokens_per_second

    def _search(self, att: str, exp: str, cap: int, sizes: dict[str, tuple[int, ...]]) -> Estimate | None:
        """optimize() at one placement; None where nothing fits at these fixed sizes."""
        try:
            return optimize(
                self.spec,
                self.workload,
                self.profile,
                self.dtype,
                batch_cap=cap,
                attention=(att,),
                experts=(exp,),
                resident=self.resident_experts,
                max_micro_batch=self.max_micro_batch,
                kv_dtype=self.kv_dtype,
                quant=self.quant,
                kv_rule=self.kv_rule,
                expert_groups=self.expert_groups,
                **sizes,  # type: ignore[arg-type]
            )
        except ValueError:
            if not sizes:  # the whole search: its reason is the answer
                raise
            return None

    @property
    def policy(self) -> Policy:
        return self.estimate.policy

    def _publish(self, reason: str) -> None:
        p = self.estimate.policy
        POLICY.info(
            {
                "batch_size": str(p.batch),
                "micro_batch_size": str(p.micro_batch_size),
                "attention": p.attention,
                "experts": p.experts,
                "resident_experts": str(p.resident_experts),
                "expert_groups": str(p.expert_groups),
                "reason": reason,
            }
        )
        PREDICTED_TPS.set(self.estimate.tokens_per_second)

    def _replan(self, reason: str, detail: dict[str, float]) -> Policy | None:
        old = self.estimate
        self.estimate = self._optimize()
        self.planned_workload = self.workload
        REPLANS.labels(reason).inc()
        self._publish(reason)
        self.log.info(
            "replanned",
            reason=reason,
            **detail,
            old_policy=f"N={old.policy.batch} mu={old.policy.micro_batch_size} groups={old.policy.expert_groups}",
            new_policy=f"N={self.policy.batch} mu={self.policy.micro_batch_size} groups={self.policy.expert_groups}",
            old_tokens_per_second=round(old.tokens_per_second, 2),
            new_tokens_per_second=round(self.estimate.tokens_per_second, 2),
        )
        return self.policy if self.policy != old.policy else None

    def publish_in_force(self, batch: int, micro_batch: int, expert_groups: int) -> None:
        """The HRM's generated tokens/s of a long job at what runs (the operator's fixed values
        included), under both step schedules (hrm/schedule_cost.py): beside the measured rate."""
        mu = micro_batch or batch
        n_ub = -(-batch // mu)
        with self._lock:
            policy = replace(self.policy, batch=n_ub * mu, micro_batch_size=mu, expert_groups=expert_groups)
            est = self._estimate(policy)
            predicted = schedule_throughput(self.spec, self.workload, est)
        PREDICTED_IN_FORCE.labels("mixed").set(predicted.mixed)
        PREDICTED_IN_FORCE.labels("alternating").set(predicted.alternating)

    # ---- observations --------------------------------------------------------------------------
    def observe_request(self, prompt_len: int, max_new_tokens: int) -> Policy | None:
        with self._lock:
            w = self.workload
            self._requests += 1
            rate = max(1 / WORKLOAD_WINDOW, 1 / (self._requests + WORKLOAD_PRIOR))
            # the weighted mean and variance (West's update): the spread sizes the headroom
            diff = prompt_len - w.prompt_len
            self._prompt_var = (1 - rate) * (self._prompt_var + diff * rate * diff)
            # max_new_tokens, not what ran: a sequence's length is not known until it stops
            self._gen_len += rate * (max_new_tokens - self._gen_len)
            self.workload = Workload(w.prompt_len + rate * diff, max(1, round(self._gen_len)), self._prompt_var**0.5)
            old = self.planned_workload
            drift = max(
                abs(self.workload.prompt_len / old.prompt_len - 1), abs(self.workload.gen_len / old.gen_len - 1)
            )
            if drift > self.config.workload_drift:
                return self._replan(
                    "workload", {"prompt_len": self.workload.prompt_len, "gen_len": self.workload.gen_len}
                )
            return None

    def observe_step(self, batch: int, micro_batch: int, timings: StepTimings) -> Policy | None:
        """A decode step's timings from gpu_expert; returns a new policy when it re-planned (a
        prefill step's timings are not compared: None)."""
        if timings.kind is not StepKind.DECODE:
            return None
        rows = measured_per_layer(timings, 1, self.spec.num_layers)
        measured = {row: rows[row] for row in DRIFT_ROWS}
        n_ub = -(-batch // micro_batch)  # the last micro-batch may be partial: model it as full
        with self._lock:
            p = self.policy
            est = self._estimate(replace(p, batch=n_ub * micro_batch, micro_batch_size=micro_batch))
            predicted = predicted_per_layer(est)
            for stage in measured:
                prev = self._measured.get(stage, measured[stage])
                self._measured[stage] = prev + EWMA * (measured[stage] - prev)
                PREDICTED.labels(stage).set(predicted[stage])
                MEASURED.labels(stage).set(self._measured[stage])
                known = predicted[stage] and self._measured[stage]  # a zero on either side is no evidence
                off = abs(self._measured[stage] / predicted[stage] - 1) if known else 0.0
                self._drift_steps[stage] = self._drift_steps[stage] + 1 if off > self.config.threshold else 0
            drifted = [st for st, n in self._drift_steps.items() if n >= self.config.patience]
            if not drifted:
                return None
            factors = {st: predicted[st] / self._measured[st] for st in drifted}
            if "device" in drifted:
                f = factors["device"]  # every device roof, the measured expert GEMM's included
                self.profile = self.profile.scaled(gpu_flops=f, gpu_bandwidth=f, expert_flops=f, expert_bandwidth=f)
            if "attention" in drifted:
                f = factors["attention"]
                self.profile = self.profile.scaled(cpu_flops=f, cpu_bandwidth=f)
            self.profile = replace(self.profile, source=f"{self.profile.source} (corrected online)")
            for st in drifted:
                self._drift_steps[st] = 0
            return self._replan("prediction_error", {f"{st}_scale": round(f, 3) for st, f in factors.items()})
