"""`rlx report`: the PNG drawn from metrics.jsonl alone, on a full run, on a run cut short mid-line,
with panels whose metrics are absent, and the one-sentence refusal of a dir without metrics.jsonl."""
import json
import math
import struct

import pytest

from launch.cli import main
from launch.report import PANELS, draw_report, read_metrics, write_after_run, write_report

PHASES = ("rollout", "reward", "logprob", "update", "weight_sync")


def _row(step: int) -> dict:
    row = {"step": step, "reward/mean": 0.1 * step, "reward/trained_mean": 0.1 * step + 0.01,
           "actor/kl_ref": 0.01 * step, "actor/ppo_kl": 0.001, "actor/entropy": 2.0 - 0.1 * step,
           "response_length/mean": 10.0 + step, "response_length/clip_frac": 0.5, "actor/clip_frac": 0.02,
           "rollout/logprob_diff_max": 1e-6 * step, "rollout/logprob_diff_mean": 0.0 if step == 2 else 1e-7,
           "timing/step_s": 1.5}
    row.update({f"timing/{p}_s": 0.25 for p in PHASES})
    return row


def _write(run_dir, rows, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": 0, "val/reward_mean": 0.0})] + [json.dumps(r) for r in rows]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_report_of_a_run_has_every_panel_with_its_lines(tmp_path):
    rows = [_row(s) for s in range(1, 6)]
    rows[2]["actor/entropy"] = float("nan")  # a diverged step stays visible as a gap and a note
    rows[3]["val/reward_mean"] = 0.4
    _write(tmp_path / "run", rows)
    assert main(["report", str(tmp_path / "run")]) == 0
    width, height = _png_size(tmp_path / "run" / "report.png")
    assert (width, height) == (1600, 1200)
    assert (tmp_path / "run" / "report.png").stat().st_size > 50_000  # drawn, not an empty canvas

    parsed, notes = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert notes == [] and [r["step"] for r in parsed] == [0, 1, 2, 3, 4, 5]
    axes = _axes(draw_report(parsed, "run"))
    assert len(axes) == len(PANELS) + 1
    reward = axes["Reward"].get_lines()
    assert [list(line.get_xdata()) for line in reward] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [0, 4]]
    assert list(reward[2].get_ydata()) == [0.0, 0.4]
    assert [line.get_label() for line in axes["KL"].get_lines()] == ["to the reference (actor/kl_ref)",
                                                                     "old to new policy (actor/ppo_kl)"]
    entropy = list(axes["Entropy"].get_lines()[0].get_ydata())
    assert math.isnan(entropy[2]) and entropy[0] == pytest.approx(1.9)
    assert "actor/entropy: non-finite at step 3" in axes["Entropy"].get_legend().get_title().get_text()
    gap = axes["Engine/trainer log-prob gap"]
    assert gap.get_yscale() == "log"
    assert math.isnan(list(gap.get_lines()[1].get_ydata())[1])  # the 0 at step 2 is not drawn on a log axis
    assert "1 step at 0" in gap.get_legend().get_title().get_text()
    # Without a critic, no note about critic/vf_clipfrac: two lines, nothing missing.
    clip = axes["Clip fraction"]
    assert len(clip.get_lines()) == 2 and clip.get_legend().get_title().get_text() == ""
    phases = axes["Step phases (stacked) and the step's wall time"]
    assert len(phases.patches) == len(PHASES) * 5  # one bar per phase per step
    tops = {round(p.get_x() + p.get_width() / 2): p.get_y() + p.get_height() for p in phases.patches}
    assert tops == {s: pytest.approx(1.25) for s in range(1, 6)}  # stacked: five phases of 0.25 s
    assert list(phases.get_lines()[0].get_ydata()) == [1.5] * 5


def test_report_of_a_crashed_run_skips_the_cut_line_and_names_absent_metrics(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.2, "timing/rollout_s": 0.5, "timing/step_s": 0.7} for s in (1, 2)]
    _write(tmp_path / "run", rows, tail='{"step": 3, "reward/mean": 0.')  # killed mid-write
    out = tmp_path / "elsewhere" / "r.png"
    assert main(["report", str(tmp_path / "run"), "-o", str(out)]) == 0
    assert _png_size(out) == (1600, 1200)
    parsed, notes = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in parsed] == [0, 1, 2]
    assert notes == ["the last line of metrics.jsonl is not a complete metrics line (skipped)"]
    fig = draw_report(parsed, "run", notes)
    assert "skipped" in fig._suptitle.get_text()
    axes = _axes(fig)
    kl = axes["KL"]
    assert kl.get_lines() == []
    assert "not in metrics.jsonl:\nactor/kl_ref\nactor/ppo_kl" in [t.get_text() for t in kl.texts]
    assert [list(line.get_xdata()) for line in axes["Reward"].get_lines()] == [[1, 2], [0]]
    assert "not logged: reward/trained_mean" in axes["Reward"].get_legend().get_title().get_text()


def test_a_dir_without_metrics_is_one_sentence(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlx report: {tmp_path} has no metrics.jsonl: not a run dir, or a run that stopped "
                   "before its first step")


def test_the_end_of_run_report_never_raises(tmp_path, capsys, monkeypatch):
    write_after_run(str(tmp_path))  # no metrics.jsonl: nothing to draw, nothing said
    assert not (tmp_path / "report.png").exists() and capsys.readouterr().err == ""
    _write(tmp_path, [_row(1)])
    write_after_run(str(tmp_path))
    assert (tmp_path / "report.png").exists()

    import launch.report as report

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report, "draw_report", broken)
    write_after_run(str(tmp_path))  # a failure to draw: one warning line
    assert capsys.readouterr().err.strip() == (f"rlx: warning: could not draw {tmp_path}/report.png: "
                                               "RuntimeError: no fonts")
    with pytest.raises(RuntimeError):
        write_report(str(tmp_path))
