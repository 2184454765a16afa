#!/usr/bin/env python3
"""Plots a Grafana dashboard's panels from the range-query results tests/observability_live.rs
writes (KVPOOL_DASHBOARD_DATA) to one PNG, laid out on Grafana's 24-column grid: stat panels
show their last value, time series panels their lines with Grafana's legends.

    render-dashboard.py DATA.json OUT.png
"""
import json
import math
import re
import sys
from datetime import datetime, timezone

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def legend(fmt, metric, expr):
    """Grafana's legendFormat: {{label}} replaced by the series' label values."""
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "__name__") or expr
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt).strip()


def human(value, unit):
    """A value as Grafana would print it for the panel's unit."""
    if value is None or math.isnan(value):
        return "no data"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for prefix in ["B", "KiB", "MiB", "GiB", "TiB"]:
            if abs(value) < 1024 or prefix == "TiB":
                return f"{value:.1f} {prefix}{suffix}"
            value /= 1024
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit in ("reqps", "ops"):
        return f"{value:.2f}/s"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


def scale(unit):
    """Axis scaling and label for a unit."""
    return {
        "percentunit": (100.0, "%"),
        "bytes": (1 / 2**20, "MiB"),
        "Bps": (1 / 2**20, "MiB/s"),
        "s": (1e3, "ms"),
        "reqps": (1.0, "req/s"),
        "ops": (1.0, "ops/s"),
    }.get(unit, (1.0, ""))


def points(series):
    ts, vs = [], []
    for t, v in series["values"]:
        value = float(v)
        if math.isfinite(value):
            ts.append(float(t))
            vs.append(value)
    return ts, vs


def main():
    data_path, out_path = sys.argv[1], sys.argv[2]
    with open(data_path) as f:
        data = json.load(f)
    panels = data["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42  # inches per grid row
    fig = plt.figure(figsize=(20, rows * unit_h + 0.8))
    start = data["start"]
    stamp = datetime.fromtimestamp(data["end"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle(f"{data['title']}  ({stamp}, {data['end'] - start:.0f} s of kvpool up)", fontsize=14)
    top = 1 - 0.6 / (rows * unit_h + 0.8)
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        bottom = top * (1 - (g["y"] + g["h"]) / rows)
        height = top * g["h"] / rows
        ax = fig.add_axes([left + 0.012, bottom + 0.03 * (4 / g["h"]), width - 0.024, height - 0.06 * (4 / g["h"])])
        ax.set_title(p["title"], fontsize=10, loc="left")
        unit = p.get("unit") or "none"
        if p["type"] == "stat":
            ax.axis("off")
            last = None
            for t in p["targets"]:
                for s in t["series"]:
                    _, vs = points(s)
                    if vs:
                        last = vs[-1]
            ax.text(0.5, 0.4, human(last, unit), ha="center", va="center", fontsize=22,
                    color="#1f77b4" if last is not None else "grey", transform=ax.transAxes)
            continue
        factor, label = scale(unit)
        drawn = 0
        for t in p["targets"]:
            for s in t["series"]:
                ts, vs = points(s)
                if not ts:
                    continue
                ax.plot([x - start for x in ts], [v * factor for v in vs], linewidth=1.2,
                        label=legend(t.get("legendFormat"), s["metric"], t["expr"]))
                drawn += 1
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)
    fig.savefig(out_path, dpi=80)


if __name__ == "__main__":
    main()
