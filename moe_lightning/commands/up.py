"""up: start the four services, wait until all are SERVING, print the endpoints, stop on a signal."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from moe_lightning.commands.common import add_stack_flags


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="run the whole stack (four processes) until Ctrl-C / SIGTERM")
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the public API (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="port of the public API (0 = any free port)")
    add_stack_flags(p)
    p.add_argument("--json", action="store_true", help="print the endpoints as one JSON object")
    p.add_argument(
        "--no-restart", action="store_true", help="stop the stack when a service exits (default: restart it)"
    )


def stack_config(args: argparse.Namespace, port: int, host: str = "127.0.0.1") -> Any:
    from moe_lightning.launcher import StackConfig

    return StackConfig(
        model=args.model,
        run_id=args.run_id or f"up{os.getpid()}",
        host=host,
        port=port,
        device=args.device,
        device_memory=args.device_memory,
        device_kv_memory=args.device_kv_memory,
        attention_placement=args.attention_placement,
        experts_placement=args.experts_placement,
        kv_cache_memory=args.kv_cache_memory,
        kv_dtype=args.kv_dtype,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        micro_batch_size=args.micro_batch_size,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        auth_token=getattr(args, "auth_token", None),
    )


def run(args: argparse.Namespace) -> int:
    from moe_lightning.launcher import Stack, StackInterrupted

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(stack_config(args, args.port, args.host))
    try:
        try:
            stack.start(stop=stop)  # a signal during start-up gives it up at once, not once all are SERVING
        except StackInterrupted:
            sys.stderr.write("moe-lightning: stopped during start-up\n")
            return 0
        if stop.is_set():
            return 0
        endpoints = stack.endpoints()
        if args.json:
            sys.stdout.write(json.dumps(endpoints) + "\n")
        else:
            sys.stdout.write(f"moe-lightning is serving {args.model} (run id {stack.config.run_id})\n")
            for name, e in endpoints.items():
                sys.stdout.write(f"  {name:<14} grpc {e['grpc']:<48} metrics {e['metrics']}\n")
            sys.stdout.write("Ctrl-C or SIGTERM stops every service.\n")
        sys.stdout.flush()
        if not args.no_restart:
            stack.supervise()
        while not stop.wait(0.5):
            dead = [n for n, p in stack.procs.items() if p.poll() is not None]
            if dead and (args.no_restart or stack.gave_up):
                sys.stderr.write(f"error: {', '.join(dead)} exited; stopping the stack\n")
                return 1
        return 0
    finally:
        swept = stack.stop()
        if swept:
            sys.stderr.write(f"removed {len(swept)} leftover shared-memory objects\n")
