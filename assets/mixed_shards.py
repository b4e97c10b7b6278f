"""mixed_shards: decontaminated, held-out split per bucket, sampled by weight into packed sequences."""
import json
import time

import dagster as dg

from assets.tokenizer import META_FILE
from engine.decontam import DecontamConfig, clip_span
from engine.mix import build_mixture
from workflows.kiln import KilnResource, markdown_table, stage


def decontam_metadata(manifest: dict, cfg: DecontamConfig) -> dict[str, dg.MetadataValue]:
    """The decontamination report of a mixed_shards manifest as Dagster metadata: per eval set
    its items, matches and what happened to the matching documents, and the first
    `cfg.examples_shown` matching spans (cut to `cfg.shown_span_chars`)."""
    report = manifest.get("decontam") or {"enabled": False}
    if not report.get("enabled"):
        return {"decontamination": dg.MetadataValue.md("_off: no eval sets under `mix.decontam.eval_sets`_")}
    rows, examples = [], []
    for name, stats in sorted(report["eval_sets"].items()):
        rows.append({
            "eval_set": name,
            "items": stats["items"],
            "items_too_short": stats["items_too_short"],
            "items_matched": stats["items_matched"],
            "documents_matched": stats["documents_matched"],
            "documents_removed": stats.get("documents_removed", 0),
            "documents_flagged": stats.get("documents_flagged", 0),
        })
        for example in stats["examples"][:cfg.examples_shown]:
            examples.append({"eval_set": name, "item": example["item"], "doc_id": example["doc_id"],
                             "matching_ngrams": example["matching_ngrams"],
                             "span": clip_span(example["span"], cfg.shown_span_chars)})
    summary = (f"mode `{report['mode']}`, {report['ngram']}-grams: {report['documents_contaminated']} of "
               f"{report['documents_scanned']} documents matched, {report['documents_removed']} removed")
    return {
        "decontamination": dg.MetadataValue.md(summary + "\n\n" + markdown_table(rows)),
        "decontamination_examples": dg.MetadataValue.md(markdown_table(
            examples, ["eval_set", "item", "doc_id", "matching_ngrams", "span"])),
        "documents_contaminated": report["documents_contaminated"],
    }


@stage("mixed_shards", "mix", partitioned=False, deps=["tokenized", "tokenizer", "deduplicated"])
def mixed_shards(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    tokenized_in = kiln.inputs_all(context, "tokenized")
    dedup_in = kiln.inputs_all(context, "deduplicated")
    tok_in = kiln.input("tokenizer")
    meta = json.loads((tok_in.path / META_FILE).read_text())
    with kiln.staging(context) as out:
        manifest = build_mixture(
            [str(a.path) for a in tokenized_in],
            str(out),
            kiln.config.mix,
            vocab_size=meta["vocab_size"],
            eos_id=meta["special_ids"]["eos"],
            token_bytes_path=str(tok_in.path / "token_bytes.npy"),
            doc_texts=[str(a.path / "kept") for a in dedup_in],
        )
    for warning in manifest.get("warnings", []):
        context.log.warning(warning)
    buckets = [{"bucket": b, **v} for b, v in manifest["buckets"].items()]
    return kiln.publish(
        context,
        out,
        inputs={"tokenized": tokenized_in, "deduplicated": dedup_in, "tokenizer": tok_in},
        counts={"train_sequences": manifest["train"]["num_sequences"],
                **{f"val_sequences_{b}": v["num_sequences"] for b, v in manifest["validation"].items()}},
        metadata={"buckets": dg.MetadataValue.md(markdown_table(buckets)), "seq_len": manifest["seq_len"],
                  **decontam_metadata(manifest, kiln.config.mix.decontam)},
        started=started,
    )
