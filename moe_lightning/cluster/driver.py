"""`moe-lightning run --ray [ADDRESS]`: the job's driver. Ray Data reads and splits the input into
parts (parts.py); every row's fields are checked (one Ray task per part, `check_rows`) before anything
is written or any stack starts; the driver then starts one NodeStack actor per alive Ray node (pinned
there), keeps each busy with a couple of parts so its stack's batch stays full across part
boundaries, and hands a failed part (its stack died, its node died) to the next free actor, up to
`--retries` times. Parts already in the output are skipped (resume). At the end the output is
checked (every input row once) and the job's numbers are printed and written next to it
(`_job.json`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import fields as dataclass_fields
from typing import Any

from moe_lightning.batch_rows import RowError
from moe_lightning.cluster.node import NodeStack, check_part
from moe_lightning.cluster.parts import (
    Part,
    check_output,
    check_plan,
    done_parts,
    input_files,
    output_dir,
    split,
    write_file,
)
from moe_lightning.config.job import NodeJob
from moe_lightning.config.stack import StackConfig

PARTS_PER_ACTOR = 2  # in flight per node: the next part's requests queue while the last finishes
COOL_DOWN = 15.0  # seconds a node whose part failed gets no new part: its stack is restarting


def stack_fields(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """The StackConfig each node's actor starts (the job's `up` options), with its own run id and ports."""
    config = StackConfig.for_command(args, port=0)
    # shallow (asdict would turn a DeviceShare into a dict): the values travel to the nodes as they are
    fields = {f.name: getattr(config, f.name) for f in dataclass_fields(config) if f.name != "run_dir"}
    fields["run_id"] = run_id
    fields["http_port"] = None
    return fields


def job_nodes(nodes: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The alive nodes a stack can run on: for a CUDA job, those with the GPUs it takes (a KubeRay
    head pod, or a CPU box in the cluster, gets no stack)."""
    alive = [n for n in nodes if n["Alive"]]
    if args.addr or not str(getattr(args, "device", "cpu")).startswith("cuda"):
        return alive
    need = max(1, getattr(args, "gpus", 1) or 1)
    with_gpus = [n for n in alive if n.get("Resources", {}).get("GPU", 0) >= need]
    if not with_gpus:
        raise RuntimeError(f"no alive Ray node has the {need} GPU(s) a --device cuda stack takes")
    return with_gpus


def check_rows(blocks: dict[Part, Any], args: argparse.Namespace) -> None:
    """Every input row's fields, converted as its node will convert them, before any stack starts: a
    bad field is refused (RowError, naming the row) as a single-box `run` refuses it, not found by a
    node once its stack is up, its part then failing on every retry. One Ray task per part, given
    the part's blocks from the object store (never through the driver); the first bad row wins."""
    import ray

    check = ray.remote(check_part)
    job = ray.put(NodeJob.from_cli_args(args))
    found = ray.get([check.remote(part, job, *ds.to_arrow_refs()) for part, ds in blocks.items()])
    bad = next((why for why in found if why is not None), None)
    if bad is not None:
        raise RowError(bad)


