"""timeline: merge the services' --timeline files into a Chrome trace and Parquet, print busy/overlap."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_lightning.config import flags


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="merge service timelines: Chrome trace (Perfetto), Parquet, busy and overlap")
    p.add_argument("files", nargs="+", type=Path, help="the files given to the services' --timeline")
    p.add_argument("--chrome", type=Path, default=None, help="write a Chrome trace JSON here")
    p.add_argument("--parquet", type=Path, default=None, help="write the events as Parquet here")
    flags.PNG.add_to(p)


def run(args: argparse.Namespace) -> int:
    from moe_lightning.timeline import load, summarize, write

    events = load(args.files)
    if not events:
        raise ValueError("no timeline events in " + ", ".join(map(str, args.files)))
    write(events, args.chrome, args.parquet)
    if args.png is not None:
        from moe_lightning.timeline_plot import plot_timeline

        plot_timeline(events, args.png, "timeline")
    sys.stdout.write(json.dumps(summarize(events), indent=2) + "\n")
    return 0
