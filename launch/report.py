"""`rlx report RUN_DIR [-o report.png]`: one PNG of a run, drawn from ``<run_dir>/metrics.jsonl`` alone
(so it works on a run that crashed or is still running), and written to ``<run_dir>/report.png`` at the
end of every run (launch/compose.py).

Panels: reward (train and validation), KL, entropy, response length, clip fractions, the engine/trainer
log-prob gap (log scale) and the step's phases as stacked bars. A panel whose metrics the run did not
log says so; a line cut short by a kill is skipped with a note in the title.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Optional

METRICS = "metrics.jsonl"
REPORT = "report.png"


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    lines: tuple[tuple[str, str], ...]  # (metric key, legend label)
    ylabel: str = ""
    log: bool = False
    optional: tuple[str, ...] = ()  # keys only some algorithms log (a critic's): not noted when absent


PANELS = (
    Panel("Reward", (("reward/mean", "train: sampled batch"),
                     ("reward/trained_mean", "train: trained batch (shaping, filtering)"),
                     ("val/reward_mean", "validation (greedy)")), "mean score"),
    Panel("KL", (("actor/kl_ref", "to the reference (actor/kl_ref)"),
                 ("actor/ppo_kl", "old to new policy (actor/ppo_kl)"))),
    Panel("Entropy", (("actor/entropy", "actor/entropy"),), "nats per token"),
    Panel("Response length", (("response_length/mean", "mean"),), "tokens"),
    Panel("Clip fraction", (("response_length/clip_frac", "responses cut at the max length"),
                            ("actor/clip_frac", "PPO ratio clipped (actor/clip_frac)"),
                            ("critic/vf_clipfrac", "value clipped (critic/vf_clipfrac)")), "fraction",
          optional=("critic/vf_clipfrac",)),
    Panel("Engine/trainer log-prob gap", (("rollout/logprob_diff_max", "max |diff|"),
                                          ("rollout/logprob_diff_mean", "mean |diff|")), "nats", log=True),
)
STEP_TIME = "timing/step_s"
LINE_STYLES = ("-", "--", ":")  # lines that coincide (reward/mean and reward/trained_mean often do) stay visible


class ReportError(ValueError):
    """A run dir the report cannot be drawn from; the message is one sentence."""


def read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """The metrics lines of ``path`` (a later line of the same step replaces an earlier one), and
    notes on the lines skipped: a last line cut short by a kill, or any other line that is not JSON."""
    rows: dict[int, dict] = {}
    notes: list[str] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            where = "the last line" if number == len(lines) else f"line {number}"
            notes.append(f"{where} of {METRICS} is not a complete metrics line (skipped)")
            continue
        rows[step] = row
    return [rows[s] for s in sorted(rows)], notes


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        if key in row and isinstance(row[key], (int, float)):
            steps.append(row["step"])
            values.append(float(row[key]))
    return steps, values


def _say(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)


def _draw_panel(ax, panel: Panel, rows: list[dict]) -> None:
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step")
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    drawn, positive, missing, remarks = 0, False, [], []
    for i, (key, label) in enumerate(panel.lines):
        steps, values = _series(rows, key)
        if not steps:
            if key not in panel.optional:
                missing.append(key)
            continue
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if bad:
            remarks.append(f"{key}: non-finite at step{'s' if len(bad) > 1 else ''} "
                           + ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else ""))
        if panel.log:
            zero = [s for s, v in zip(steps, values) if v <= 0]
            if zero:
                remarks.append(f"{key}: {len(zero)} step{'s' if len(zero) > 1 else ''} at 0 (not on the log scale)")
            values = [v if v > 0 else math.nan for v in values]
            positive = positive or any(v > 0 for v in values)
        # Markers as well as lines: a metric logged every val_every steps, or a run of a few steps,
        # still shows its points.
        ax.plot(steps, values, LINE_STYLES[i % len(LINE_STYLES)], marker="o", markersize=3 if len(steps) < 60 else 0,
                linewidth=1.5, label=label)
        drawn += 1
    if positive:  # a log axis needs one point above 0
        ax.set_yscale("log")
    if drawn:
        # What the lines cannot show (non-finite points, zeros on a log axis, a key not logged) goes
        # in the legend's title, where it cannot cover a line.
        notes = remarks + ([f"not logged: {', '.join(missing)}"] if missing else [])
        legend = ax.legend(fontsize=8, loc="best", title="\n".join(notes) or None, title_fontsize=7)
        legend.get_title().set_color("0.35")
        ax.grid(True, alpha=0.3)
    else:
        _say(ax, "not in metrics.jsonl:\n" + "\n".join(missing))


def _draw_phases(ax, rows: list[dict]) -> None:
    ax.set_title("Step phases (stacked) and the step's wall time", fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    phases: list[str] = []  # in the order a step first reports them: the pipeline's order
    for row in rows:
        phases += [k for k in row if k.startswith("timing/") and k.endswith("_s") and k != STEP_TIME
                   and k not in phases]
    train_rows = [r for r in rows if any(k in r for k in phases) or STEP_TIME in r]
    if not phases and not train_rows:
        _say(ax, "no timing/*_s metrics in metrics.jsonl")
        return
    steps = [r["step"] for r in train_rows]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    width = 0.8 * (min(gaps) if gaps else 1)
    bottom = [0.0] * len(train_rows)
    import matplotlib

    colors = matplotlib.colormaps["tab10" if len(phases) <= 10 else "tab20"]  # tab10: neighbours differ in hue
    for i, key in enumerate(phases):
        heights = [r.get(key, 0.0) for r in train_rows]
        heights = [h if isinstance(h, (int, float)) and math.isfinite(h) else 0.0 for h in heights]
        ax.bar(steps, heights, width=width, bottom=bottom, label=key[len("timing/"):-len("_s")],
               color=colors(i % colors.N))
        bottom = [b + h for b, h in zip(bottom, heights)]
    total_steps, totals = _series(train_rows, STEP_TIME)
    if total_steps:
        ax.plot(total_steps, totals, color="black", marker="_", markersize=10 if len(total_steps) < 60 else 0,
                linewidth=1, label="step (timing/step_s)")
    # Outside the axes: a legend of ten phases would hide the bars.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    ax.grid(True, axis="y", alpha=0.3)


def draw_report(rows: list[dict], title: str = "", notes: Optional[list[str]] = None):
    """The report as a matplotlib Figure (Agg canvas: no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 12), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 3)
    for i, panel in enumerate(PANELS):
        _draw_panel(fig.add_subplot(grid[i // 3, i % 3]), panel, rows)
    _draw_phases(fig.add_subplot(grid[2, :]), rows)
    steps = [r["step"] for r in rows]
    heading = title + (f": steps {steps[0]} to {steps[-1]}, {len(rows)} metrics lines" if rows
                       else ": no complete metrics lines")
    fig.suptitle("\n".join([heading, *(notes or [])]), fontsize=12)
    return fig


def write_report(run_dir: str, out: Optional[str] = None) -> str:
    """Draws ``<run_dir>/metrics.jsonl`` into ``out`` (default ``<run_dir>/report.png``); returns the path."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise ReportError(f"{run_dir} has no {METRICS}: not a run dir, or a run that stopped before its first step")
    rows, notes = read_metrics(path)
    out = out or os.path.join(run_dir, REPORT)
    fig = draw_report(rows, os.path.normpath(run_dir), notes)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    return out


def write_after_run(run_dir: str) -> None:
    """The end-of-run report, also after a failed run: drawn when metrics.jsonl has lines; a failure
    to draw is one warning line and never hides the run's own error."""
    try:
        path = os.path.join(run_dir, METRICS)
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - the report is an extra; the run's outcome is what counts
        print(f"rlx: warning: could not draw {os.path.join(run_dir, REPORT)}: {type(e).__name__}: {e}",
              file=sys.stderr)


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="draw a run's metrics.jsonl into one PNG (reward, KL, entropy, lengths, "
                                      "clipping, the log-prob gap, step phases)")
    p.add_argument("run_dir", help="the run's trainer.run_dir (holds metrics.jsonl)")
    p.add_argument("-o", "--output", help="the PNG to write (default: RUN_DIR/report.png)")


def run_report(args: argparse.Namespace) -> int:
    try:
        out = write_report(args.run_dir, args.output)
    except ReportError as e:
        print(f"rlx report: {e}", file=sys.stderr)
        return 2
    print(f"rlx report: wrote {out}")
    return 0
