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
from moe_lightning.flags import link_flag_error, positive_int


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="run the whole stack (four services, the OpenAI HTTP gateway) until Ctrl-C")
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the public API (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="port of the public API (0 = any free port)")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="port of the OpenAI-compatible HTTP API on --host (0 = any free port; docs/openai.md)",
    )
    p.add_argument("--no-http", action="store_true", help="no HTTP gateway: the gRPC API only")
    p.add_argument(
        "--chat-template", type=Path, default=None, help="a Jinja chat template file (default: the model's own)"
    )
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="streams (gRPC and HTTP) send a message once this many tokens are new (1: every decode step; "
        "larger: less CPU per token for the server and its readers; docs/api.md)",
    )
    add_stack_flags(p)
    p.add_argument("--tls-cert", type=Path, default=None, help="serve the public API over TLS with this PEM cert")
    p.add_argument("--tls-key", type=Path, default=None, help="the PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help="PEM root that verifies --tls-cert, for up's own readiness check (default: the cert itself, self-signed)",
    )
    p.add_argument(
        "--auth-token",
        default=None,
        help="require 'authorization: Bearer TOKEN' on the public API (set it by environment: ps shows argv)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host beyond loopback without --auth-token (anyone who reaches the port may use the API)",
    )
    p.add_argument("--json", action="store_true", help="print the endpoints as one JSON object")
    p.add_argument(
        "--no-restart", action="store_true", help="stop the stack when a service exits (default: restart it)"
    )


def exposure_check(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(an error that refuses to start, warnings) for how `up` would expose the public API."""
    from moe_lightning.service.auth import is_loopback

    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if bool(cert) != bool(key):
        return "--tls-cert and --tls-key go together", []
    if is_loopback(args.host):
        return None, []
    token, insecure = getattr(args, "auth_token", None), getattr(args, "insecure", False)
    if not token and not insecure:
        return (
            f"--host {args.host} serves the API beyond this machine, and without --auth-token anyone who reaches "
            "the port may use it: set MOE_LIGHTNING_AUTH_TOKEN (and --tls-cert/--tls-key), or say --insecure",
            [],
        )
    warnings = []
    if not token:
        warnings.append(f"--insecure: the API on {args.host}:{args.port} takes calls from anyone, without a token")
    if not cert:
        warnings.append(f"no --tls-cert: the API on {args.host}:{args.port} is plaintext (tokens and prompts readable)")
    return None, warnings


def stack_config(args: argparse.Namespace, port: int, host: str = "127.0.0.1") -> Any:
    from moe_lightning.launcher import StackConfig

    return StackConfig(
        model=args.model,
        run_id=args.run_id or f"up{os.getpid()}",
        host=host,
        port=port,
        http_port=None if getattr(args, "no_http", True) else args.http_port,
        chat_template=getattr(args, "chat_template", None),
        stream_interval=getattr(args, "stream_interval", 1),
        device=args.device,
        gpus=args.gpus,
        device_memory=args.device_memory,
        device_kv_memory=args.device_kv_memory,
        link_bandwidth=getattr(args, "link_bandwidth", None),
        attention_placement=args.attention_placement,
        experts_placement=args.experts_placement,
        kv_cache_memory=args.kv_cache_memory,
        kv_dtype=args.kv_dtype,
        dtype=args.dtype,
        quantize=args.quantize,
        quantize_group_size=args.quantize_group_size,
        expert_kernels=args.expert_kernels,
        max_batch_size=args.max_batch_size,
        micro_batch_size=args.micro_batch_size,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        # `run --model` has no TLS flags: its stack binds loopback only
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        tls_ca=getattr(args, "tls_ca", None) if getattr(args, "tls_cert", None) else None,
        auth_token=getattr(args, "auth_token", None),
    )


def run(args: argparse.Namespace) -> int:
    from moe_lightning.launcher import Stack, StackInterrupted

    error, warnings = exposure_check(args)
    error = error or link_flag_error(args.device, args.link_bandwidth)
    if error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    for w in warnings:
        sys.stderr.write(f"warning: {w}\n")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # set from another thread: the handler runs in the main thread, which may be inside stop.wait()
        # holding the event's lock, and Event.set() taking it again there would deadlock for good
        signal.signal(sig, lambda *_: threading.Thread(target=stop.set, daemon=True).start())
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
                where = f"grpc {e['grpc']}" if "grpc" in e else f"http {e['http']}/v1"
                sys.stdout.write(f"  {name:<14} {where:<53} metrics {e['metrics']}\n")
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
