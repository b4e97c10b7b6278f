"""The evaluation report: held-out documents for cloze items, the contamination audit, the
comparison with the previous report, plots, `report.md` / `report.html`, and the MLflow eval run.

Plain functions of dicts, files and bytes (no Dagster import). The metrics dict is what
`training.evaluate.evaluate_checkpoint` returns (plus "contamination" from `contamination_audit`).

Plots are matplotlib figures drawn on the Agg canvas (no display, no pyplot global state) and
embedded into report.html as base64 PNG, so the HTML file is self-contained: it loads nothing,
not even a font, from anywhere else.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Colors of the plots; tests look for them in a browser screenshot of report.html.
TRAINED_COLOR = "#1d4ed8"
STEP0_COLOR = "#9ca3af"
LOSS_COLOR = "#7c3aed"
BETTER_COLOR = "#15803d"
WORSE_COLOR = "#b91c1c"

# Direction of every metric the comparison knows; lm_eval metrics bring their own.
HIGHER_IS_BETTER = {"bits_per_byte": False, "perplexity": False, "loss": False, "cloze_accuracy": True}


# --- inputs ------------------------------------------------------------------------------

def heldout_documents(mixed_shards_dir: str | Path, text_sources: list[str | Path]) -> tuple[list[tuple[str, str, str]], int]:
    """((doc_id, bucket, text) of every document in the held-out rows, sorted by doc_id), missing count.

    Held-out documents are those `val_spans.parquet` names; their texts come from Parquet files
    or folders with doc_id and text columns (the deduplicated `kept/` folders of the mixture's inputs).
    """
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    spans = pq.read_table(Path(mixed_shards_dir) / "val_spans.parquet", columns=["bucket", "doc_id"])
    bucket_of = dict(zip(spans.column("doc_id").to_pylist(), spans.column("bucket").to_pylist()))
    found: dict[str, str] = {}
    wanted = sorted(bucket_of)
    for source in text_sources:
        table = ds.dataset(str(source), format="parquet").to_table(
            columns=["doc_id", "text"], filter=pc.field("doc_id").isin(wanted))
        for doc_id, text in zip(table.column("doc_id").to_pylist(), table.column("text").to_pylist()):
            found.setdefault(doc_id, text or "")
    documents = [(doc_id, bucket_of[doc_id], found[doc_id]) for doc_id in wanted if doc_id in found]
    return documents, len(wanted) - len(documents)


def contamination_audit(decontam: dict | None, max_rate: float) -> dict:
    """Counts per eval set from the mixed_shards manifest's `decontam` section, and the check.

    The rate checked is, per eval set, the share of its items whose n-grams occur in documents
    left in the training pool: 0 in `remove` mode (matching documents were dropped), the
    matched items in `flag` mode. The check passes when no eval set exceeds `max_rate`.
    """
    if not decontam or not decontam.get("enabled"):
        return {"enabled": False, "passed": True, "limit": max_rate, "max_item_rate": 0.0, "eval_sets": {},
                "note": "decontamination is off: no eval sets under mix.decontam.eval_sets"}
    removed_all = decontam.get("mode") == "remove"
    sets = {}
    for name, stats in sorted(decontam.get("eval_sets", {}).items()):
        leaked = 0 if removed_all else int(stats.get("items_matched", 0))
        items = int(stats.get("items", 0))
        sets[name] = {
            "items": items,
            "items_too_short": int(stats.get("items_too_short", 0)),
            "items_matched": int(stats.get("items_matched", 0)),
            "documents_matched": int(stats.get("documents_matched", 0)),
            "items_left_in_training": leaked,
            "item_rate": leaked / items if items else 0.0,
            "examples": list(stats.get("examples", [])),
        }
    scanned = int(decontam.get("documents_scanned", 0))
    contaminated = int(decontam.get("documents_contaminated", 0))
    kept = contaminated - int(decontam.get("documents_removed", 0))
    worst = max((s["item_rate"] for s in sets.values()), default=0.0)
    return {
        "enabled": True,
        "mode": decontam.get("mode"),
        "ngram": decontam.get("ngram"),
        "documents_scanned": scanned,
        "documents_contaminated": contaminated,
        "documents_removed": int(decontam.get("documents_removed", 0)),
        "documents_left_in_training": kept,
        "document_rate": kept / scanned if scanned else 0.0,
        "documents_without_text": int(decontam.get("documents_without_text", 0)),
        "eval_sets": sets,
        "max_item_rate": worst,
        "limit": max_rate,
        "passed": worst <= max_rate,
    }


# Files holding the results alone (no timings, run ids or comparisons): they make the data version.
RESULT_FILES = ["metrics.json", "cloze_items.jsonl"]


def write_results(folder: str | Path, metrics: dict) -> list[Path]:
    """metrics.json (everything but the per-item cloze rows) and cloze_items.jsonl (one item per line)."""
    folder = Path(folder)
    summary = {k: v for k, v in metrics.items() if k != "cloze"}
    summary["cloze"] = {b: {k: v for k, v in c.items() if k != "items"} for b, c in metrics.get("cloze", {}).items()}
    (folder / "metrics.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    (folder / "cloze_items.jsonl").write_text("".join(
        json.dumps(item, sort_keys=True) + "\n" for c in metrics.get("cloze", {}).values() for item in c.get("items", [])))
    return [folder / name for name in RESULT_FILES]


# --- key numbers and the comparison with the previous report -------------------------------

def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def key_metrics(metrics: dict) -> dict[str, dict]:
    """{"<metric>/<bucket or task>": {"metric", "scope", "value", "higher_is_better"}} of a metrics dict.

    Reports written before cloze existed ({"trained", "initial"} only) still give their
    per-bucket numbers, so the first new report compares with the last old one.
    """
    out = {}

    def put(metric: str, scope: str, value, higher_is_better: bool) -> None:
        if _finite(value):
            out[f"{metric}/{scope}"] = {"metric": metric, "scope": scope, "value": float(value),
                                        "higher_is_better": higher_is_better}

    for bucket, m in sorted(metrics.get("trained", {}).items()):
        for name in ("bits_per_byte", "perplexity", "loss"):
            put(name, bucket, m.get(name), HIGHER_IS_BETTER[name])
    for bucket, c in sorted(metrics.get("cloze", {}).items()):
        put("cloze_accuracy", bucket, c.get("trained", {}).get("accuracy"), True)
    lm_eval = metrics.get("lm_eval") or {}
    if lm_eval.get("status") == "ok":
        for task, values in sorted(lm_eval.get("tasks", {}).items()):
            for name, value in sorted(values.items()):
                direction = lm_eval.get("higher_is_better", {}).get(task, {}).get(name)
                if direction is not None:
                    put(f"lm_eval.{name}", task, value, bool(direction))
    return out


def compare(current: dict[str, dict], previous: dict[str, dict], rel_tol: float = 1e-9) -> list[dict]:
    """One row per metric both reports have: previous, current, delta and whether it got better."""
    rows = []
    for key in sorted(set(current) & set(previous)):
        now, before = current[key]["value"], previous[key]["value"]
        delta = now - before
        if abs(delta) <= rel_tol * max(1.0, abs(before)):
            verdict, arrow = "unchanged", "="
        else:
            better = (delta > 0) == current[key]["higher_is_better"]
            verdict, arrow = ("better", "▲") if better else ("worse", "▼")
        rows.append({"metric": current[key]["metric"], "scope": current[key]["scope"], "previous": before,
                     "current": now, "delta": delta, "relative": delta / abs(before) if before else None,
                     "verdict": verdict, "arrow": arrow})
    return rows


def report_numbers(metrics: dict) -> dict[str, float]:
    """The numbers for MLflow and the metadata: every compared metric, step 0 alongside."""
    numbers = {k: v["value"] for k, v in key_metrics(metrics).items()}
    for bucket, m in sorted(metrics.get("initial", {}).items()):
        numbers |= {f"step0_{name}/{bucket}": m[name] for name in ("bits_per_byte", "perplexity") if _finite(m[name])}
    for bucket, c in sorted(metrics.get("cloze", {}).items()):
        numbers[f"cloze_items/{bucket}"] = c["trained"]["items"]
        if _finite(c["initial"]["accuracy"]):
            numbers[f"step0_cloze_accuracy/{bucket}"] = c["initial"]["accuracy"]
    if "contamination" in metrics:
        numbers["contamination_max_item_rate"] = metrics["contamination"]["max_item_rate"]
    return numbers


def check_finite(metrics: dict, buckets: list[str]) -> tuple[bool, dict]:
    """Every bucket has finite loss, perplexity and bits per byte, trained and step 0, and a
    finite cloze accuracy when it has cloze items. Returns (passed, per-bucket problems)."""
    problems = {}
    for bucket in buckets:
        missing = []
        for side in ("trained", "initial"):
            m = metrics.get(side, {}).get(bucket)
            if m is None:
                missing.append(f"{side}: no metrics")
                continue
            missing += [f"{side}.{k}={m.get(k)}" for k in ("loss", "perplexity", "bits_per_byte") if not _finite(m.get(k))]
        cloze = metrics.get("cloze", {}).get(bucket, {}).get("trained", {})
        if cloze.get("items") and not _finite(cloze.get("accuracy")):
            missing.append(f"cloze.accuracy={cloze.get('accuracy')}")
        if missing:
            problems[bucket] = missing
    return not problems and bool(buckets), problems


# --- plots ---------------------------------------------------------------------------------

def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    # No "Software" entry: the bytes then depend only on the data and the matplotlib version.
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return buffer.getvalue()


def _figure(width: float = 7.0, height: float = 3.2):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def loss_curve_png(history: list[tuple[int, float]], source: str) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    steps = [s for s, _ in history]
    ax.plot(steps, [v for _, v in history], color=LOSS_COLOR, linewidth=2.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Training loss ({source})")
    ax.grid(alpha=0.3)
    return _png(fig)


def bucket_bars_png(buckets: list[str], trained: list[float], step0: list[float], ylabel: str, title: str,
                    ylim: tuple[float, float] | None = None) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    x = list(range(len(buckets)))
    ax.bar([i - 0.2 for i in x], step0, width=0.4, color=STEP0_COLOR, label="step 0")
    ax.bar([i + 0.2 for i in x], trained, width=0.4, color=TRAINED_COLOR, label="trained")
    for i, (before, after) in enumerate(zip(step0, trained)):
        ax.annotate(f"{after:.3f}", (i + 0.2, after), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{before:.3f}", (i - 0.2, before), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, buckets)
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best")
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def deltas_png(rows: list[dict]) -> bytes:
    """Relative change of every compared metric, signed so that right is better."""
    rows = [r for r in rows if r["relative"] is not None]
    fig = _figure(height=max(2.0, 0.35 * len(rows) + 1.2))
    ax = fig.add_subplot()
    labels = [f"{r['metric']} / {r['scope']}" for r in rows]
    gains = [100.0 * abs(r["relative"]) * (1 if r["verdict"] == "better" else -1 if r["verdict"] == "worse" else 0)
             for r in rows]
    ax.barh(range(len(rows)), gains, color=[BETTER_COLOR if g >= 0 else WORSE_COLOR for g in gains])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("change vs. previous report, % (right = better)")
    ax.set_title("Compared with the previous report")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


# --- the report ----------------------------------------------------------------------------

@dataclass
class Report:
    markdown: str
    summary: str  # the headline part of the markdown, for Dagster metadata
    html: str
    figures: dict[str, bytes] = field(default_factory=dict)  # file name -> PNG bytes

    def write(self, folder: str | Path) -> list[Path]:
        folder = Path(folder)
        paths = [folder / "report.md", folder / "report.html"]
        paths[0].write_text(self.markdown)
        paths[1].write_text(self.html)
        for name, data in sorted(self.figures.items()):
            (folder / name).write_bytes(data)
            paths.append(folder / name)
        return paths


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _md_table(rows: list[list], header: list[str]) -> str:
    if not rows:
        return "_(none)_"
    cell = lambda v: _fmt(v).replace("|", "\\|").replace("\n", " ⏎ ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _html_table(rows: list[list], header: list[str]) -> str:
    if not rows:
        return "<p><em>(none)</em></p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 64rem;
       padding: 0 1rem; color: #111827; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #e5e7eb; }
table { border-collapse: collapse; margin: 0.6rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #d1d5db; padding: 0.25rem 0.55rem; text-align: left; vertical-align: top; }
th { background: #f3f4f6; } td.better { color: #15803d; } td.worse { color: #b91c1c; }
img { max-width: 100%; display: block; margin: 0.5rem 0; }
pre { white-space: pre-wrap; background: #f9fafb; padding: 0.4rem; margin: 0; font-size: 0.85rem; }
.note { color: #4b5563; font-size: 0.9rem; } .fail { color: #b91c1c; font-weight: bold; }
"""


def _sections(metrics: dict, comparison: list[dict] | None, previous_version: str | None,
              loss_source: str | None, header: list[str]) -> list[dict]:
    """The report as sections of tables and notes, rendered to both Markdown and HTML."""
    buckets = sorted(metrics.get("trained", {}))
    trained, initial = metrics.get("trained", {}), metrics.get("initial", {})
    sections = [{"title": None, "notes": header}]
    sections.append({
        "title": "Held-out bits per byte and perplexity",
        "notes": ["Held-out split of `mixed_shards` (documents never in training). Bits per byte comes first: "
                  "unlike perplexity it compares across tokenizers."],
        "table": (["bucket", "bits/byte", "bits/byte step 0", "Δ vs step 0", "perplexity", "perplexity step 0",
                   "tokens"],
                  [[b, trained[b]["bits_per_byte"], initial.get(b, {}).get("bits_per_byte"),
                    _delta(trained[b]["bits_per_byte"], initial.get(b, {}).get("bits_per_byte")),
                    trained[b]["perplexity"], initial.get(b, {}).get("perplexity"), trained[b]["tokens"]]
                   for b in buckets]),
        "figure": "bpb_by_bucket.png",
    })
    cloze = metrics.get("cloze", {})
    sections.append({
        "title": "Cloze accuracy (last word of held-out passages, greedy)",
        "notes": ["Passages end at a sentence-final word of a held-out document; the model must produce every "
                  "token of that word greedily. Construction: `training/evaluate.py` docstring."],
        "table": (["bucket", "items", "accuracy", "accuracy step 0", "mean target log-prob", "step 0"],
                  [[b, c["trained"]["items"], c["trained"]["accuracy"], c["initial"]["accuracy"],
                    c["trained"]["mean_target_logprob"], c["initial"]["mean_target_logprob"]]
                   for b, c in sorted(cloze.items())]),
        "figure": "cloze_by_bucket.png" if any(c["trained"]["items"] for c in cloze.values()) else None,
    })
    examples = [[b, "…" + item["context_tail"][-80:], item["word"], item["greedy"], item["correct"]]
                for b, c in sorted(cloze.items()) for item in c.get("items", [])[:4]]
    sections.append({"title": "Cloze examples", "table": (["bucket", "context (end)", "target", "greedy", "correct"],
                                                          examples)})
    audit = metrics.get("contamination", {})
    if audit.get("enabled"):
        notes = [f"Decontamination mode `{audit['mode']}`, {audit['ngram']}-word n-grams: "
                 f"{audit['documents_contaminated']} of {audit['documents_scanned']} documents matched an eval set, "
                 f"{audit['documents_removed']} removed, {audit['documents_left_in_training']} left in training.",
                 f"Check: the share of an eval set's items left in training must not exceed {audit['limit']:.2%}: "
                 + ("passed." if audit["passed"] else f"**FAILED** ({audit['max_item_rate']:.2%}).")]
        if audit.get("documents_without_text"):
            notes.append(f"{audit['documents_without_text']} documents had no text and were not checked.")
    else:
        notes = [audit.get("note", "no contamination audit"), "Check: passed (nothing to measure)."]
    sections.append({
        "title": "Contamination audit",
        "notes": notes,
        "table": (["eval set", "items", "too short", "items matched", "documents matched", "items left in training",
                   "rate"],
                  [[name, s["items"], s["items_too_short"], s["items_matched"], s["documents_matched"],
                    s["items_left_in_training"], s["item_rate"]] for name, s in audit.get("eval_sets", {}).items()]),
    })
    matches = [[name, e.get("doc_id"), e.get("item"), e.get("matching_ngrams"), e.get("span")]
               for name, s in audit.get("eval_sets", {}).items() for e in s["examples"]]
    if matches:
        sections.append({"title": "Matching examples",
                         "table": (["eval set", "doc_id", "item", "matching n-grams", "span"], matches)})
    if comparison is None:
        sections.append({"title": "Compared with the previous report",
                         "notes": ["No previous eval_report was published: nothing to compare with."]})
    else:
        sections.append({
            "title": "Compared with the previous report",
            "notes": [f"Previous report: data version `{previous_version}`. ▲ better, ▼ worse, = unchanged."],
            "table": (["metric", "bucket / task", "previous", "current", "delta", "change"],
                      [[r["metric"], r["scope"], r["previous"], r["current"], r["delta"],
                        f"{r['arrow']} {r['verdict']}"] for r in comparison]),
            "figure": "deltas.png",
        })
    sections.append({
        "title": "Samples (through the Hugging Face export)",
        "notes": ["Greedy decoding, and one sampled decoding per prompt (seed shown); ⏎ marks a line break, "
                  "[EOS] the end of a document."],
        "table": (["prompt", "greedy", "sampled", "seed"],
                  [[_one_line(s["prompt"]), _one_line(s["greedy"]) + (" [EOS]" if s["greedy_ended"] else ""),
                    _one_line(s["sampled"]) + (" [EOS]" if s["sampled_ended"] else ""), s["seed"]]
                   for s in metrics.get("samples", [])]),
        "pre": True,
    })
    lm_eval = metrics.get("lm_eval") or {"status": "skipped", "reason": "not run"}
    if lm_eval["status"] == "ok":
        sections.append({
            "title": "lm-evaluation-harness",
            "notes": [f"lm_eval {lm_eval['version']}, its `{lm_eval.get('model', 'hf')}` model on the HF export"
                      + "".join(f", {k}={v}" for k, v in sorted(lm_eval.get("model_args", {}).items()))
                      + "; local task files, offline."],
            "table": (["task", "metric", "value", "higher is better", "documents"],
                      [[task, name, value, lm_eval["higher_is_better"].get(task, {}).get(name),
                        lm_eval["samples"].get(task)]
                       for task, values in lm_eval["tasks"].items() for name, value in values.items()]),
        })
    else:
        sections.append({"title": "lm-evaluation-harness", "notes": [f"Skipped: {lm_eval['reason']}."]})
    if loss_source:
        sections.append({"title": "Training loss", "notes": [f"Per-step training loss read back from {loss_source}."],
                         "figure": "loss_curve.png"})
    return sections


def _one_line(text: str) -> str:
    return text.replace("\n", "⏎ ")


def _delta(after, before):
    return after - before if _finite(after) and _finite(before) else None


def _markdown(sections: list[dict], figures: dict[str, bytes]) -> str:
    lines = ["# Kiln evaluation report", ""]
    for section in sections:
        if section["title"]:
            lines += [f"## {section['title']}", ""]
        for note in section.get("notes", []):
            lines += [note, ""]
        if "table" in section:
            lines += [_md_table(section["table"][1], section["table"][0]), ""]
        if section.get("figure") in figures:
            lines += [f"![{section['title']}]({section['figure']})", ""]
    return "\n".join(lines)


def _inline_md(text: str) -> str:
    """`code` and **bold** of the notes, as HTML."""
    import re

    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r'<span class="fail">\1</span>', text)


