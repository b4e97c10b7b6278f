"""tokenizer: SentencePiece trained on a deterministic, bucket-balanced sample of deduplicated text."""
import time

import dagster as dg
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from engine.tokenizer import HF_DIR, TRAINING_MANIFEST, TokenizerConfig, train_tokenizer
from workflows.kiln import KilnResource, markdown_table, stage, write_json

META_FILE = "tokenizer_meta.json"
# hf/ is derived from tokenizer.model by whatever transformers is installed; leaving it out of the
# content hash keeps the data version (and everything downstream) stable across library upgrades.
VERSION_FILES = ["tokenizer.model", "tokenizer.vocab", "token_bytes.npy", TRAINING_MANIFEST, META_FILE]


def select_sample(docs: DataFrame, buckets: list[str], cfg: TokenizerConfig) -> tuple[dict, dict]:
    """(texts, languages) per bucket: documents in a seeded hash order until the bucket's
    character budget is met, the same budget for every bucket (small buckets give all they have).

    The order is xxhash64 of (seed, doc_id): a deterministic random sample, independent of
    partitioning, that a different `tokenizer.seed` reshuffles. Rows are streamed to the driver
    until the budget is met instead of collecting the whole bucket. train_tokenizer then orders
    and cuts this pre-selection with the same seed.
    """
    # deduplicated/kept carries quality_signals' `language` (filters keep it for dedup), so the
    # per-language fertility needs no join; older artifacts without it report "unknown".
    language = F.col("language") if "language" in docs.columns else F.lit(None).cast("string")
    order = F.xxhash64(F.lit(cfg.seed).cast("long"), F.col("doc_id"))
    texts_by_bucket: dict[str, list[str]] = {}
    languages_by_bucket: dict[str, list[str | None]] = {}
    for bucket in buckets:
        rows = (docs.where(F.col("bucket") == bucket).orderBy(order, "doc_id")
                .select("text", language.alias("language")))
        texts, languages, chars = [], [], 0
        for row in rows.toLocalIterator():
            texts.append(row["text"])
            languages.append(row["language"])
            chars += len(row["text"] or "")
            if chars >= cfg.sample_chars_per_bucket:
                break
        texts_by_bucket[bucket] = texts
        languages_by_bucket[bucket] = languages
    return texts_by_bucket, languages_by_bucket


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
