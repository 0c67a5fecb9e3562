"""The Grafana dashboard (deploy/grafana/dashboards/moe-lightning.json) without Grafana: its panels'
queries with Grafana's macros filled in, run on a Prometheus, and drawn with matplotlib in the
dashboard's own layout (Grafana itself is not a Debian package, so no headless browser can shoot it
here); and the vector selectors of a PromQL expression, so a test can tell an alert's inputs exist."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from bench.monitoring.prometheus import Prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "moe-lightning.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])\s*(\{[^}]*\}|\()?")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The graph panels (rows left out), in the order the file lists them."""
    return [p for p in dashboard["panels"] if p.get("type") != "row"]


def fill_macros(expr: str, rate_interval: str = "1m", interval: str = "5s", range_: str = "15m") -> str:
    """Grafana's macros as Grafana would fill them for a query run now."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", interval)
    return expr.replace("$__range", range_)


def selectors(expr: str) -> list[str]:
    """The vector selectors of a PromQL expression, each reduced to what must exist for it to match:
    the metric name, its `=` matchers kept, and every other matcher's label only required present
    (a healthy stack has no UNAVAILABLE answers, but its series do carry a `code` label)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: m.group(0).replace("(", "\0").replace(")", "\1"), expr)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors and subqueries' windows
    out = []
    for name, braces in _SELECTOR.findall(text):
        if name in _KEYWORDS or braces == "(":  # a keyword, or a function's name
            continue
        kept = []
        for label, op, value in _MATCHER.findall((braces or "").replace("\0", "(").replace("\1", ")")):
            kept.append(f'{label}="{value}"' if op == "=" else f'{label}=~".+"')
        out.append(name + ("{" + ", ".join(kept) + "}" if kept else ""))
    return out


def alert_rules() -> list[dict[str, Any]]:
    import yaml

    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]


# ---- the picture ----------------------------------------------------------------------------------
_BG, _PANEL, _TEXT, _GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
_COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d"]
_UNITS = {"s": "s", "Bps": "B/s", "percentunit": "", "reqps": "/s", "short": ""}


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or json.dumps(labels)


def _override(panel: dict[str, Any], name: str, prop: str) -> Any:
    """The value Grafana's field overrides give `prop` for the series called `name`, else None."""
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        m = o["matcher"]
        hit = name == m["options"] if m["id"] == "byName" else bool(re.fullmatch(m["options"], name))
        for p in o["properties"] if hit else ():
            if p["id"] == prop:
                return p["value"]
    return None


def _formatter(unit: str) -> Any:
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    if unit == "percentunit":
        return PercentFormatter(1.0, decimals=0)
    if unit in ("s", "Bps"):
        return EngFormatter(unit=_UNITS[unit], places=0)
    return FuncFormatter(lambda v, _: f"{v:g}")


def _style(ax: Any, unit: str, custom: dict[str, Any], lo: Any = None, hi: Any = None) -> None:
    import matplotlib.dates as mdates

    if custom.get("scaleDistribution", {}).get("type") == "log":
        ax.set_yscale("log", base=custom["scaleDistribution"].get("log", 10))
    else:
        ax.set_ylim(lo, hi)
        ax.yaxis.set_major_formatter(_formatter(unit))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.tick_params(colors=_TEXT, labelsize=7)
    for spine in ax.spines.values():
        spine.set_visible(False)


def render(
    prom: Prometheus,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    out: Path,
    step: float = 1.0,
    rate_interval: str = "20s",
) -> Path:
    """Every panel's queries over [start, end], drawn where the dashboard lays the panel out, with its
    units, dashed and right-axis series and log scales as Grafana would draw them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    unit_h, head, width = 0.36, 0.5, 20.0  # inches: a grid row (Grafana's 30 px), the title, the figure
    height = rows * unit_h + head
    fig = plt.figure(figsize=(width, height), facecolor=_BG)
    fig.text(0.01, 1 - 0.25 / height, dashboard["title"], color=_TEXT, fontsize=14, va="center")

    def inches(x: float, y: float, w: float, h: float) -> list[float]:  # from the top-left, in inches
        return [x / width, 1 - (y + h) / height, w / width, h / height]

    for p in dashboard["panels"]:
        g = p["gridPos"]
        x, y, w, h = g["x"] * width / 24, head + g["y"] * unit_h, g["w"] * width / 24, g["h"] * unit_h
        if p.get("type") == "row":
            fig.text(x / width + 0.003, 1 - (y + 0.22) / height, p["title"], color=_TEXT, fontsize=11, weight="bold")
            continue
        frame = fig.add_axes(inches(x + 0.05, y + 0.05, w - 0.1, h - 0.1))
        frame.set_facecolor(_PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(_GRID)
        frame.text(0.01, 0.97, p["title"], color=_TEXT, fontsize=9, va="top", transform=frame.transAxes)
        drawn = []  # (name, xs, ys) of every series, first: the legend's height depends on how many
        for t in p["targets"]:
            for series in prom.query_range(fill_macros(t["expr"], rate_interval), start, end, step):
                xs = [dt.datetime.fromtimestamp(float(ts)) for ts, _ in series["values"]]
                drawn.append(
                    (_legend(t.get("legendFormat", ""), series["metric"]), xs, [float(v) for _, v in series["values"]])
                )
        legend_h = 0.18 * (1 + max(0, len(drawn) - 1) // 4)
        ax = fig.add_axes(inches(x + 0.75, y + 0.35, w - 1.5, h - 0.75 - legend_h))
        ax.set_facecolor(_PANEL)
        ax.grid(color=_GRID, linewidth=0.5)
        twin, twin_unit = None, "short"
        lines = []
        for i, (name, xs, ys) in enumerate(drawn):
            target = ax
            if _override(p, name, "custom.axisPlacement") == "right":
                twin = twin or ax.twinx()
                target, twin_unit = twin, _override(p, name, "unit") or twin_unit
            style = "--" if _override(p, name, "custom.lineStyle") else "-"
            lines += target.plot(xs, ys, style, color=_COLORS[i % len(_COLORS)], linewidth=1.2, label=name)
        if twin is not None:
            _style(twin, twin_unit, {}, 0)
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        _style(ax, defaults.get("unit", "short"), defaults.get("custom", {}), defaults.get("min"), defaults.get("max"))
        # about a tick per inch: the narrow panels' time labels would overlap
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=2, maxticks=min(10, max(3, int(w / 1.1)))))
        if lines:
            fig.legend(
                handles=lines,
                loc="upper left",
                bbox_to_anchor=((x + 0.15) / width, 1 - (y + h - 0.1 - legend_h) / height),
                ncol=4,
                fontsize=7,
                frameon=False,
                labelcolor=_TEXT,
            )
        else:
            ax.text(0.5, 0.5, "No data", color=_TEXT, ha="center", va="center", transform=ax.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=_BG)
    plt.close(fig)
    return out
