"""tokenizer: SentencePiece trained on a deterministic, bucket-balanced sample of deduplicated text."""
import time

import dagster as dg

from engine.tokenizer import HF_DIR, TRAINING_MANIFEST, select_sample, train_tokenizer
from workflows.kiln import KilnResource, markdown_table, stage, write_json

META_FILE = "tokenizer_meta.json"
# hf/ is derived from tokenizer.model by whatever transformers is installed; leaving it out of the
# content hash keeps the data version (and everything downstream) stable across library upgrades.
VERSION_FILES = ["tokenizer.model", "tokenizer.vocab", "token_bytes.npy", TRAINING_MANIFEST, META_FILE]


@stage("tokenizer", "tokenize", partitioned=False, deps=["deduplicated"])
def tokenizer(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.tokenizer
    dedup_in = kiln.inputs_all(context, "deduplicated")
    docs = kiln.spark().read.parquet(*[str(a.path / "kept") for a in dedup_in])
    if "language" not in docs.columns:
        context.log.warning("deduplicated/kept has no language column; fertility per language reports 'unknown'")
    texts_by_bucket, languages_by_bucket = select_sample(docs, kiln.config.buckets, cfg)
    with kiln.staging(context) as out:
        report = train_tokenizer(texts_by_bucket, str(out), cfg, languages_by_bucket=languages_by_bucket)
        write_json(out / META_FILE, {k: report[k] for k in ("vocab_size", "special_ids", "model_sha256")})
    hf = report["hf_export"]
    if hf["exported"]:
        context.log.info(f"wrote {HF_DIR}/ for AutoTokenizer.from_pretrained (transformers {hf['transformers_version']}, "
                         f"{hf['mismatches']} of {hf['checked_texts']} check texts encoded differently)")
    else:
        context.log.info(f"no {HF_DIR}/ export: {hf['reason']}")
    fertility = [{"bucket": b, **v} for b, v in report["buckets"].items()]
    by_language = [{"bucket": b, "language": lang, **v} for b, langs in report["languages"].items()
                   for lang, v in langs.items()]
    return kiln.publish(
        context,
        out,
        inputs={"deduplicated": dedup_in},
        counts={"vocab_size": report["vocab_size"], **{f"sample_docs_{b}": len(t) for b, t in texts_by_bucket.items()}},
        metadata={
            "fertility": dg.MetadataValue.md(markdown_table(fertility)),
            "fertility_by_language": dg.MetadataValue.md(markdown_table(
                by_language, ["bucket", "language", "documents", "chars", "tokens", "tokens_per_word", "bytes_per_token"])),
            "sample_docs_without_language": sum(1 for langs in languages_by_bucket.values() for x in langs if not x),
            "sample_sentences_sha256": report["sample"]["sentences_sha256"],
            "model_sha256": report["model_sha256"],
            "hf_export": dg.MetadataValue.json(hf),
        },
        started=started,
        version_files=VERSION_FILES,
    )
