"""Lineage lookups: from a training sequence (or a doc_id) back to the crawl.

A row of `mixed_shards` is a list of spans (`train_spans.parquet`, `val_spans.parquet`). Each
span's doc_id leads to its snapshot's `documents` (URL, WARC file and record), `quality_signals`
(every signal value), `filtered` (kept with the rules it passed, or the rule, value, threshold
and detail that removed it), `deduplicated` (its duplicate cluster) and `tokenized` (shard and offset, from
the document index beside the one shard its doc_id hashes to).

Every lookup reads Parquet through `pyarrow.dataset` with a predicate on the id column: the
stages write their files sorted by doc_id, so row-group statistics skip what cannot hold an id,
and nothing is loaded whole into memory. Plain functions over artifact folders: which folders
belong together is decided by the caller (workflows/trace.py follows the stored manifests).
"""
from __future__ import annotations

import functools
import json
import math
import operator
import os
from dataclasses import dataclass, field

DOCUMENT_FIELDS = ("url", "domain", "snapshot", "warc_file", "warc_record_id", "fetch_time", "charset", "bucket")
_OR_TERMS_MAX = 64  # up to this many ids the predicate is a chain of equalities (statistics-friendly)
# A rule's `op` says when it fires; a document that passed satisfies the opposite.
_PASS_CONDITION = {"lt": ">=", "le": ">", "gt": "<=", "ge": "<"}
_FIRES = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


@dataclass(frozen=True)
class SnapshotFolders:
    """The artifact folders of one snapshot that a mixture was built from."""

    snapshot: str
    folders: dict[str, str]  # asset name -> folder; an asset not found is absent
    filter_config: dict | None = None  # the `filters` section `filtered` ran with (from its manifest)


@dataclass(frozen=True)
class Lineage:
    """A `mixed_shards` folder and everything upstream of it, per snapshot."""

    mixed: str
    snapshots: tuple[SnapshotFolders, ...]
    tokenizer: str | None = None
    versions: dict = field(default_factory=dict)  # data versions, reported as they are


# --- Parquet lookups ---------------------------------------------------------------------------

def id_filter(column: str, ids):
    """A pyarrow.dataset predicate selecting rows whose `column` is one of `ids`."""
    import pyarrow.compute as pc

    ids = sorted(set(ids))
    if not ids:
        raise ValueError("no ids to filter on")
    if len(ids) <= _OR_TERMS_MAX:
        return functools.reduce(operator.or_, (pc.field(column) == value for value in ids))
    return pc.field(column).isin(ids)


def read_rows(path: str | list[str] | None, ids, *, column: str = "doc_id",
              columns: list[str] | None = None) -> list[dict]:
    """Rows of the Parquet file or folder `path` (or list of files) whose `column` is in `ids`
    (`columns` only, when given; never `minhash`)."""
    import pyarrow.dataset as ds

    ids = set(ids)
    if isinstance(path, list):
        path = [p for p in path if os.path.exists(p)] or None
    if not ids or not path or (isinstance(path, str) and not os.path.exists(path)):
        return []
    dataset = ds.dataset(path, format="parquet")
    names = dataset.schema.names
    wanted = [c for c in (columns or names) if c in names and c != "minhash"]
    if column not in names:
        return []
    return dataset.to_table(columns=wanted, filter=id_filter(column, ids)).to_pylist()


def token_index_files(folder: str | None, doc_ids) -> list[str] | None:
    """The document index files of a tokenized folder that can hold `doc_ids`: the one beside
    each shard the ids hash to (the contract's blake2b(doc_id) % num_shards)."""
    from engine.tokenize import doc_index_files, num_shards_in, shard_of

    if not folder or not os.path.isdir(folder):
        return None
    num_shards = num_shards_in(folder)
    if not num_shards:
        return None
    return doc_index_files(folder, shard_of(sorted(set(doc_ids)), num_shards).tolist())


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


# --- decisions ---------------------------------------------------------------------------------