def _html(sections: list[dict], figures: dict[str, bytes]) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>Kiln evaluation report</title>", f"<style>{_CSS}</style></head><body>",
             "<h1>Kiln evaluation report</h1>"]
    for section in sections:
        if section["title"]:
            parts.append(f"<h2>{html.escape(section['title'])}</h2>")
        parts += [f'<p class="note">{_inline_md(note)}</p>' for note in section.get("notes", [])]
        if "table" in section:
            header, rows = section["table"]
            if section.get("pre"):
                body = "".join("<tr>" + "".join(f"<td><pre>{html.escape(_fmt(v))}</pre></td>" for v in row) + "</tr>"
                               for row in rows)
                head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                parts.append(_html_table(rows, header))
        name = section.get("figure")
        if name in figures:
            data = base64.b64encode(figures[name]).decode("ascii")
            parts.append(f'<img alt="{html.escape(section["title"])}" src="data:image/png;base64,{data}">')
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(metrics: dict, *, comparison: list[dict] | None = None, previous_version: str | None = None,
                 loss_history: list[tuple[int, float]] | None = None, loss_source: str | None = None,
                 header: list[str] = ()) -> Report:
    """report.md, report.html (plots embedded) and the PNGs, from the metrics dict.

    `comparison` is `compare(...)` against the previous report (None: there was none);
    `loss_history` is (step, loss) of the training run; `header` lines open the report.
    """
    buckets = sorted(metrics.get("trained", {}))
    figures = {}
    if buckets:
        figures["bpb_by_bucket.png"] = bucket_bars_png(
            buckets, [metrics["trained"][b]["bits_per_byte"] for b in buckets],
            [metrics["initial"][b]["bits_per_byte"] for b in buckets], "bits per byte (lower is better)",
            "Held-out bits per byte: trained vs. step 0")
    cloze = metrics.get("cloze", {})
    scored = [b for b in sorted(cloze) if cloze[b]["trained"]["items"]]
    if scored:
        figures["cloze_by_bucket.png"] = bucket_bars_png(
            scored, [cloze[b]["trained"]["accuracy"] for b in scored], [cloze[b]["initial"]["accuracy"] for b in scored],
            "accuracy (higher is better)", "Cloze accuracy: trained vs. step 0", ylim=(0.0, 1.05))
    if comparison and any(r["relative"] is not None and r["verdict"] != "unchanged" for r in comparison):
        figures["deltas.png"] = deltas_png(comparison)
    if loss_history:
        figures["loss_curve.png"] = loss_curve_png(loss_history, loss_source or "training")
    sections = _sections(metrics, comparison, previous_version, loss_source if loss_history else None, list(header))
    markdown = _markdown(sections, figures)
    headline = [s for s in sections if s["title"] in (None, "Held-out bits per byte and perplexity",
                                                       "Cloze accuracy (last word of held-out passages, greedy)",
                                                       "Contamination audit", "Compared with the previous report")]
    return Report(markdown=markdown, summary=_markdown(headline, {}), html=_html(sections, figures), figures=figures)


