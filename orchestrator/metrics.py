"""The orchestrator's Prometheus series (vLLM's set, plus per-stage and control-plane time)."""

from prometheus_client import Counter, Gauge, Histogram, Info

from moe_lightning.service.metrics import KV_USAGE  # noqa: F401  (re-exported: blocks reserved)
from moe_lightning.step_protocol import StepTimings
from moe_lightning.template_renderer import KILL_REASONS
from orchestrator.batcher import SchedulerConfig

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter("moe_lightning_requests_total", "Requests finished, by outcome", ["outcome"])
PROMPT_TOKENS = Counter("moe_lightning_prompt_tokens_total", "Prompt tokens of admitted requests")
GENERATION_TOKENS = Counter("moe_lightning_generation_tokens_total", "Tokens generated")
TTFT = Histogram("moe_lightning_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY)
TPOT = Histogram(
    "moe_lightning_time_per_output_token_seconds", "Mean time per token after the first", buckets=_PER_TOKEN
)
E2E = Histogram("moe_lightning_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY)
QUEUE_TIME = Histogram("moe_lightning_request_queue_time_seconds", "Arrival to admission", buckets=_LATENCY)
PREEMPTIONS = Counter(
    "moe_lightning_preemptions_total",
    "Running sequences preempted (KV freed, re-prefilled later) when the cache ran out",
)
RECOMPUTED_TOKENS = Counter("moe_lightning_recomputed_tokens_total", "Tokens re-prefilled after preemptions")
RUNNING = Gauge("moe_lightning_requests_running", "Requests in the running batch")
WAITING = Gauge("moe_lightning_requests_waiting", "Requests in the queue")
STEP_SECONDS = Histogram(
    "moe_lightning_step_seconds", "Wall time of one step seen by the orchestrator", ["kind"], buckets=_LATENCY
)
STAGE_SECONDS = Counter("moe_lightning_stage_seconds_total", "Time per stage reported by gpu_expert", ["stage", "kind"])
# Decode as its own rate, whatever the step schedule: a decode step's rows and wall time, and a mixed
# step's decode rows with the share of its wall time they are charged (StepTimings.decode / step,
# hrm/decode_share.py). decode tok/s = sum over kinds of tokens / sum of seconds.
DECODE_TOKENS = Counter("moe_lightning_decode_tokens_total", "Tokens decoded (a row per decoding sequence)", ["kind"])
DECODE_SECONDS = Counter(
    "moe_lightning_decode_seconds_total",
    "Step wall time charged to decoding: all of a decode step, a mixed step's decode share",
    ["kind"],
)
CONTROL_OVERHEAD = Counter(
    "moe_lightning_control_plane_seconds_total",
    "Step wall time at the orchestrator minus the step time inside gpu_expert",
)
# Powers of two up to twice the planner's batch cap: a client that cannot fill the planned batch shows
# up as steps in the buckets below it.
DECODE_BATCH = Histogram(
    "moe_lightning_decode_batch_size",
    "Sequences decoded together in one decode step",
    buckets=tuple(2**i for i in range(14)),
)

# What the scheduler runs with now: the HRM's plan, or the operator's --max-batch-size /
# --micro-batch-size; and the queue's bound (--max-queue), past which requests get RESOURCE_EXHAUSTED.
BATCH_IN_FORCE = Gauge("moe_lightning_max_batch_size", "Largest running batch in force (sequences)")
MICRO_BATCH_IN_FORCE = Gauge("moe_lightning_micro_batch_size", "Micro-batch size in force (sequences)")
EXPERT_GROUPS_IN_FORCE = Gauge(
    "moe_lightning_expert_groups", "Groups of micro-batches whose layer FFN runs at once (0: once per micro-batch)"
)
PREFILL_BUDGET_IN_FORCE = Gauge(
    "moe_lightning_prefill_budget_tokens", "Prompt tokens a mixed step takes on beside its decodes (--prefill-budget)"
)
STEP_SCHEDULE_IN_FORCE = Info("moe_lightning_step_schedule", "The step schedule in force (--step-schedule)")
MAX_QUEUE = Gauge("moe_lightning_max_queue_requests", "Requests that may wait before RESOURCE_EXHAUSTED (--max-queue)")
# The public API's calls in their handlers, and its bound (--max-concurrent-rpcs): one more is refused at
# once, RESOURCE_EXHAUSTED, counted here by reason as well as in moe_lightning_rpc_handled_total
RPCS_IN_PROGRESS = Gauge("moe_lightning_rpcs_in_progress", "Public API calls in progress (health and reflection aside)")
MAX_CONCURRENT_RPCS = Gauge(
    "moe_lightning_max_concurrent_rpcs", "Calls taken at once before RESOURCE_EXHAUSTED (--max-concurrent-rpcs)"
)
RPC_REFUSED = Counter(
    "moe_lightning_rpc_refused_total",
    "Calls refused before their handler ran (RESOURCE_EXHAUSTED), by reason",
    ["reason"],
)

# Renders whose renderer process was killed: past --chat-template-timeout, their client gone, or the
# renderer dead under them (a template that often times out shows here, not only in the latency)
CHAT_TEMPLATE_RENDERS_KILLED = Counter(
    "moe_lightning_chat_template_renders_killed_total",
    "Chat template renders whose renderer process was killed or died, by reason (timeout, cancelled, crashed)",
    ["reason"],
)
for _reason in KILL_REASONS:  # each series from the start, at 0, so a rate() sees its first kill
    CHAT_TEMPLATE_RENDERS_KILLED.labels(_reason)


def publish_config(config: SchedulerConfig) -> None:
    BATCH_IN_FORCE.set(config.max_batch_size)
    MICRO_BATCH_IN_FORCE.set(config.micro_batch_size or config.max_batch_size)  # 0: one micro-batch, the whole batch
    MAX_QUEUE.set(config.max_queue)
    EXPERT_GROUPS_IN_FORCE.set(config.expert_groups)
    PREFILL_BUDGET_IN_FORCE.set(config.prefill_budget or config.max_prefill_tokens)  # 0: a micro-batch's most
    STEP_SCHEDULE_IN_FORCE.info({"schedule": config.step_schedule})


def observe_step(decodes: int, wall: float, timings: StepTimings) -> None:
    """One finished step (its kind from the timings): its wall time, gpu_expert's stage times and,
    when it decoded, how many sequences it decoded."""
    kind = timings.kind.value
    STEP_SECONDS.labels(kind).observe(wall)
    for stage, ns in timings.stages().items():
        STAGE_SECONDS.labels(stage, kind).inc(ns / 1e9)
    CONTROL_OVERHEAD.inc(max(0.0, wall - timings.step / 1e9))
    if decodes:
        DECODE_BATCH.observe(decodes)
        DECODE_TOKENS.labels(kind).inc(decodes)
        share = timings.decode / timings.step if timings.step else 1.0
        DECODE_SECONDS.labels(kind).inc(wall * min(1.0, share))