def passed_rules(filter_config: dict | None, signals: dict | None, c4_lines: bytes | None = None) -> list[dict] | None:
    """Each filter rule that applied to a document, with its value, the condition a kept document
    meets and the threshold; None when the stored config no longer parses (another code version).
    Given the document's `c4_lines`, C4's page signals are the ones `filtered` compared: those of
    the lines left after the config's line removal.
    """
    if filter_config is None or signals is None:
        return None
    try:
        from engine.filters import LANGUAGE_NOT_ALLOWED, FilterConfig, c4_line_outcome, rules

        cfg = FilterConfig(**filter_config)
        active = rules(cfg)
    except Exception:  # noqa: BLE001 - an old or foreign config only costs the detail
        return None
    language = signals.get("language")
    if c4_lines is not None:
        page = c4_line_outcome([c4_lines], [language], cfg).page
        signals = {**signals, **{name: int(values[0]) for name, values in page.items()}}
    out = []
    for rule in active:
        if rule.name == LANGUAGE_NOT_ALLOWED:
            out.append({"rule": rule.name, "signal": "language", "value": language, "condition": "in",
                        "threshold": list(cfg.languages), "passed": language in cfg.languages})
            continue
        if rule.scope == "segmented" and language in cfg.unsegmented_languages:
            continue
        if rule.scope == "stop_words" and language not in cfg.stop_word_languages:
            continue
        value = _clean(signals.get(rule.signal))
        value = None if value is None else float(value)
        fires = value is not None and _FIRES[rule.op](value, rule.threshold)
        if rule.name == "classifier_score" and value is None:
            fires = True  # as in engine/filters.py: an unscored document cannot pass
        out.append({"rule": rule.name, "signal": rule.signal, "value": value,
                    "condition": _PASS_CONDITION[rule.op], "threshold": rule.threshold, "passed": not fires})
    return out


def _filter_decision(doc_id: str, rejected: dict, kept: set, signals: dict | None, filter_config: dict | None,
                     has_filtered: bool, c4_lines: bytes | None = None) -> dict:
    if doc_id in rejected:
        row = rejected[doc_id]
        decision = {"decision": "rejected", "rule": row["rule"], "value": _clean(row["value"]),
                    "threshold": _clean(row["threshold"])}
        if row.get("detail"):  # rejection tables written before `detail` existed have none
            decision["detail"] = row["detail"]
        return decision
    if doc_id in kept:
        return {"decision": "kept", "passed": passed_rules(filter_config, signals, c4_lines)}
    return {"decision": "unknown" if not has_filtered else "missing"}


def _dedup_decision(doc_id: str, removed: dict, representative_of: dict, kept: set, filtered_out: bool,
                    has_dedup: bool) -> dict:
    if doc_id in removed:
        row = removed[doc_id]
        return {"status": "removed", "reason": row["reason"], "cluster_id": row["cluster_id"],
                "kept_doc_id": row["kept_doc_id"]}
    if doc_id in representative_of:
        rows = representative_of[doc_id]
        reasons: dict[str, int] = {}
        for row in rows:
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
        clusters = sorted({row["cluster_id"] for row in rows})
        return {"status": "kept", "cluster_id": clusters[0] if len(clusters) == 1 else clusters,
                "duplicates_removed": len(rows), "reasons": dict(sorted(reasons.items())),
                "removed_doc_ids": sorted(row["doc_id"] for row in rows)}
    if doc_id in kept:
        return {"status": "unique"}
    if filtered_out:
        return {"status": "not_reached", "why": "removed by the filters before dedup"}
    return {"status": "unknown" if not has_dedup else "missing"}


def lookup_documents(lineage: Lineage, doc_ids, *, include_text: bool = False) -> dict[str, dict]:
    """doc_id -> everything the lineage knows about it; ids found in no snapshot are absent.

    `include_text` adds `text`: the stored training text (deduplicated/kept, PII redacted),
    None for documents that did not survive to it.
    """
    remaining = set(doc_ids)
    found: dict[str, dict] = {}
    for snap in lineage.snapshots:
        if not remaining:
            break
        f = snap.folders

        def join(asset: str, *parts: str) -> str | None:
            return os.path.join(f[asset], *parts) if asset in f else None

        doc_rows = read_rows(join("documents", "data"), remaining, columns=["doc_id", *DOCUMENT_FIELDS])
        # Without a documents artifact, the tokenized index still places the document here.
        located = {r["doc_id"] for r in doc_rows} or {
            r["doc_id"] for r in read_rows(token_index_files(f.get("tokenized"), remaining), remaining,
                                           columns=["doc_id"])}
        if not located:
            continue
        remaining -= located
        documents = {r["doc_id"]: r for r in doc_rows}
        rejected = {r["doc_id"]: r for r in read_rows(join("filtered", "rejected"), located)}
        filter_kept = {r["doc_id"] for r in read_rows(join("filtered", "kept"), located, columns=["doc_id"])}
        # One read of the signals; C4's per-line facts (bytes, not a signal) are set apart: for
        # the kept documents they give the page signals `filtered` compared.
        signals: dict[str, dict] = {}
        c4_lines: dict[str, bytes | None] = {}
        for r in read_rows(join("quality_signals", "data"), located):
            doc_id = r.pop("doc_id")
            if "c4_lines" in r:
                lines = r.pop("c4_lines")
                if doc_id in filter_kept:
                    c4_lines[doc_id] = lines
            signals[doc_id] = {k: _clean(v) for k, v in r.items()}
        removed = {r["doc_id"]: r for r in read_rows(join("deduplicated", "duplicates"), located)}
        representative_of: dict[str, list[dict]] = {}
        for row in read_rows(join("deduplicated", "duplicates"), located, column="kept_doc_id"):
            representative_of.setdefault(row["kept_doc_id"], []).append(row)
        dedup_kept = {r["doc_id"]: r.get("text") for r in read_rows(
            join("deduplicated", "kept"), located, columns=["doc_id", "text"] if include_text else ["doc_id"])}
        token_index = {r["doc_id"]: r for r in read_rows(token_index_files(f.get("tokenized"), located), located)}
        for doc_id in sorted(located):
            doc = documents.get(doc_id, {})
            decision = _filter_decision(doc_id, rejected, filter_kept, signals.get(doc_id), snap.filter_config,
                                        "filtered" in f, c4_lines.get(doc_id))
            record = {
                "doc_id": doc_id,
                "partition": snap.snapshot,
                **{name: doc.get(name) for name in DOCUMENT_FIELDS},
                "signals": signals.get(doc_id),
                "filter": decision,
                "dedup": _dedup_decision(doc_id, removed, representative_of, set(dedup_kept),
                                         decision["decision"] == "rejected", "deduplicated" in f),
                "tokenized": ({k: v for k, v in token_index[doc_id].items() if k not in ("doc_id", "bucket")}
                              if doc_id in token_index else None),
            }
            if include_text:
                record["text"] = dedup_kept.get(doc_id)
            found[doc_id] = record
    return found