# --- MLflow --------------------------------------------------------------------------------

def training_loss_history(tracking_uri: str, run_id: str | None, metrics_jsonl: str | Path | None = None
                          ) -> tuple[list[tuple[int, float]], str | None]:
    """(step, loss) of the training run from MLflow; from metrics.jsonl when MLflow has none."""
    if run_id:
        import mlflow

        try:
            history = mlflow.MlflowClient(tracking_uri).get_metric_history(run_id, "loss")
        except mlflow.exceptions.MlflowException:
            history = []
        # A resumed run logs the steps after its checkpoint again: the newest value of a step wins
        # (ties keep MLflow's order). A step whose newest value is not finite was skipped: dropped.
        latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
        points = sorted((step, value) for step, value in latest.items() if math.isfinite(value))
        if points:
            return points, f"MLflow run {run_id}"
    if metrics_jsonl and Path(metrics_jsonl).exists():
        records = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
        points = [(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))]
        if points:
            return points, "metrics.jsonl of the checkpoint"
    return [], None


def log_eval_run(tracking_uri: str, experiment_id: str, *, run_name: str, training_run_id: str | None,
                 key_numbers: dict[str, float], params: dict, tags: dict[str, str], artifacts: list[Path]) -> str:
    """An MLflow run holding the report (metrics, HTML, PNGs), nested under the training run.

    The training run also gets the per-bucket eval numbers (`eval_<name>`), as before, and a
    `kiln.eval_run_id` tag that points at this run.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    run_tags = {**tags}
    if training_run_id:
        # mlflow.parentRunId nests the eval run under the training run in the MLflow UI.
        run_tags.update({"kiln.training_run_id": training_run_id, "mlflow.parentRunId": training_run_id})
    run = client.create_run(experiment_id, run_name=run_name, tags=run_tags)
    run_id = run.info.run_id
    try:
        for name, value in sorted(params.items()):
            client.log_param(run_id, name, str(value)[:6000])
        for name, value in sorted(key_numbers.items()):
            client.log_metric(run_id, name, value)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    if training_run_id:
        for name, value in sorted(key_numbers.items()):
            if "/" in name and not name.startswith("step0_"):
                client.log_metric(training_run_id, "eval_" + name.replace("/", "_"), value)
        client.set_tag(training_run_id, "kiln.eval_run_id", run_id)
    return run_id
