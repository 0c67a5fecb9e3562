"""up: start the five processes (four services, the HTTP gateway), wait until all are SERVING, print the
endpoints, stop on a signal."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from moe_lightning.config import flags
from moe_lightning.config.stack import StackConfig


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name, help="run the whole stack (four services and the OpenAI HTTP gateway, five processes) until Ctrl-C"
    )
    StackConfig.add_cli_args(p)
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="port of the OpenAI-compatible HTTP API on --host (0 = any free port; docs/openai.md)",
    )
    p.add_argument("--no-http", action="store_true", help="no HTTP gateway: the gRPC API only")
    flags.INSECURE.add_to(p, default=False)
    flags.JSON.add_to(p, default=False)
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


def run(args: argparse.Namespace) -> int:
    from moe_lightning.launcher import Stack, StackInterrupted

    error, warnings = exposure_check(args)
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
    stack = Stack(StackConfig.for_command(args, http_port=None if args.no_http else args.http_port))
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
