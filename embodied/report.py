"""``embodied report RUN``: one self-contained ``RUN/report.html`` (no server, no network, no
script: plots are SVG images and videos mp4, both inlined as data URIs), which a run also writes
at its end. It holds the config, the success curve with its confidence intervals (success once
and success at the end, defined on the page), per-task tables, throughput and time per phase,
the best and worst episodes of the newest record, and the run's events.
"""

from __future__ import annotations

import base64
import html
import io
import math
import statistics
import tempfile
import time
from pathlib import Path

from embodied.logger import write_atomic
from embodied.report_data import Rate, RunData, phase_seconds, read_run, run_status

REPORT_FILE = "report.html"
EPISODES_SHOWN = 2  # the best and the worst this many of the newest record with episodes

DEFINITIONS = """
<p><b>Success once</b>: the share of evaluation episodes in which the task was achieved at some
step (ManiSkill's <code>success_once</code>). <b>Success at end</b>: the share in which it still
holds at the episode's last step; a cube pushed onto the target and then off it counts for the
first and not the second. Evaluations act deterministically (the policy's mean or most likely
action) on seeded episodes; training episodes sample their actions, so <b>training success
once</b> (the share of each environment's first episode of a rollout round that succeeded within
the round) is usually lower than the evaluation's and lags it. Bands and brackets are 95%
Wilson intervals over the episode count.</p>
"""

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
img.plot { max-width: 100%; display: block; margin: 0.5em 0; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; }
figcaption { font-size: 0.85em; max-width: 480px; }
video { width: 320px; image-rendering: pixelated; display: block; }
video.wide { width: 512px; }
"""


def report_at_end(run_dir: Path, enabled: bool) -> None:
    """Write RUN/report.html as a run ends (``runner.report``) and say where; a report that fails
    loses the report only: the run's results are saved already."""
    if not enabled:
        return
    try:
        path = write_report(run_dir)
    except Exception as error:  # (said, not raised: the run itself succeeded)
        print(f"report not written: {type(error).__name__}: {error}")
        return
    print(f"report: {path}")


def write_report(run_dir: Path) -> Path:
    """``RUN/report.html`` from what the run directory holds; its path."""
    data = read_run(Path(run_dir))
    sections = [
        _header(data),
        _success_section(data),
        _task_section(data),
        _training_section(data),
        _time_section(data),
        _episode_section(data),
        _events_section(data),
        f"<h2>Config</h2><pre>{html.escape(data.config_text)}</pre>",
    ]
    title = html.escape(f"embodied report: {data.run_dir.name}")
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    path = data.run_dir / REPORT_FILE
    write_atomic(path, page)
    return path


# --- sections -------------------------------------------------------------------------------
def _header(data: RunData) -> str:
    last = data.iterations[-1] if data.iterations else {}
    host = data.host_starts[-1] if data.host_starts else {}
    cpu = host.get("cpu", {})
    gpus = host.get("gpus") or []
    versions = host.get("versions", {})
    if data.sft:  # (its rows' iteration and env_steps are its step)
        progress = [("steps", str(last.get("iteration", 0)))]
    else:
        progress = [
            ("iterations", str(last.get("iteration", 0))),
            ("env steps", f"{last.get('env_steps', 0):,}"),
        ]
    rows = [
        ("run", str(data.run_dir)),
        ("status", run_status(data.events, data.final is not None)),
        *progress,
        ("training minutes", f"{last.get('time/minutes', 0.0):.1f}"),
        ("starts (resumes + 1)", str(len(data.host_starts))),
        ("CPU", f"{cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores"),
        ("GPUs", ", ".join(map(str, gpus)) or "none"),
        ("torch", versions.get("torch", "?")),
        ("written", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())),
    ]
    title = html.escape(data.run_dir.name)
    return f"<h1>{title}</h1>" + _table(["", ""], rows, header=False)


def _success_section(data: RunData) -> str:
    out = ["<h2>Success</h2>", DEFINITIONS]
    if not data.evaluations:
        replayed = any("replayed" in row for row in data.iterations)
        why = "runner.replay_from simulates nothing" if replayed else "runner.eval_every"
        return "\n".join(out + [f"<p>No evaluation was logged ({why}).</p>"])
    final = data.final or data.evaluations[-1]
    label = (
        "final evaluation" if data.final else f"last evaluation ({_unit(data)} {final.iteration})"
    )
    out.append(
        f"<p>{label}: success once {_rate(final.pooled.success_once)}, success at end "
        f"{_rate(final.pooled.success_at_end)}, mean return {final.pooled.ret:.3f}.</p>"
    )
    out.append(_img(_success_plot(data), "success over training"))
    return "\n".join(out)