# --- traces ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _processor(model_path: str):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=model_path)


def _decode(lineage: Lineage, tokens: list[int]) -> str | None:
    model = os.path.join(lineage.tokenizer, "tokenizer.model") if lineage.tokenizer else None
    if not model or not os.path.exists(model):
        return None
    return _processor(model).decode(tokens)  # control ids (EOS) decode to nothing


def trace_sequence(lineage: Lineage, seq_index: int, *, bucket: str | None = None,
                   include_text: bool = False) -> dict:
    """Every span of training sequence `seq_index` (validation row of `bucket` if given) with
    its tokens, their decoded text and the full record of the document it comes from."""
    from engine.mix import trace_sequence as sequence_spans

    spans = sequence_spans(lineage.mixed, seq_index, bucket)
    documents = lookup_documents(lineage, [s["doc_id"] for s in spans], include_text=include_text)
    with open(os.path.join(lineage.mixed, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    for span in spans:
        span["span_text"] = _decode(lineage, span["tokens"])
        span["document"] = documents.get(span["doc_id"])
    return {
        "mixed_shards": lineage.mixed,
        "versions": lineage.versions,
        "split": "train" if bucket is None else "validation",
        "bucket": bucket,
        "seq_index": seq_index,
        "seq_len": manifest["seq_len"],
        "num_tokens": sum(s["length"] for s in spans),
        "spans": spans,
    }


def trace_document(lineage: Lineage, doc_id: str, *, max_sequences: int = 20, include_text: bool = False) -> dict:
    """The record of `doc_id` (even when filters or dedup removed it) and where the mixture uses it."""
    documents = lookup_documents(lineage, [doc_id], include_text=include_text)
    if doc_id not in documents:
        raise KeyError(f"doc_id {doc_id} is in none of the snapshots this mixture was built from")
    record = documents[doc_id]
    span_columns = ["seq_index", "seq_offset", "doc_token_start", "length"]
    train = read_rows(os.path.join(lineage.mixed, "train_spans.parquet"), [doc_id], columns=span_columns)
    val = read_rows(os.path.join(lineage.mixed, "val_spans.parquet"), [doc_id], columns=["bucket", *span_columns])
    train_sequences = sorted({r["seq_index"] for r in train})
    record["mixture"] = {
        "train_spans": len(train),
        "train_tokens": sum(r["length"] for r in train),
        "train_sequences": len(train_sequences),
        "first_train_sequences": train_sequences[:max_sequences],
        "held_out": bool(val),
        "validation_rows": [{"bucket": b, "seq_index": i}
                            for b, i in sorted({(r["bucket"], r["seq_index"]) for r in val})[:max_sequences]],
    }
    return {"mixed_shards": lineage.mixed, "versions": lineage.versions, "document": record}


# --- text output -------------------------------------------------------------------------------

def _fmt(value) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _wrapped(label: str, items: list[str], width: int = 110) -> list[str]:
    """`items` joined by "; " over lines of at most `width` characters, never splitting an item."""
    head = f"  {label:<10} "
    lines, current, fresh = [], head, True
    for i, item in enumerate(items):
        piece = item + (";" if i < len(items) - 1 else "")
        if not fresh and len(current) + len(piece) > width:
            lines.append(current.rstrip())
            current = " " * len(head)
        current += piece + " "
        fresh = False
    lines.append(current.rstrip())
    return lines


def _document_lines(doc: dict | None) -> list[str]:
    if doc is None:
        return ["  (document not found in the snapshots of this mixture)"]
    signals = doc.get("signals") or {}
    language = signals.get("language")
    lines = [
        f"  doc_id     {doc['doc_id']}",
        f"  url        {doc.get('url')}",
        f"  snapshot   {doc.get('snapshot') or doc.get('partition')}   bucket {doc.get('bucket')}   "
        f"language {language} ({_fmt(signals.get('language_score'))})",
        f"  warc       {doc.get('warc_file')}  record {doc.get('warc_record_id')}  fetched {doc.get('fetch_time')}",
    ]
    decision = doc["filter"]
    if decision["decision"] == "rejected":
        lines.append(f"  filters    REJECTED by {decision['rule']}: value {_fmt(decision['value'])}, "
                     f"threshold {_fmt(decision['threshold'])}")
        if decision.get("detail"):
            lines.append(f"             why: {decision['detail']}")
    elif decision["decision"] == "kept":
        passed = decision.get("passed")
        if passed is None:
            lines.append("  filters    kept (rule details unavailable for this filter config)")
        else:
            items = [f"{r['signal']} {_fmt(r['value'])} {r['condition']} {_fmt(r['threshold'])}" for r in passed]
            lines += _wrapped("filters", [f"kept, passed {sum(r['passed'] for r in passed)} rules: " + items[0], *items[1:]]
                              if items else ["kept (no active rules)"])
    else:
        lines.append(f"  filters    {decision['decision']}")
    dedup = doc["dedup"]
    if dedup["status"] == "removed":
        lines.append(f"  dedup      REMOVED as {dedup['reason']} duplicate of {dedup['kept_doc_id']} "
                     f"(cluster {dedup['cluster_id']})")
    elif dedup["status"] == "kept":
        reasons = ", ".join(f"{n} {reason}" for reason, n in dedup["reasons"].items())
        lines.append(f"  dedup      kept for cluster {_fmt(dedup['cluster_id'])} ({reasons} duplicate(s) removed)")
    elif dedup["status"] == "not_reached":
        lines.append("  dedup      - (removed by the filters first)")
    else:
        lines.append(f"  dedup      {dedup['status']}")
    shown = {k: v for k, v in signals.items() if k not in ("language", "language_score")}
    lines += _wrapped("signals", [f"{k}={_fmt(v)}" for k, v in shown.items()])
    return lines


def format_sequence(trace: dict) -> str:
    where = "train sequence" if trace["split"] == "train" else f"validation row ({trace['bucket']})"
    version = trace["versions"].get("mixed_shards", os.path.basename(trace["mixed_shards"]))
    lines = [f"mixed_shards {version}: {where} {trace['seq_index']}, {trace['num_tokens']} tokens "
             f"(seq_len {trace['seq_len']} + 1) in {len(trace['spans'])} span(s)"]
    for n, span in enumerate(trace["spans"], 1):
        lines += [
            "",
            f"span {n}/{len(trace['spans'])}: sequence tokens {span['seq_offset']}..{span['seq_offset'] + span['length']} "
            f"= document tokens {span['doc_token_start']}..{span['doc_token_start'] + span['length']}",
            *_document_lines(span["document"]),
        ]
        if span.get("span_text") is not None:
            preview = span["span_text"] if len(span["span_text"]) <= 160 else span["span_text"][:157] + "..."
            lines.append(f"  text       {json.dumps(preview, ensure_ascii=False)}")
    return "\n".join(lines)


def format_document(trace: dict) -> str:
    doc = trace["document"]
    mixture = doc["mixture"]
    version = trace["versions"].get("mixed_shards", os.path.basename(trace["mixed_shards"]))
    lines = [f"document {doc['doc_id']} (mixed_shards {version})", *_document_lines(doc)]
    if doc.get("tokenized"):
        t = doc["tokenized"]
        lines.append(f"  tokenized  shard {t['shard']} document {t['shard_doc']}, {t['num_tokens']} tokens "
                     f"at offset {t['token_offset']}")
    if mixture["train_spans"]:
        shown = ", ".join(map(str, mixture["first_train_sequences"]))
        more = " ..." if mixture["train_sequences"] > len(mixture["first_train_sequences"]) else ""
        lines.append(f"  mixture    {mixture['train_tokens']} tokens in {mixture['train_sequences']} train sequence(s): "
                     f"{shown}{more}")
    elif mixture["held_out"]:
        rows = ", ".join(f"{r['bucket']}:{r['seq_index']}" for r in mixture["validation_rows"])
        lines.append(f"  mixture    held out for validation, rows {rows}")
    else:
        lines.append("  mixture    not in the training mixture")
    return "\n".join(lines)