def run_on_ray(args: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import RayActorError, RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tqdm import tqdm

    t0 = time.perf_counter()
    fs_in, files = input_files(args.input_spec)
    fs_out, out = output_dir(args.output_spec)  # checked before Ray or any stack starts
    ray.init(address=args.ray, log_to_driver=False)
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = not args.no_progress
    try:
        blocks = dict(split(fs_in, files, args.part_rows))
        parts = list(blocks)
        check_rows(blocks, args)  # before anything is written or started
        check_plan(fs_out, out, args.part_rows, sum(p.rows for p in parts))
    except BaseException:
        ray.shutdown()  # a refused input ends the job here, in a process that may go on (a test)
        raise
    done = done_parts(fs_out, out)
    todo: deque[Part] = deque(p for p in parts if p.name not in done)
    sys.stderr.write(
        f"{len(files)} input file(s), {sum(p.rows for p in parts)} rows in {len(parts)} parts; "
        f"{len(parts) - len(todo)} already in {args.output_spec} (resumed)\n"
    )
    nodes = job_nodes(ray.nodes(), args)
    actor_cls = ray.remote(num_cpus=0, max_concurrency=PARTS_PER_ACTOR + 1)(NodeStack)
    actors = []
    for i, node in enumerate(nodes):
        stack = None if args.addr else stack_fields(args, f"{args.run_id or 'ray'}-n{i}")
        strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        actors.append(
            actor_cls.options(scheduling_strategy=strategy).remote(stack, args.addr, NodeJob.from_cli_args(args))
        )
    where = ray.get([a.where.remote() for a in actors])
    sys.stderr.write(f"{len(actors)} node(s): " + ", ".join(f"{n[:8]} at {addr}" for n, addr, _ in where) + "\n")
    stats: list[dict[str, Any]] = []
    attempts: dict[str, int] = {}
    pending: dict[Any, tuple[Part, Any]] = {}
    load = {id(a): 0 for a in actors}
    live = list(actors)
    resting: dict[int, float] = {}  # actor -> until when it gets no new part
    try:
        with tqdm(total=sum(p.rows for p in todo), unit="row", disable=args.no_progress) as bar:
            while todo or pending:
                now = time.monotonic()
                for actor in list(live):
                    while todo and load[id(actor)] < PARTS_PER_ACTOR and resting.get(id(actor), 0.0) <= now:
                        part = todo.popleft()
                        pending[actor.run.remote(part, blocks[part].to_arrow_refs())] = (part, actor)
                        load[id(actor)] += 1
                if not pending:  # every node is resting after a failure
                    time.sleep(0.5)
                    continue
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    part, actor = pending.pop(ref)
                    load[id(actor)] -= 1
                    try:
                        stats.append(ray.get(ref))
                        bar.update(part.rows)
                    except RayError as exc:  # the part failed on its node (its stack), or the node went away
                        attempts[part.name] = attempts.get(part.name, 0) + 1
                        what = str(exc).strip().splitlines()[-1][:200]
                        tqdm.write(f"{part.name} failed (attempt {attempts[part.name]}): {what}", file=sys.stderr)
                        if attempts[part.name] > args.retries:
                            raise RuntimeError(f"{part.name} failed {attempts[part.name]} times; stopping") from exc
                        todo.append(part)
                        resting[id(actor)] = time.monotonic() + COOL_DOWN
                        if isinstance(exc, RayActorError) and actor in live:  # its node (or process) is gone
                            live.remove(actor)
                if not live:
                    raise RuntimeError("every node's actor died")
    finally:
        for actor in live:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception:
                pass
        ray.shutdown()
    checked = check_output(fs_out, out, parts)
    summary = _summary(stats, checked, time.perf_counter() - t0, len(actors), attempts)
    write_file(fs_out, f"{out}/_job.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
    _print(summary)
    return 0


def _summary(stats: list[dict[str, Any]], checked: dict[str, Any], wall: float, nodes: int, retries: dict) -> dict:
    per_node: dict[str, dict[str, float]] = {}
    for s in stats:
        n = per_node.setdefault(s["node"], {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "busy_seconds": 0.0})
        for k in ("rows", "prompt_tokens", "completion_tokens"):
            n[k] += s[k]
        n["busy_seconds"] += s["seconds"]
    for n in per_node.values():
        n["generated_tokens_per_second"] = n["completion_tokens"] / wall
    generated = sum(s["completion_tokens"] for s in stats)
    return {
        **checked,
        "rows_this_run": sum(s["rows"] for s in stats),
        "nodes": nodes,
        "wall_seconds": wall,
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "completion_tokens": generated,
        "generated_tokens_per_second": generated / wall,
        "preemptions": sum(s.get("preemptions", 0) for s in stats),  # KV freed and re-prefilled (docs/kv-cache.md)
        "per_node": per_node,
        "retried_parts": retries,
    }


def _print(s: dict[str, Any]) -> None:
    sys.stderr.write(
        f"{s['rows']} rows checked (each once) in {s['parts']} parts over {s['nodes']} node(s); this run: "
        f"{s['rows_this_run']} rows, {s['completion_tokens']} generated tokens in {s['wall_seconds']:.1f} s, "
        f"{s['generated_tokens_per_second']:.1f} tok/s; {s['preemptions']} preemptions; retried parts: "
        f"{len(s['retried_parts'])}\n"
    )
    for node, n in s["per_node"].items():
        sys.stderr.write(
            f"  node {node[:8]}: {n['rows']} rows, {n['completion_tokens']} tokens, "
            f"{n['generated_tokens_per_second']:.1f} tok/s\n"
        )