def _task_section(data: RunData) -> str:
    final = data.final or (data.evaluations[-1] if data.evaluations else None)
    if final is None:
        return ""
    tasks = final.tasks or {"all": final.pooled}
    rows = [
        (
            task,
            str(e.success_once.episodes),
            _rate(e.success_once),
            _rate(e.success_at_end),
            f"{e.ret:.3f}",
            f"{e.length:.1f}",
        )
        for task, e in tasks.items()
    ]
    head = ["task", "episodes", "success once [95% CI]", "success at end [95% CI]"]
    out = ["<h2>Per task</h2>", _table([*head, "return", "length"], rows)]
    if len(tasks) > 1 and len(data.evaluations) > 1:
        out.append(_img(_task_plot(data), "success once per task"))
    return "\n".join(out)


def _training_section(data: RunData) -> str:
    if not data.iterations:
        return "<h2>Training</h2><p>No iteration was logged.</p>"
    caption = f"training metrics per {_unit(data)}"
    return "<h2>Training</h2>" + _img(_training_plot(data), caption)


def _time_section(data: RunData) -> str:
    timed = all("time/env_steps_per_s" in r for r in data.iterations)
    if not data.iterations or data.sft or not timed:  # (SFT, replay_from: nothing simulated)
        return ""
    phases = phase_seconds(data.iterations)
    total = 60 * data.iterations[-1].get("time/minutes", 0.0)
    other = total - sum(phases.values())
    rows = [(name, f"{s:.1f}", _share(s, total)) for name, s in phases.items()]
    rows.append(
        ("other: logging, checkpoints, evaluations during training", f"{max(other, 0):.1f}", "")
    )
    rows.append(("training time", f"{total:.1f}", "100%"))
    out = ["<h2>Throughput and time per phase</h2>"]
    speeds = [r["time/env_steps_per_s"] for r in data.iterations]
    out.append(
        f"<p>{len(speeds)} iterations: median {statistics.median_high(speeds):,.0f} env steps/s "
        f"(min {min(speeds):,.0f}, max {max(speeds):,.0f}). An update that overlaps the next "
        "collection (cluster.max_staleness 1) counts in both.</p>"
    )
    out.append(_table(["phase", "seconds", "share"], rows))
    idle = sorted({k for r in data.iterations for k in r if k.endswith("_idle")})
    if idle:
        mean = [
            (k, f"{statistics.fmean([r[k] for r in data.iterations if k in r]):.2f}") for k in idle
        ]
        out.append(_table(["role idle (mean share of the iteration)", "idle"], mean))
    out.append(_img(_speed_plot(data), "env steps per second"))
    return "\n".join(out)


def _episode_section(data: RunData) -> str:
    from embodied.episodes import choose, episodes_of, write_episode
    from embodied.recording import RecordError, read_rounds

    out = ["<h2>Episodes</h2>"]
    videos = [data.run_dir / "videos" / name for name in ("final_eval.mp4", "eval.mp4")]
    video = next((v for v in videos if v.is_file()), None)  # (SFT's final one: eval.mp4)
    if video is not None:
        out.append("<p>The final evaluation (the first environments, tiled):</p>")
        out.append(_video(video.read_bytes(), "final evaluation", "wide"))
    for record_meta in reversed(data.records):
        try:
            record = read_rounds(data.run_dir, record_meta["iteration"])
        except RecordError as error:
            out.append(f"<p>{html.escape(str(error))}</p>")
            continue
        found = episodes_of(record)
        best = choose(found, best=EPISODES_SHOWN)
        worst = [e for e in choose(found, worst=EPISODES_SHOWN) if e not in best]
        if not best:
            continue
        out.append(
            f"<p>Recorded iteration {record.meta['iteration']} ({len(found)} episodes end in "
            f"it): the {len(best)} best and {len(worst)} worst whole episodes by return. Each "
            "video is the policy's camera at each chunk's start; each plot its actions, rewards "
            "and success per step.</p>"
        )
        with tempfile.TemporaryDirectory() as tmp:
            for rank, episode in [("best", e) for e in best] + [("worst", e) for e in worst]:
                mp4, png = write_episode(record, episode, Path(tmp))
                outcome = "success" if episode.success else "failure"
                caption = (
                    f"{rank}: {episode.task}, row {episode.row}, return {episode.ret:.3f}, "
                    f"{episode.length} steps, {outcome}"
                )
                parts = [_video(mp4.read_bytes(), caption)] if mp4 is not None else []
                parts.append(_data_img(png.read_bytes(), "image/png", caption))
                out.append(_figure("".join(parts), caption))
        break
    else:
        out.append("<p>No recorded episodes (runner.record_rollouts).</p>")
    return "\n".join(out)


def _events_section(data: RunData) -> str:
    out = ["<h2>Events</h2>"]
    if data.records:
        listed = ", ".join(f"{r['iteration']} ({r['reason']})" for r in data.records)
        out.append(f"<p>Recorded iterations: {html.escape(listed)}.</p>")
    if not data.events:
        return "\n".join(out + ["<p>No events were logged.</p>"])
    counts = {}
    for event in data.events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    out.append("<p>" + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".</p>")
    rows = [
        (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.time)),
            e.kind,
            "" if e.iteration is None else str(e.iteration),
            "" if e.env_steps is None else f"{e.env_steps:,}",
            e.detail,
        )
        for e in data.events
    ]
    return "\n".join(out + [_table(["UTC", "event", "iteration", "env steps", "detail"], rows)])


