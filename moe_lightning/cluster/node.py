"""One node's share of a Ray job: an actor that owns (or attaches to) the node's stack and turns the
parts it is given into output parts, through our client with enough requests in flight to fill the
batch the stack's HRM planned."""

from __future__ import annotations

import os
import time
from typing import Any

import pyarrow as pa

from moe_lightning.batch_rows import RowError, completion_columns, row_prompt
from moe_lightning.cluster.parts import Part, output_dir, with_keys, write_part
from moe_lightning.config.job import NodeJob

SERVING_TIMEOUT = 300.0  # a restarting stack (a service died) comes back within this


def part_prompts(table: pa.Table, part: Part, job: NodeJob) -> list[Any]:
    """A part's rows as Prompts (row_prompt, each named by its row's index in the whole input)."""
    return [row_prompt(r, job.rows, part.start + i) for i, r in enumerate(table.to_pylist())]


def check_part(part: Part, job: NodeJob, *tables: pa.Table) -> str | None:
    """The first bad field in a part's rows (the RowError's message, naming the row), or None: run by
    the driver as a Ray task per part before any stack starts (`tables`: the part's blocks, which Ray
    hands the task where they are, never through the driver)."""
    try:
        part_prompts(with_keys(list(tables), part), part, job)
    except RowError as exc:
        return str(exc)
    return None


class NodeStack:
    def __init__(self, stack: dict[str, Any] | None, addr: str | None, job: NodeJob) -> None:
        """`stack`: StackConfig fields to start one on this node (stopped with the actor); else `addr`,
        a stack already running on this node (e.g. 127.0.0.1:50051 on each)."""
        import ray

        self.job = job
        self.node = ray.get_runtime_context().get_node_id()
        self.stack = None
        if stack is not None:
            from moe_lightning.config.stack import StackConfig
            from moe_lightning.launcher import Stack

            self.stack = Stack(StackConfig(**stack))
            self.stack.start()
            self.stack.supervise()  # a service that dies comes back; its parts meanwhile fail and go elsewhere
            addr = self.stack.api_address
        assert addr is not None
        self.addr = addr

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, this node's API address, pid): for logs and for a test that kills a stack."""
        return self.node, self.addr, os.getpid()

    def run(self, part: Part, blocks: list[Any]) -> dict[str, Any]:
        """`blocks`: the part's rows as Ray Data read them (references to Arrow tables in the object
        store); they come to this node, not through the driver."""
        import ray

        from moe_lightning.client import GenerationClient
        from moe_lightning.service.names import GENERATION
        from moe_lightning.service.upstream import wait_serving

        t0 = time.perf_counter()
        wait_serving(self.addr, GENERATION, SERVING_TIMEOUT).close()
        table = with_keys(ray.get(blocks), part)
        prompts = part_prompts(table, part, self.job)
        j = self.job
        try:
            with GenerationClient(
                self.addr, tls_ca=j.tls_ca, token=j.auth_token, allow_insecure_token=j.allow_insecure_token
            ) as client:
                done = client.batch_generate_all(prompts, j.chunk_size, j.in_flight)
        except Exception as exc:  # as plain text: Ray must carry it back to the driver (BatchError does not pickle)
            raise RuntimeError(f"{part.name} on node {self.node[:8]}: {exc}") from None
        for name, col in completion_columns(done).items():
            if name in table.column_names:
                table = table.drop_columns([name])
            table = table.append_column(name, col if isinstance(col, pa.Array) else pa.array(col))
        out_fs, out = output_dir(j.output_spec)
        write_part(out_fs, out, part, table)
        return {
            "node": self.node,
            "rows": part.rows,
            "prompt_tokens": sum(c.prompt_tokens for c in done),
            "completion_tokens": sum(c.completion_tokens for c in done),
            "preemptions": sum(c.preemptions for c in done),
            "seconds": time.perf_counter() - t0,
        }

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
