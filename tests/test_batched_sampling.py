"""The batched head (moe_lightning/sampling.py): a row's draw depends on its (seed, draw index) and logits
alone, not on the rows beside it nor on a preemption; the draws follow softmax(logits / T) after top-k
and top-p; the log-probabilities equal the row-by-row ones; and the host syncs of a step, counted
structurally on the CPU (moe_lightning/host_syncs.py), do not grow with its batch (issue 53)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moe_lightning import sampling
from moe_lightning.exponential_race import draw_seed, race_noise
from moe_lightning.host_syncs import count_host_syncs
from moe_lightning.sampling import (
    NOT_FINITE,
    SamplingParams,
    SequenceSampler,
    TokenLogprobs,
    sample,
    sampled_logprobs,
)

MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.2, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.8, seed=3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4),
    SamplingParams(temperature=1e-6, seed=5),
    SamplingParams(temperature=1.0, top_k=1, seed=6),  # greedy
    SamplingParams(temperature=2.0, top_k=5000, seed=7),  # a cut beyond the vocabulary: none
]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The row-by-row reference (the head's before issue 53). logits: (V,) raw."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return TokenLogprobs(token, float(lp[token]), ids.tolist(), values.tolist())


def test_the_noise_is_splitmix64_of_the_key_and_token() -> None:
    """The device's int64 arithmetic wraps as draw_seed's Python integers do, negative keys' shifts too."""
    keys = [0, 1, draw_seed(9, 3), 2**63 - 1, 2**62 + 12345]
    ids = [0, 1, 2, 31999, 151935, 2**31 - 1]
    bits = torch.tensor([[draw_seed(k, t) >> 40 for t in ids] for k in keys])
    want = ((bits.float() + 0.5) * 2.0**-23).log().neg().log()
    assert torch.equal(race_noise(torch.tensor(keys), torch.tensor([ids])), want)
    assert torch.equal(race_noise(torch.tensor(keys), torch.tensor([ids] * len(keys))), want)


def test_a_row_draws_the_same_token_whatever_sits_beside_it() -> None:
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), vocab, generator=g) * 3
    logits[2, [10, 11, 12]] = logits[2].max() + 1  # ties at the top
    rng = random.Random(0)
    for draw in range(3):
        keyed = [(p, None if p.greedy else draw_seed(p.seed or 0, draw)) for p in MIXED]
        alone = [int(sample(logits[b : b + 1], [p], [k])[0]) for b, (p, k) in enumerate(keyed)]
        assert alone[0] == int(logits[0].argmax()) and alone[6] == int(logits[6].argmax())
        # beside others, in any order, past the CPU's block of rows, and in the head's (V, B) layout
        extra = torch.randn(300, vocab, generator=g)
        extra_keyed = [(rng.choice(MIXED), draw_seed(rng.randrange(2**63), draw)) for _ in range(300)]
        for _ in range(3):
            order = list(range(len(MIXED) + 300))
            rng.shuffle(order)
            rows = torch.cat([logits, extra])[order]
            params, keys = zip(*[(keyed + extra_keyed)[i] for i in order], strict=True)
            for view in (rows, rows.T.contiguous().T):
                got = sample(view, params, keys).tolist()
                assert [got[order.index(b)] for b in range(len(MIXED))] == alone