# --- plots ----------------------------------------------------------------------------------
def _success_plot(data: RunData) -> bytes:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 4))
    evals = data.evaluations
    steps = [e.env_steps for e in evals]
    for name, rate_of, color in (
        ("success once", lambda e: e.pooled.success_once, "tab:blue"),
        ("success at end", lambda e: e.pooled.success_at_end, "tab:orange"),
    ):
        rates = [rate_of(e) for e in evals]
        style = "o-" if name == "success once" else "s--"
        axis.plot(steps, [r.rate for r in rates], style, color=color, label=f"evaluation: {name}")
        low = [r.low for r in rates]
        high = [r.high for r in rates]
        axis.fill_between(steps, low, high, color=color, alpha=0.2)
    # (success within each round's first episodes, ended or not: episode_stats.py)
    train = [
        (r["env_steps"], r["episode/success_once"])
        for r in data.iterations
        if "episode/success_once" in r
    ]
    if train:
        xs, ys = zip(*train)
        axis.plot(xs, ys, color="grey", lw=0.8, label="training: success once")
    return _rate_figure(figure, axis, "success", _steps(data))


def _task_plot(data: RunData) -> bytes:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 4))
    tasks = sorted({t for e in data.evaluations for t in e.tasks})
    for task in tasks:
        points = [
            (e.env_steps, e.tasks[task].success_once) for e in data.evaluations if task in e.tasks
        ]
        steps = [s for s, _ in points]
        line = axis.plot(steps, [r.rate for _, r in points], "o-", label=task)[0]
        low = [r.low for _, r in points]
        high = [r.high for _, r in points]
        axis.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    return _rate_figure(figure, axis, "evaluation success once", _steps(data))


def _unit(data: RunData) -> str:
    """What a logged row counts: an iteration, or an SFT run's step."""
    return "step" if data.sft else "iteration"


def _steps(data: RunData) -> str:
    """What an evaluation's ``env_steps`` counts: env steps, or an SFT run's steps."""
    return "steps" if data.sft else "env steps"


def _rate_figure(figure, axis, ylabel: str, xlabel: str) -> bytes:
    """A plot of rates over env steps (an SFT run's steps), labelled, as SVG."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize="small")
    return _svg(figure)


TRAINING_PANELS = (
    ("episode/return", "training return"),
    ("policy/loss", "policy loss"),
    ("value/loss", "value loss"),
    ("policy/grad_norm", "gradient norm (before clipping)"),
    ("policy/approx_kl", "approximate KL"),
    ("policy/clipfrac", "clip fraction"),
    ("sft/loss", "SFT loss"),
    ("sft/grad_norm", "SFT gradient norm"),
)


def _training_plot(data: RunData) -> bytes:
    plt = _pyplot()
    panels = [(k, t) for k, t in TRAINING_PANELS if any(k in r for r in data.iterations)]
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    figure, axes = plt.subplots(rows, cols, figsize=(11, 3 * rows), squeeze=False)
    for axis, (key, title) in zip(axes.flat, panels):
        points = [(r["iteration"], r[key]) for r in data.iterations if key in r]
        axis.plot([i for i, _ in points], [v for _, v in points], lw=1)
        axis.set_title(title, fontsize="medium")
        axis.set_xlabel(_unit(data))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout()
    return _svg(figure)


def _speed_plot(data: RunData) -> bytes:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 3))
    axis.plot(
        [r["env_steps"] for r in data.iterations],
        [r["time/env_steps_per_s"] for r in data.iterations],
        lw=1,
    )
    axis.set_xlabel("env steps")
    axis.set_ylabel("env steps / s")
    axis.grid(alpha=0.3)
    return _svg(figure)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _svg(figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


# --- html pieces ----------------------------------------------------------------------------
def _img(svg: bytes, alt: str) -> str:
    return _data_img(svg, "image/svg+xml", alt, "plot")


def _data_img(data: bytes, mime: str, alt: str, css: str = "") -> str:
    encoded = base64.b64encode(data).decode()
    return f'<img class="{css}" alt="{html.escape(alt)}" src="data:{mime};base64,{encoded}">'


def _video(mp4: bytes, title: str, css: str = "") -> str:
    encoded = base64.b64encode(mp4).decode()
    return (
        f'<video class="{css}" controls muted loop preload="auto" title="{html.escape(title)}" '
        f'src="data:video/mp4;base64,{encoded}"></video>'
    )


def _figure(body: str, caption: str) -> str:
    return f"<figure>{body}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _table(head: list[str], rows: list[tuple], header: bool = True) -> str:
    top = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" if header else ""
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>{top}{body}</table>"


def _rate(rate: Rate) -> str:
    if rate.rate != rate.rate:  # (not logged)
        return "n/a"
    return f"{rate.rate:.3f} [{rate.low:.2f}, {rate.high:.2f}] over {rate.episodes}"


def _share(seconds: float, total: float) -> str:
    return f"{100 * seconds / total:.0f}%" if total > 0 else ""
