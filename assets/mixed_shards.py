"""mixed_shards: decontaminated, held-out split per bucket, sampled by weight into packed sequences."""
import json
import time

import dagster as dg

from assets.tokenizer import META_FILE
from engine.mix import build_mixture
from workflows.kiln import KilnResource, markdown_table, stage


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
        metadata={"buckets": dg.MetadataValue.md(markdown_table(buckets)), "seq_len": manifest["seq_len"]},
        started=started,
    )