@pytest.mark.parametrize("rows_at_once", [1, 7, 10**6], ids=["a-row", "blocks", "all-as-on-a-device"])
def test_the_cpus_blocks_of_rows_change_nothing(rows_at_once: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU samples a few rows at a time (cache), a device all at once: the same tokens and values."""
    vocab, batch = 300, 8 * len(MIXED)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, vocab, generator=g) * 2
    params = [MIXED[b % len(MIXED)] for b in range(batch)]
    keys = [None if p.greedy else draw_seed(b, 5) for b, p in enumerate(params)]
    asked = [(b, b % vocab, b % 7) for b in range(0, batch, 3)]
    want = sample(logits, params, keys), sampled_logprobs(logits, asked)
    monkeypatch.setattr(sampling, "_CPU_BLOCK", rows_at_once * vocab)
    threads = torch.get_num_threads()
    got = sample(logits, params, keys), sampled_logprobs(logits, asked)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert torch.get_num_threads() == threads  # a CPU samples on one thread, and gives the others back


def test_a_draw_after_a_preemption_is_the_one_the_batch_made() -> None:
    """Draw i made at step i of a batch is the one a sequence re-prefilled with draws=i makes, alone
    or in another batch (SequenceSampler.start(params, draws=i), as gpu_expert's runner does)."""
    vocab, steps = 500, 6
    g = torch.Generator().manual_seed(1)
    params = [p for p in MIXED if not p.greedy]
    samplers = [SequenceSampler.start(p) for p in params]
    step_logits = [torch.randn(len(params), vocab, generator=g) for _ in range(steps)]
    made = [sample(lg, params, [s.next_key() for s in samplers]).tolist() for lg in step_logits]
    for i in range(steps):
        for b, p in enumerate(params):
            resumed = SequenceSampler.start(p, draws=i)
            other = SequenceSampler.start(SamplingParams(temperature=1.0, top_p=0.5, seed=99), draws=3 * i)
            batch = torch.stack([torch.randn(vocab, generator=g), step_logits[i][b]])
            got = sample(batch, [other.params, p], [other.next_key(), resumed.next_key()]).tolist()[1]
            assert got == made[i][b]


def filtered_softmax(logits: list[float], p: SamplingParams) -> list[float]:
    """The distribution a draw must follow, in float64: softmax(logits / T), then top-k (ties at the
    k-th value kept), then top-p (a token goes once the mass before it reaches top_p)."""
    x = [v / p.temperature for v in logits]
    keep = set(range(len(x)))
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    if p.top_p < 1.0:
        total = sum(math.exp(x[i]) for i in keep)
        mass, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -x[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += math.exp(x[i]) / total
        keep = kept
    total = sum(math.exp(x[i]) for i in keep)
    return [math.exp(x[i]) / total if i in keep else 0.0 for i in range(len(x))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.5, seed=12),
        SamplingParams(temperature=2.0, top_k=3, seed=13),
        SamplingParams(temperature=1.0, top_p=0.7, seed=14),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=15),
    ],
    ids=["T1", "T0.5", "top_k", "top_p", "top_k+top_p"],
)
def test_the_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    logits = [2.0, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, -3.0]
    n = 40000
    want = filtered_softmax(logits, params)
    rows = torch.tensor([logits]).expand(n, -1)
    keys = [draw_seed(params.seed or 0, i) for i in range(n)]  # distinct draw indices
    counts = torch.bincount(sample(rows, [params] * n, keys), minlength=len(logits)).tolist()
    for token, (seen, p) in enumerate(zip(counts, want, strict=True)):
        if p == 0.0:
            assert seen == 0, f"token {token} is filtered out, drawn {seen} times"
        else:
            z = (seen - n * p) / math.sqrt(n * p * (1 - p)) if p < 1 else 0.0
            assert abs(z) < 4.5, f"token {token}: {seen} drawn, {n * p:.0f} expected"


def test_batched_logprobs_equal_the_row_by_row_ones() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 1000, generator=g) * 4
    asked = [(0, 5, 1), (2, 999, 20), (3, 0, 5), (5, 17, 0), (6, 400, 3)]
    want = [token_logprobs(logits[b], t, k) for b, t, k in asked]
    assert sampled_logprobs(logits, asked) == want
    assert sampled_logprobs(logits.T.contiguous().T, asked) == want  # the head's (V, B) layout
    small = torch.randn(2, 10, generator=g)  # a top beyond the vocabulary
    assert sampled_logprobs(small, [(1, 3, 20)]) == [token_logprobs(small[1], 3, 20)]
    assert sampled_logprobs(small, []) == []


