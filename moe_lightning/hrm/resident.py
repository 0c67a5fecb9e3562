"""Per point of the search's grid (hrm/optimizer.py), the count of expert pages resident on the
device: the largest that fits where the experts compute on the device (memory is linear in the count
and throughput never falls with it), the best of a V-shaped curve where they compute on the host."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from moe_lightning.hrm.layercost import CostModel, LayerCost

if TYPE_CHECKING:
    from moe_lightning.hrm.optimizer import Grid


def best_resident(model: CostModel, g: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Per point, the resident count that is best among those that fit, and its tokens/s (-inf where
    none fits). Memory is linear in the count: hrm_reference.best_resident's steps, on arrays."""
    e, gpu_cap, cpu_cap = model.total_experts, model.gpu_capacity, model.cpu_capacity
    low, high = g.cost(model, 0), g.cost(model, e)
    slope = (high.gpu_bytes - low.gpu_bytes) / e
    high_fits, low_over = high.gpu_bytes <= gpu_cap, low.gpu_bytes > gpu_cap
    alive = (low.cpu_bytes <= cpu_cap) & (high_fits | ~low_over | (slope < 0))
    with np.errstate(divide="ignore", invalid="ignore"):  # a branch not taken may divide by 0
        over = np.ceil((low.gpu_bytes - gpu_cap) / -slope)
        under = np.where(slope <= 0, e, np.floor((gpu_cap - low.gpu_bytes) / slope))
    j = np.where(high_fits, e, np.where(low_over, over, under))
    j = np.clip(np.where(alive, j, 0), 0, e).astype(np.int64)
    done = alive & high_fits & g.exp_gpu  # every page fits on the device: nothing streams
    tokens = np.where(done, high.tokens, -math.inf)
    # the double buffer shrinks in whole experts, so memory is only nearly linear: step down to a fit
    top_tokens, top_gpu, top_cpu = np.full(j.shape, -math.inf), np.zeros(j.shape), np.zeros(j.shape)
    top_compute = np.zeros(j.shape)
    todo = np.flatnonzero(alive & ~done)
    while todo.size:
        top = g.cost(model, j[todo], todo)
        fit = (top.gpu_bytes <= gpu_cap) & (top.cpu_bytes <= cpu_cap)
        top_tokens[todo[fit]], top_gpu[todo[fit]], top_cpu[todo[fit]] = top.tokens[fit], top.gpu[fit], top.cpu[fit]
        top_compute[todo[fit]] = top.gpu_compute[fit]
        todo = todo[~fit]
        j[todo] -= 1
        alive[todo[j[todo] < 0]] = False
        todo = todo[j[todo] >= 0]
    streaming = alive & ~done & g.exp_gpu
    tokens[streaming] = top_tokens[streaming]
    h = np.flatnonzero(alive & ~g.exp_gpu)
    tokens[h], j[h] = _best_on_host(model, g, low, h, j[h], top_tokens[h], (top_gpu[h], top_compute[h], top_cpu[h]))
    return tokens, j


def _best_on_host(
    model: CostModel,
    g: Grid,
    low: LayerCost,
    h: np.ndarray,
    top_j: np.ndarray,
    top_t: np.ndarray,
    top: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Experts on the host, at the points `h`: the best resident count up to top_j (the most that fit,
    `top` its gpu, gpu_compute and cpu times) and its tokens/s.

    Each resident expert moves work from the host to the device: device time rises and host time falls
    linearly with the count, so the layer time is V-shaped, its best next to where the two lines cross,
    or at an end. With the host's issue time (layercost.py) the device's time is max(compute, issue):
    it meets the host's line where the first of those two does, and the layer time has one more corner
    where compute passes the issue (up to it the device's time stays flat while the pipeline fill, a
    share of the falling host time, still shrinks), so the counts next to that corner are tried too."""
    top_gpu, top_compute, top_cpu = top
    cpu0 = low.cpu[h]

    def crossing(diff0: np.ndarray, diff1: np.ndarray) -> np.ndarray:
        """Where a line from diff0 (at 0) to diff1 (at top_j) crosses 0 (an end if it does not)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = top_j * diff0 / (diff0 - diff1)
        return np.where((diff0 < 0) & (diff1 > 0), inner, np.where(diff0 >= 0, 0, top_j))

    if model.hw.shared_host_device:  # the issue adds to the device's compute: still a line
        corners = [crossing(low.gpu[h] - cpu0, top_gpu - top_cpu)]
    else:
        issue, compute0 = low.issue[h], low.gpu_compute[h]  # the issue: the same at every count
        cross = crossing(compute0 - cpu0, top_compute - top_cpu)
        issued = issue > 0
        # without an issue time the second corner is 0, an end, which is tried anyway
        corners = [
            np.where(issued, np.minimum(cross, crossing(issue - cpu0, issue - top_cpu)), cross),
            np.where(issued, crossing(compute0 - issue, top_compute - issue), 0),
        ]

    def between(counts: np.ndarray, once: np.ndarray | bool = True) -> np.ndarray:
        """The tokens/s of the counts strictly between 0 and top_j (-inf for the others)."""
        ask = once & (counts != 0) & (counts != top_j)
        tokens = np.full(h.shape, -math.inf)
        tokens[ask] = g.cost(model, counts[ask], h[ask]).tokens
        return tokens

    # the first of the fastest: 0, top_j, then the counts either side of each corner, smallest first
    near = [np.minimum(top_j, np.maximum(0, r(c))).astype(np.int64) for c in corners for r in (np.floor, np.ceil)]
    counts = np.sort(np.stack(near), axis=0)
    best, count = low.tokens[h], np.zeros_like(top_j)
    tried = [(top_t, top_j)] + [(between(c, i == 0 or c != counts[i - 1]), c) for i, c in enumerate(counts)]
    for t, i in tried:
        faster = t > best
        best, count = np.where(faster, t, best), np.where(faster, i, count)
    keep = best >= top_t
    return np.where(keep, best, top_t), np.where(keep, count, top_j)
