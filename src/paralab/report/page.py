"""The report: tables, figures, commands, config and environment as HTML and Markdown.

A :class:`Report` is a list of sections, each made of paragraphs, tables,
figures and code blocks; it renders to

- ``report.html``: self-contained (figures embedded as base64 ``data:`` URIs,
  inline CSS, no script, nothing fetched), so it can be mailed or opened
  offline;
- ``report.md``: the same content, figures linked by relative path.

Also here: the CS744-style results table of a comparison, the communication
table, and :func:`merge_traces`, which joins the runs' ``trace.json`` files
into one Chrome/Perfetto trace with one process per run and one track per
rank.
"""
from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.runs import Run
from .figures import Figures


# ======================================================================== tables as text
def text_table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _numeric(c: str) -> bool:
    try:
        float(c.replace("%", "").replace("x", ""))
        return True
    except ValueError:
        return False


def markdown_table(headers, rows) -> str:
    def esc(c):
        return ("" if c is None else str(c)).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(esc(h) for h in headers) + " |",
           "|" + "|".join("---:" if any(esc(r[i]) for r in rows) and all(_numeric(esc(r[i])) for r in rows if esc(r[i]))
                          else "---"
                          for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def html_table(headers, rows, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for row in rows:
        tds = []
        for c in row:
            text = "" if c is None else str(c)
            style = ' class="num"' if _numeric(text) else ""
            if text.startswith("FAIL") or text.startswith("error"):
                style = ' class="bad"'
            elif text == "PASS":
                style = ' class="good"'
            tds.append(f"<td{style}>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (f'<table class="{cls}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


# ======================================================================== report model
@dataclass
class Figure:
    path: Path      # the PNG on disk
    rel: str        # its path relative to the report (for Markdown)
    caption: str


@dataclass
class Table:
    headers: list
    rows: list
    caption: str = ""


@dataclass
class Section:
    title: str
    items: list = field(default_factory=list)  # str (paragraph) | Table | Figure | ("code", text)

    def para(self, text: str) -> "Section":
        self.items.append(text)
        return self

    def table(self, headers, rows, caption: str = "") -> "Section":
        self.items.append(Table(list(headers), [list(r) for r in rows], caption))
        return self

    def figure(self, path: Path, rel: str, caption: str) -> "Section":
        self.items.append(Figure(Path(path), rel, caption))
        return self

    def code(self, text: str) -> "Section":
        self.items.append(("code", text))
        return self


@dataclass
class Report:
    title: str
    sections: list[Section] = field(default_factory=list)

    def section(self, title: str) -> Section:
        s = Section(title)
        self.sections.append(s)
        return s

    # ---------------------------------------------------------------- Markdown
    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for s in self.sections:
            out += [f"## {s.title}", ""]
            for item in s.items:
                if isinstance(item, str):
                    out += [item, ""]
                elif isinstance(item, Table):
                    if item.caption:
                        out += [f"*{item.caption}*", ""]
                    out += [markdown_table(item.headers, item.rows), ""]
                elif isinstance(item, Figure):
                    out += [f"![{item.caption}]({item.rel})", "", f"*{item.caption}*", ""]
                else:
                    out += ["```", item[1].rstrip(), "```", ""]
        return "\n".join(out)

    # ---------------------------------------------------------------- HTML
    def html(self) -> str:
        parts = [f"<h1>{html.escape(self.title)}</h1>"]
        toc = "".join(f'<li><a href="#s{i}">{html.escape(s.title)}</a></li>' for i, s in enumerate(self.sections))
        parts.append(f"<nav><ul>{toc}</ul></nav>")
        for i, s in enumerate(self.sections):
            parts.append(f'<section id="s{i}"><h2>{html.escape(s.title)}</h2>')
            for item in s.items:
                if isinstance(item, str):
                    parts.append(f"<p>{html.escape(item)}</p>")
                elif isinstance(item, Table):
                    cap = f"<caption>{html.escape(item.caption)}</caption>" if item.caption else ""
                    parts.append(html_table(item.headers, item.rows).replace("<thead>", cap + "<thead>", 1))
                elif isinstance(item, Figure):
                    data = base64.b64encode(item.path.read_bytes()).decode("ascii")
                    parts.append(f'<figure><img src="data:image/png;base64,{data}" '
                                 f'alt="{html.escape(item.caption)}"><figcaption>{html.escape(item.caption)}'
                                 f"</figcaption></figure>")
                else:
                    parts.append(f"<pre>{html.escape(item[1].rstrip())}</pre>")
            parts.append("</section>")
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head>\n<body>\n"
                + "\n".join(parts) + "\n</body></html>\n")

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir = Path(out_dir)
        md, page = out_dir / "report.md", out_dir / "report.html"
        md.write_text(self.markdown())
        page.write_text(self.html())
        return page, md


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.8em 0;font-size:.88em}th,td{border:1px solid #ddd;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.good{color:#1a7f37;font-weight:600}td.bad{color:#b42318;font-weight:600}caption{text-align:left;
font-style:italic;padding:.3em 0}figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#555}pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:.82em}
nav ul{columns:2;font-size:.9em}
"""


# ======================================================================== comparison tables
def by_design(run) -> str:
    """A one-line note where a run's test loss differs from one process's by design, not by a bug: a pipeline
    cuts each batch into microbatches and BatchNorm updates its running statistics once per microbatch (the
    check replays that: docs/correctness.md#batchnorm); "" otherwise."""
    pipe = run.pipeline
    if pipe and pipe["microbatches"] > 1 and run.get("norm") == "batch":
        return (f"test loss differs from single's by design: BatchNorm's running statistics are updated once per "
                f"microbatch ({pipe['microbatches']} per step)")
    return ""


def fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


#: a check's kinds of comparison, as summary.json names each one's largest deviation (check/verdict.py)
CHECK_KINDS = {"weights": "max_weight_dev", "optimizer": "max_optimizer_dev", "loss": "max_loss_dev",
               "grad_norm": "max_grad_norm_dev", "outputs": "max_output_dev"}


def check_text(summary: dict | None) -> str:
    """The check column: PASS with the largest deviation of any kind (weights, optimizer state, losses,
    outputs), or FAIL with the kinds that failed and the largest of theirs; with the verdict's word where the
    run has one (``exact``; below fp64 ``within rounding`` with its worst ratio to the noise band, and a bug's
    ratio)."""
    if not summary or not summary.get("check"):
        return "-"
    c = summary["check"]
    failed = [k for k in c.get("failed") or [] if k in CHECK_KINDS]
    dev = [c[CHECK_KINDS[k]] for k in (failed or CHECK_KINDS) if c.get(CHECK_KINDS[k]) is not None]
    word, ratio = c.get("verdict"), c.get("worst_ratio")
    if c.get("result") == "PASS":
        if word == "within rounding" and ratio is not None:
            return f"PASS within rounding ({ratio:.2g} of band)"
        said = "PASS exact" if word == "exact" else "PASS"
        return f"{said} ({max(dev):.0e})" if dev else said
    what = f" {', '.join(failed)}" if failed else ""
    band = f", {ratio:.3g} x band" if ratio is not None else ""
    return f"{c.get('result')}{what} ({max(dev):.1e}{band})" if dev else f"{c.get('result')}{what}"


def results_table(entries: list[dict], runs: dict[int, Run], baseline: str | None = None):
    """CS744 Table 1: one row per entry of the matrix (failed and skipped runs included).

    ``entries[i]`` has strategy, workers, status, error (and config: the run's changed fields);
    ``runs[i]`` its Run when it finished. Speedup is over the time per iteration of ``baseline``
    (default: the single-process strategy), else over the strategy's own 1-worker run (the column
    header says which applies). Where some run compresses its gradients (``--compress``), its
    strategy shows the compression (``ddp (powersgd r2)``) and a column gives the megabytes the
    busiest rank sent per measured step (``Run.bytes_sent_per_step``; "-" where not known).
    """
    from ..analysis.runs import compression_of, series_of
    from .plots import baseline_strategy
    baseline = baseline or baseline_strategy()
    configs = [runs[i].config if i in runs else e.get("config") or {} for i, e in enumerate(entries)]
    compressions = [compression_of(c) for c in configs]
    series = [series_of(e["strategy"], c) for e, c in zip(entries, configs)]
    single = next((runs[i] for i, e in enumerate(entries) if baseline and e["strategy"] == baseline
                   and i in runs and runs[i].seconds_per_iter), None)
    rows = []
    base_note = set()
    for i, e in enumerate(entries):
        r = runs.get(i)
        base = single
        if base is None and r is not None:
            base = next((runs[j] for j, f in enumerate(entries) if j in runs and series[j] == series[i]
                         and f["workers"] == 1 and runs[j].seconds_per_iter), None)
            if base is not None:
                base_note.add("own 1-worker run")
        t = r.seconds_per_iter if r else None
        speed = base.seconds_per_iter / t if base and t else None
        status = e.get("status", "ok")
        note = ""
        if status == "failed":
            note = "error: " + (e.get("error") or "failed")
        elif status == "skipped":
            note = "skipped: " + (e.get("error") or "")
        elif r is not None and r.get("error"):
            note = "error: " + r.get("error")
        elif r is not None:
            note = by_design(r)
        acc = r.get("test_accuracy") if r else None
        rows.append([series[i], e["workers"], fmt(t, ".4f"), fmt(r.samples_per_s if r else None, ".1f"),
                     fmt(speed, ".2f"), fmt(r.get("test_loss") if r else None, ".4f"),
                     fmt(None if acc is None else 100 * acc, ".2f"),
                     check_text(r.summary if r else None) if r else "-", note])
    if base_note and not single:
        speed_head = "speedup (over own 1-worker run)"
    else:
        speed_head = f"speedup over {baseline}" if baseline else "speedup"
    headers = ["strategy", "workers", "s/iter", "samples/s", speed_head, "test loss", "test acc %", "check",
               "note"]
    if any(r.get("test_perplexity") is not None for r in runs.values()):  # a language model (text data)
        headers.insert(7, "perplexity")  # its test loss is per token, its accuracy the next byte's
        for i, row in enumerate(rows):
            row.insert(7, fmt(runs[i].get("test_perplexity") if i in runs else None, ".2f"))
    if any(compressions):  # a compression study: what each run put on the wire
        headers.insert(5, "MB sent/step/rank")
        for i, row in enumerate(rows):
            sent = runs[i].bytes_sent_per_step if i in runs else None
            row.insert(5, fmt(None if sent is None else sent / 1e6, ".3f"))
    return headers, rows


def comm_table(runs: list[Run]):
    rows = []
    for r in runs:
        ops = r.get("comm_ops") or {}
        for op, e in sorted(ops.items()):
            steps = max(r.get("measured_steps") or 1, 1)
            rows.append([r.label, op, e.get("calls", 0) // max(steps * max(r.workers, 1), 1),
                         f"{e.get('bytes_per_step', 0) / 1e6:.3f}",
                         f"{1000 * e.get('seconds', 0) / steps / max(r.workers, 1):.2f}",
                         fmt(e.get("algbw_GBps"), ".3f"), fmt(e.get("busbw_GBps"), ".3f")])
    return ["run", "operation", "calls/step/rank", "MB/step/rank", "ms/step/rank", "algbw GB/s",
            "busbw GB/s"], rows


def environment_rows(run: Run) -> list[list]:
    env = run.environment
    keys = ("torch", "python", "platform", "host", "cpu_count", "cores_available", "torch_threads", "backend",
            "device", "gpu")
    rows = [[k, env[k]] for k in keys if k in env]
    rows.append(["dataset", f"{run.config.get('resolved_dataset', run.get('dataset'))} "
                            f"({run.config.get('dataset_source', '')})"])
    if "network" in run.config:  # --network (network.py): the emulated links, or none
        from ..run.network import describe
        rows.append(["network", describe(run.config.get("network_emulated"), run.config.get("network"))])
    return rows


# ======================================================================== merged trace
def merge_traces(labelled: list[tuple[str, Path]]) -> dict:
    """One Chrome/Perfetto trace from several runs: process i = run i, one thread (track) per rank.

    ``labelled`` is [(label, run directory)]; each run's own ``trace.json`` (pid 0) is re-numbered.
    Each run keeps its own clock (they ran one after another), so runs are
    compared side by side, not on one time axis.
    """
    events = []
    for pid, (label, run_dir) in enumerate(labelled):
        path = Path(run_dir) / "trace.json"
        if not path.exists():
            continue
        trace = json.loads(path.read_text())
        for ev in trace.get("traceEvents", []):
            ev = dict(ev)
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                ev["args"] = {"name": label}
            ev["pid"] = pid
            events.append(ev)
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ======================================================================== the comparison report
def timeline_runs(runs: list[Run]) -> list[Run]:
    """Runs whose timeline tells a story: those whose ranks are pipeline stages (who waits for
    whom) and any multi-worker run that overlaps communication with computation (e.g. ddp's
    buckets under backward)."""
    return [r for r in runs if r.workers >= 2 and (r.stages or r.overlaps_communication)]


def build_compare_report(out_dir: Path, entries: list[dict], left_out: list[str], command: str,
                         settings: dict, wall_seconds: float, final_dir: Path | None = None,
                         figure_processes: int = 1) -> Report:
    """Figures, tables, merged trace and report.html/.md for a finished comparison in ``out_dir``.

    ``entries`` are the matrix's runs (strategy, workers, status, error, command, run_dir relative
    to ``out_dir``, log, seconds). Figures that cannot be drawn are named in the report with the reason;
    ``figure_processes`` > 1 draws them in that many children of the caller's forkserver (``figures.py``).
    """
    from . import plots
    from ..analysis.runs import load_run, series_of, sort_runs

    out_dir = Path(out_dir)
    final_dir = Path(final_dir or out_dir)
    runs: dict[int, Run] = {}
    for i, e in enumerate(entries):
        if e.get("run_dir"):
            runs[i] = load_run(out_dir / e["run_dir"])
    finished = sort_runs(list(runs.values()))
    figures = Figures(out_dir / "plots")  # asked for below, drawn together at the end
    draw = figures.add

    baseline = plots.baseline_strategy()
    headers, rows = results_table(entries, runs, baseline)
    (out_dir / "results.json").write_text(json.dumps(
        {"command": command, "headers": headers, "rows": rows, "settings": settings,
         "wall_seconds": wall_seconds, "left_out": left_out,
         "entries": [dict(e) for e in entries]},
        indent=2, default=str) + "\n")
    trace = merge_traces([(r.label, r.path) for r in finished])
    (out_dir / "trace.json").write_text(json.dumps(trace))

    rep = Report("paralab compare")
    ok = sum(1 for e in entries if e.get("status") == "ok")
    failed = [e for e in entries if e.get("status") == "failed"]
    first = finished[0] if finished else None
    s = rep.section("Results")
    if first:
        c = first.config
        s.para(f"{len(entries)} runs ({ok} finished, {len(failed)} failed) in {wall_seconds:.0f} s. "
               f"Model {c.get('model')} (width {c.get('width')}, {first.get('parameters'):,} parameters), "
               f"dataset {c.get('resolved_dataset', c.get('dataset'))}, global batch {first.get('global_batch')}, "
               f"{first.get('steps')} steps per run of which the first {first.get('warmup')} are warm-up "
               f"(left out of averages). Times are per iteration of the slowest rank; samples/s counts the "
               f"global batch; speedup divides {baseline or 'the 1-worker run'}'s time per iteration by each "
               f"run's.")
    else:
        s.para(f"{len(entries)} runs, none finished; see the errors below and the logs in logs/.")
    s.table(headers, rows, "Table 1 (as CS744's): time per iteration, throughput, speedup, test metrics, "
                           "check against the single-process reference")
    checked = sorted({r.get("check")["precision"] for r in finished if r.get("check")})
    if checked:
        s.para(f"Check: each run's weights and optimizer state after its first, second and last steps, the loss "
               f"it reported at every step and its outputs at the end, against the single-process reference, in "
               f"{' and '.join(checked)}; the column shows the largest deviation (FAIL: of the kinds that failed)."
               + (" fp32 is the course setting's check; `--precision fp64` makes it exact "
                  "(docs/correctness.md)." if "fp32" in checked else ""))
    diverged = [(r.label, r.get("check").get("first_divergence")) for r in finished
                if r.get("check") and r.get("check").get("first_divergence")]
    for label, line in diverged:  # a failed check's replay: where the run first went wrong
        s.para(f"{label}: {line}.")
    for r in finished:  # a user's file that called torch.distributed itself (strategies/user.py)
        untimed = r.rank_details(0).get("untimed_collectives")
        if untimed:
            s.para(f"{r.label}: its file calls torch.distributed itself ("
                   + ", ".join(f"{op} x{n}" for op, n in untimed.items())
                   + " on rank 0 over the run), which paralab cannot time: that communication counts as computation "
                     "in this run's time split and timeline. Its collectives through self.comm are timed.")
    ones = [r for r in finished if r.workers == 1 and r.seconds_per_iter]
    if len(ones) >= 2:
        lo, hi = min(r.seconds_per_iter for r in ones), max(r.seconds_per_iter for r in ones)
        s.para(f"Timing noise: the {len(ones)} one-worker runs do the same arithmetic (nothing to synchronise), "
               f"yet took {lo:.4f} to {hi:.4f} s per iteration ({100 * (hi - lo) / lo:.0f}% apart). Differences "
               "smaller than that are not significant on this machine; for firmer numbers run more steps "
               "(--num-batches) on an otherwise idle machine.")
    if left_out:  # one row per combination left out (commands/compare.LeftOut: its parts; a plain line: whole)
        s.table(["left out", "why", "to include it"],
                [[getattr(n, "layout", n), getattr(n, "reason", ""), getattr(n, "include", "") or "-"]
                 for n in left_out], caption="Combinations this comparison did not run, and why.")
    for e in failed:
        what = series_of(e["strategy"], e.get("config") or {})
        s.para(f"{what} at {e['workers']} worker(s) failed: {e.get('error')} (full output: {e.get('log')})")

    if finished:
        sec = rep.section("Throughput")
        p = draw(plots.plot_throughput, "throughput.png", finished)
        if p:
            sec.figure(p, "plots/throughput.png", "Global samples per second by strategy and worker count.")
        sec = rep.section("Scaling")
        p = draw(plots.plot_scaling, "scaling.png", finished, baseline=baseline)
        if p:
            sec.figure(p, "plots/scaling.png", "Seconds per iteration vs workers for each strategy; dashed: "
                       f"ideal T1/N from the strategy's own 1-worker run (else {baseline or 'none'}'s).")
        sec.table(*plots.scaling_table(finished, baseline))
        sec = rep.section("Split time per rank")
        p = draw(plots.plot_split_time, "split_time.png", finished)
        if p:
            sec.figure(p, "plots/split_time.png", "Mean time per iteration of every rank by category. "
                       "Hatched: asynchronous communication, overlapped with computation (not part of the total).")
        sec.table(*plots.split_table(finished), "milliseconds per iteration, mean over measured steps")
        sec = rep.section("Timelines")
        tl = timeline_runs(finished)
        if not tl:
            sec.para("No multi-worker run with pipeline stages or overlapped communication finished, so there "
                     "is no timeline to show.")
        for r in tl:
            name = f"timeline_{r.name}.png"
            p = draw(plots.plot_timeline, name, [r])
            if p:
                what = ("forward (F) and backward (B) of each microbatch per stage, waits hatched; right: the "
                        "ideal timeline of the same schedule on the measured stage times"
                        if r.stages else
                        "communication launched during backward runs on its own row (async) under each rank")
                sec.figure(p, f"plots/{name}", f"{r.label}: one measured step; {what}.")
        sec = rep.section("Memory per rank")
        p = draw(plots.plot_memory, "memory.png", finished)
        if p:
            sec.figure(p, "plots/memory.png", "Model-state bytes per rank: as reported by the strategy "
                       "(summary.json strategy_details) where it does, else estimated (dotted).")
        sec.table(*plots.memory_table(finished))
        if any(plots.moe_load(r) for r in finished):
            sec = rep.section("Mixture of experts: load")
            p = draw(plots.plot_moe_load, "moe_load.png", finished)
            if p:
                sec.figure(p, "plots/moe_load.png", "Left: tokens each rank routed to each expert; right: the "
                           "imbalance (max over mean tokens per expert) per step, and the dropped choices.")
            sec.table(*plots.moe_table(finished))
        sec = rep.section("Communication")
        sec.table(*comm_table(finished), "per measured step and rank; busbw = algbw x the collective's bus "
                  "factor (all-reduce 2(N-1)/N), as nccl-tests")
    failed = figures.draw(figure_processes)
    for sec in rep.sections:  # a figure that failed is left out, and named below
        sec.items = [i for i in sec.items if not (isinstance(i, Figure) and i.path.name in failed)]
    if failed:
        sec = rep.section("Figures not drawn")
        for name, why in failed.items():
            sec.para(f"{name}: not drawn ({why})")

    sec = rep.section("Commands")
    sec.para("The comparison:")
    sec.code(command)
    sec.para("Each run (a separate process; its output is in logs/):")
    sec.code("\n".join(e.get("command", "") for e in entries))
    sec.para(f"Trace: {final_dir / 'trace.json'} opens in https://ui.perfetto.dev or chrome://tracing "
             "(one process per run, one track per rank, async communication on its own track).")
    sec.para("Plot any of these runs again, e.g.:")
    some = [e for e in entries if e.get("run_dir")][:3]
    sec.code("\n".join([f"paralab plot throughput {' '.join(str(final_dir / e['run_dir']) for e in some)} -o t.png",
                        f"paralab plot split-time {final_dir}/runs/* -o split.png"]) if some else "(no finished run)")

    sec = rep.section("Configuration and environment")
    sec.table(["setting", "value"], [[k, v] for k, v in settings.items() if k not in ("func", "command")],
              "paralab compare settings")
    if first:
        sec.table(["", ""], environment_rows(first), "environment (from the first run's config.json)")
        keep = {k: v for k, v in first.config.items() if k not in ("environment", "strategy", "workers", "out")}
        sec.code(json.dumps(keep, indent=1, default=str))
    page, md = rep.write(out_dir)
    return rep
