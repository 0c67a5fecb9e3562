"""run: the offline batch job. Reads prompts from Parquet/JSONL, generates, writes Parquet; or reads an
OpenAI Batch file (JSONL of /v1/completions and /v1/chat/completions requests) and writes the
OpenAI Batch output (commands/openai_batch.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from moe_lightning.batch_rows import completion_columns, row_prompt
from moe_lightning.commands.common import add_client_flags, add_sampling_flags, add_where_flags
from moe_lightning.config import flags
from moe_lightning.config.checks import link_flag_error
from moe_lightning.config.job import RowDefaults
from moe_lightning.config.stack import EXPOSURE, StackConfig


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="offline batch job: prompts file in, Parquet out")
    add_where_flags(p)  # --model: a stack of the job's own on this checkpoint, stopped after it
    add_client_flags(p)
    p.add_argument(
        "--input",
        required=True,
        type=Path,
        help="prompts.parquet or prompts.jsonl (a 'prompt' or 'prompt_ids' column), or an OpenAI Batch .jsonl",
    )
    p.add_argument("--output", required=True, type=Path, help="results .parquet (an OpenAI Batch input: .jsonl)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output file of yours (refused otherwise, before the job starts; a symbolic "
        "link or another user's file is refused always). Not with --ray: its output directory is resumed",
    )
    add_sampling_flags(p)
    p.add_argument("--chunk-size", type=int, default=64, help="prompts per BatchGenerate call")
    p.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="BatchGenerate calls in flight (0 = enough to fill the batch the server plans, plus one chunk, "
        "within its queue; asked again as it re-plans)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help="run over a Ray cluster (docs/cluster.md): one stack per node (--model: started on each; --addr: "
        "the one running at that address on each node); --input may be a directory or glob of files, --output "
        "is then a directory of Parquet parts; ADDRESS as `ray start` printed it (default: auto)",
    )
    p.add_argument(
        "--part-rows", type=int, default=512, help="with --ray: rows per part (the unit of retry and resume)"
    )
    p.add_argument("--retries", type=int, default=3, help="with --ray: times a failed part is given to a node again")
    flags.NO_PROGRESS.add_to(p, default=False)
    p.add_argument("--show", type=int, default=0, help="print the first N prompts and their completions")
    StackConfig.add_cli_args(p, exclude=EXPOSURE)


def read_prompts(path: Path) -> Any:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        table = pq.read_table(path)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        table = pj.read_json(path)
    else:
        raise ValueError(f"{path}: input must be .parquet or .jsonl")
    if "prompt" not in table.column_names and "prompt_ids" not in table.column_names:
        raise ValueError(f"{path}: each row needs a 'prompt' (text) or 'prompt_ids' (list of ints) column")
    return table


def run(args: argparse.Namespace) -> int:
    from moe_lightning.commands import openai_batch
    from moe_lightning.output_files import check_output_file

    error = link_flag_error(args.device, getattr(args, "link_bandwidth", None))
    if error:  # before anything starts, --ray included (gpu_expert would refuse it only seconds into start-up)
        raise ValueError(error)
    if args.ray is not None:
        if args.overwrite:
            raise ValueError(
                "--overwrite is for one output file; a --ray output directory is resumed "
                "(give another --output to start afresh)"
            )
        try:
            from moe_lightning.cluster.driver import run_on_ray
        except ImportError as exc:
            raise ValueError(f"--ray needs Ray: pip install 'moe-lightning[ray]' ({exc})") from None
        args.input_spec, args.output_spec = str(args.input), str(args.output)
        return run_on_ray(args)

    if openai_batch.is_openai_batch(args.input):
        if args.output.suffix != ".jsonl":
            raise ValueError(
                f"an OpenAI Batch input is answered in the OpenAI Batch output: --output *.jsonl, not {args.output}"
            )
        check_output_file(args.output, args.overwrite)  # before the job, not after an hour of it
        lines = openai_batch.read_batch(args.input)

        def submit(addr: str) -> int:
            return _submit_openai(args, addr, lines)
    else:
        check_output_file(args.output, args.overwrite)  # before the job, not after an hour of it
        table = read_prompts(args.input)
        defaults = RowDefaults.from_cli_args(args)
        prompts = [row_prompt(r, defaults, i) for i, r in enumerate(table.to_pylist())]

        def submit(addr: str) -> int:
            return _submit(args, addr, table, prompts)

    if args.addr:
        return submit(args.addr)
    from moe_lightning.launcher import Stack
    from moe_lightning.private_paths import private_dir

    config = StackConfig.for_command(args, port=0)
    if config.log_dir is None:  # keep the job's output readable; the services' logs go to files (ours only)
        config.log_dir = private_dir(prefix=f"moe-lightning-{config.run_id}-logs-")
    stack = Stack(config)
    sys.stderr.write(f"starting the stack (service logs in {config.log_dir})...\n")
    t0 = time.perf_counter()
    try:
        stack.start()
        sys.stderr.write(f"stack SERVING after {time.perf_counter() - t0:.1f} s\n")
        return submit(stack.api_address)
    finally:
        stack.stop()


def _client(args: argparse.Namespace, addr: str) -> Any:
    from moe_lightning.client import GenerationClient

    return GenerationClient(
        addr, tls_ca=args.tls_ca, token=args.auth_token, allow_insecure_token=args.allow_insecure_token
    )


def _submit_openai(args: argparse.Namespace, addr: str, lines: list[Any]) -> int:
    from tqdm import tqdm

    from moe_lightning.commands import openai_batch

    t0 = time.perf_counter()
    with _client(args, addr) as client, tqdm(total=len(lines), unit="request", disable=args.no_progress) as bar:
        model = Path(client.model_info().model.model_path).name
        meta = client.server_metadata()
        formats = openai_batch.OutputFormats(meta.tool_call_format, meta.reasoning_format)
        openai_batch.with_formats(lines, formats)
        metadata = client._metadata or ()
        openai_batch.run_batch(lines, client.stub, metadata, args.chunk_size, max(1, args.in_flight or 4), bar.update)
    openai_batch.write_results(lines, model, args.output, args.overwrite, formats)
    failed = sum(line.error is not None for line in lines)
    sys.stderr.write(
        f"{len(lines)} requests ({failed} failed) in {time.perf_counter() - t0:.2f} s; wrote {args.output}\n"
    )
    return 0


def write_table(table: Any, path: Path, overwrite: bool = False) -> None:
    """The job's Parquet output, written as every output of a job is (output_files.py: whole or not at
    all, never through a symbolic link or into another user's file; an own file only with `overwrite`),
    the path checked again now and just before the file appears."""
    import pyarrow.parquet as pq

    from moe_lightning.output_files import output_file

    with output_file(path, overwrite) as f:
        pq.write_table(table, f)


def _submit(args: argparse.Namespace, addr: str, table: Any, prompts: list[Any]) -> int:
    import pyarrow as pa
    from tqdm import tqdm

    from moe_lightning.client import BatchError

    t0 = time.perf_counter()
    with _client(args, addr) as client, tqdm(total=len(prompts), unit="prompt", disable=args.no_progress) as bar:
        try:
            done = client.batch_generate_all(
                prompts,
                args.chunk_size,
                args.in_flight,
                on_result=lambda _i, _c: bar.update(1),  # completion order: the bar moves as chunks finish
                on_plan=lambda plan: tqdm.write(plan.describe(), file=sys.stderr),
            )
        except BatchError as exc:
            sys.stderr.write(f"error: {exc}; nothing written\n")
            return 1
    wall = time.perf_counter() - t0
    columns = completion_columns(done)
    out = table
    for name, col in columns.items():
        if name in out.column_names:
            out = out.drop_columns([name])
        out = out.append_column(name, pa.array(col) if not isinstance(col, pa.Array) else col)
    write_table(out, args.output, args.overwrite)
    for row, r in list(zip(table.to_pylist(), done, strict=True))[: args.show]:
        prompt = row.get("prompt") if row.get("prompt") is not None else row.get("prompt_ids")
        sys.stdout.write(f"> {prompt!s:.70}\n  {r.text!r:.200}\n")
    generated = sum(r.completion_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    lat = sorted(r.total_seconds for r in done)
    preempted = sum(r.preemptions > 0 for r in done)
    sys.stderr.write(
        f"{len(done)} prompts, {prompt_tokens} prompt tokens, {generated} generated tokens in {wall:.2f} s: "
        f"{generated / wall:.1f} generated tok/s; latency p50 {lat[len(lat) // 2]:.2f} s, "
        f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.2f} s; {sum(r.preemptions for r in done)} "
        f"preemptions ({preempted} prompts re-prefilled, docs/kv-cache.md); wrote {args.output}\n"
    )
    return 0