@pytest.mark.parametrize("kinds", ["mixed", "greedy"])
def test_a_steps_host_syncs_do_not_grow_with_its_batch(kinds: str) -> None:
    """Under count_host_syncs: 4 rows or 64, sampling copies the tokens once and the log-probabilities
    once (the row-by-row head read each sampled token and 3 values per log-probability row)."""
    counts = []
    for batch in (4, 64):
        logits = torch.randn(batch, 2000, generator=torch.Generator().manual_seed(batch))
        params = [MIXED[1 + b % 5] if kinds == "mixed" else MIXED[0] for b in range(batch)]
        samplers = [SequenceSampler.start(p) for p in params]
        with count_host_syncs() as syncs:
            tokens = sample(logits, params, [s.next_key() for s in samplers])
            sampled_logprobs(logits, [(b, 0, 5) for b in range(batch)])
        assert tokens.shape == (batch,)
        counts.append(dict(syncs.kinds))
    assert counts[0] == counts[1] == {"cpu": 1, "tolist": 1}, counts


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_non_finite_rows_are_flagged_and_the_others_draw_as_without_them(layout: str) -> None:
    """Issue 54: NaN, +inf or no allowed token in some rows (a bad checkpoint, an overflowing penalty)
    flag those rows NOT_FINITE; every other row, greedy and drawn alike (top-k, top-p), gets the token
    it gets when the bad rows are sound, and the step still reads the device once."""
    params = MIXED * 3
    batch = len(params)
    clean = torch.randn(batch, 3000, generator=torch.Generator().manual_seed(5)) * 2
    if layout == "columns":  # the (V, B) tensor `weight_major` leaves, viewed as (B, V)
        clean = clean.T.contiguous().T
    bad = clean.clone()
    bad[0, 7] = float("nan")  # greedy
    bad[1, 2999] = float("nan")  # temperature alone
    bad[2, 100] = float("inf")  # top-k
    bad[11, :] = float("-inf")  # top-p: nothing allowed
    bad[12, 5] = float("-inf")  # -inf alone is a masked token, not a fault
    bad[20, [3, 4]] = torch.tensor([float("inf"), float("-inf")])  # top-k and top-p
    bad[22, 0] = float("nan")  # temperature, in the last block of rows
    flagged = {0, 1, 2, 11, 20, 22}
    keys = [SequenceSampler.start(p).next_key() for p in params]
    with count_host_syncs() as syncs:
        got = sample(bad, params, keys)
    assert dict(syncs.kinds) == {"cpu": 1}
    want = sample(clean, params, keys)
    assert {b for b, t in enumerate(got.tolist()) if t == NOT_FINITE} == flagged
    assert all(got[b] == want[b] for b in range(batch) if b not in flagged)
    only_greedy = sample(bad[:1], [MIXED[0]], [None]), sample(bad[[0, 3]], [MIXED[0]] * 2, [None] * 2)
    assert only_greedy[0].tolist() == [NOT_FINITE] and only_greedy[1].tolist() == [NOT_FINITE, clean[3].argmax()]


def test_the_counter_sees_each_kind_of_read_once_and_puts_torch_back() -> None:
    x = torch.randn(16)
    methods = {name: vars(torch.Tensor).get(name) for name in ("item", "tolist", "cpu", "to", "__bool__", "__int__")}
    with count_host_syncs() as syncs:
        x.sum().item()  # aten._local_scalar_dense underneath: one sync, not two
        x.tolist()
        x.cpu()
        x.to("cpu")
        x.to(torch.float64)  # no device: not a read
        bool(x[0] > 0)
        int(x.argmax())
        x.nonzero()
        x[x > 0]  # a boolean mask: nonzero underneath
        x.softmax(0).topk(3).values.sort()  # nothing read
    assert dict(syncs.kinds) == {
        "item": 1,
        "tolist": 1,
        "cpu": 1,
        "to": 1,
        "__bool__": 1,
        "__int__": 1,
        "aten.nonzero": 1,
        "aten.index": 1,
    }
    assert syncs.count == 8
    assert {name: vars(torch.Tensor).get(name) for name in methods} == methods
