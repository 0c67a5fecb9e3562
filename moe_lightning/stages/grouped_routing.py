"""DeepSeek-V3's router (GLM-4.5 uses the same one): sigmoid scores, a per-expert correction bias that
steers which experts are chosen but not how much they weigh, and a choice confined to the best expert
groups (node-limited routing: a token's experts sit on at most `topk_group` of `n_group` groups)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_grouped(
    x: torch.Tensor,
    router: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, D), router: (E, D), correction_bias: (E,) -> weights (T, A) fp32, expert ids (T, A) long.

    As transformers' DeepseekV3TopkRouter and Glm4MoeTopkRouter (the same code) compute it:
      1. logits in fp32 from x and the router both cast to fp32: transformers keeps `gate.weight` and
         `e_score_correction_bias` in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`), so keep
         both here in fp32 (or the checkpoint's own dtype): a router rounded to bf16 changes the choice;
      2. scores = sigmoid(logits); the bias is added for the choice only;
      3. each of the `n_group` groups of E / n_group consecutive experts is scored by the sum of its two
         best biased scores, and only the experts of the best `topk_group` groups stay eligible;
      4. the `top_k` best biased scores among those are the experts; their weights are the unbiased
         scores, divided by their sum (+ 1e-20) when `normalize`, then times `scaling_factor`.

    The ids' order within a token is not meaningful: the reference (and this) takes both top-k's with
    sorted=False, whose order differs between devices. Only the per-token set of (id, weight) pairs is
    defined, and it is all `experts_forward` depends on: it adds the experts' outputs by expert id, not
    by the position in the top-k list.
    """
    num_experts = router.shape[0]
    logits = F.linear(x.float(), router.float())  # (T, E) fp32, as the reference
    scores = logits.sigmoid()  # (T, E)
    choice = scores + correction_bias.float()  # (T, E) biased: for selection only
    if topk_group < n_group:  # with every group kept (GLM-4.5's n_group 1) the mask is a no-op
        grouped = choice.view(-1, n_group, num_experts // n_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G): each group's two best
        group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)  # (T, G)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(-1, num_experts)  # (T, E)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # (T, A)
    weights = scores.gather(1, ids)  # (T, A) the unbiased scores
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids
