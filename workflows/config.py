"""The pipeline config: one checked-in YAML file, one typed schema.

Each stage owns one section. A stage's Dagster `code_version` includes the hash of its own
section and of the contents of the files it names (SECTION_FILE_FIELDS), so editing a filter
threshold or an eval set marks that stage changed and nothing upstream.
Engine sections (filters, dedup, tokenizer, mix) are defined beside the engine code they
configure and composed here.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Annotated, Callable, Iterable, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine.classifier import reference_files
from engine.dedup import DedupConfig
from engine.filters import FilterConfig
from engine.mix import MixConfig
from engine.paths import REPO_ROOT, resolve_path  # re-exported: config paths are relative to the repo root
from engine.tokenizer import TokenizerConfig
from training.settings import MODEL_PRESETS, SharedTrainingSettings, format_validation_errors, model_shape_errors

DEFAULT_CONFIG_PATH = REPO_ROOT / "workflows" / "pipeline.yaml"
# Bump a stage's entry when its code changes in a way that changes its output.
STAGE_CODE_VERSIONS = {
    "raw_crawl": "1",
    "documents": "2",  # 2: unique doc_ids (id-less records keyed by URL + payload), resync after a bad first member
    "quality_classifier": "1",
    "quality_signals": "3",  # 2: one output file per documents file, not per core; 3: c4_lines, FineWeb's C4 page signals
    "filtered": "2",  # 2: C4 line removal on the kept text, `detail` in the rejection table
    "deduplicated": "1",
    "tokenizer": "4",  # 2: manifest, hf/ export; 3: unigram hf/ export; 4: seeded sample, hf/ byte_fallback
    "tokenized": "3",  # 2: shard = blake2b(doc_id) % num_shards, keys-only sort; 3: a doc index beside each shard
    "mixed_shards": "2",  # 2: per-eval-set removed/flagged counts in the decontam report
    "checkpoints": "3",  # 2: HF tokenizer in the export, export_meta.json, spike guard; 3: step-loss spike test, no commit in export/
    "eval_report": "2",  # 2: lm_eval through its own hf model on the export
}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SampleSource(Section):
    kind: Literal["sample"] = "sample"
    seed: int = Field(0, description="Seed of the generated sample crawl.")
    pages: int = Field(300, ge=24, le=500, description="Number of pages in the sample crawl (the generator has distinct text for up to 500).")
    files: int = Field(2, ge=1, le=64, description="Number of WARC files the sample is split into.")


COMMON_CRAWL_ID = r"CC-MAIN-\d{4}-\d{2}"
SEED_SNAPSHOT = r"seed-\d{4}-\d{2}-\d{2}"


def _endpoint_url(value: str | None) -> str | None:
    """S3-compatible endpoints are plain http(s) URLs; credentials never go into the config."""
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; they come from the environment or the IAM role")
    return value


EndpointUrl = Annotated[str | None, AfterValidator(_endpoint_url)]


class WarcDirSource(Section):
    kind: Literal["warc_dir"] = "warc_dir"
    path: str = Field(
        min_length=1,
        description="Folder of .warc/.warc.gz/.wet/.wet.gz files: a local path (relative to the repo or absolute) "
        "or s3://bucket/prefix, read with boto3 (credentials from the environment or the IAM role).",
    )
    pattern: str = Field("*", min_length=1, description="Glob on file names; only .warc, .warc.gz, .wet and .wet.gz files are taken.")
    recursive: bool = Field(False, description="Also take files from subfolders (below the S3 prefix).")
    endpoint_url: EndpointUrl = Field(None, description="S3-compatible endpoint for s3:// paths; default: AWS (or AWS_ENDPOINT_URL_S3).")
    unsigned: bool = Field(False, description="Send unsigned S3 requests (public buckets) instead of using credentials.")
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 request (botocore standard retries) and per file download.")

    @field_validator("path")
    @classmethod
    def _s3_path_names_a_bucket(cls, value: str) -> str:
        if value.startswith("s3://") and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?", value):
            raise ValueError("must be s3://bucket/prefix with a valid bucket name")
        return value


class CommonCrawlSource(Section):
    kind: Literal["common_crawl"] = "common_crawl"
    crawl: str | None = Field(None, pattern=f"^{COMMON_CRAWL_ID}$", description="Crawl id, e.g. CC-MAIN-2024-22; default: the snapshot name.")
    file_type: Literal["warc", "wet"] = Field("warc", description="Listing to sample: warc.paths.gz (HTTP responses) or wet.paths.gz (extracted text).")
    files: int = Field(1, ge=1, le=100_000, description="Files taken from the listing: a seeded sample, the same for the same seed and listing.")
    seed: int = Field(0, description="Seed of the file sample.")
    bucket: str = Field("commoncrawl", min_length=3, max_length=63, description="Bucket holding crawl-data/<crawl>/.")
    endpoint_url: EndpointUrl = Field(None, description="S3-compatible endpoint; default: AWS (or AWS_ENDPOINT_URL_S3).")
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 request (botocore standard retries) and per file download.")


class SeedCrawlSource(Section):
    kind: Literal["seed_crawl"] = "seed_crawl"
    seeds: list[str] = Field(min_length=1, description="Start URLs (http or https); their hosts are in scope.")
    allowed_domains: list[str] = Field(
        default_factory=list, description="Further domains (with their subdomains) the crawl may enter besides the seed hosts."
    )
    max_depth: int = Field(2, ge=0, le=50, description="Links followed away from a seed (0: fetch the seeds only).")
    max_pages: int = Field(100, ge=1, le=1_000_000, description="HTTP fetches at most, redirects included, robots.txt not.")
    max_bytes_per_page: int = Field(
        2_000_000, ge=1024, le=1_000_000_000,
        description="Responses announcing more (Content-Length) are not downloaded; longer streamed bodies are cut off and dropped.",
    )
    delay_seconds: float = Field(1.0, ge=0, le=600, description="Pause between requests to one host (a longer robots.txt Crawl-delay wins).")
    timeout_seconds: float = Field(10.0, gt=0, le=300, description="Connect and read timeout of each request.")
    page_timeout_seconds: float = Field(60.0, gt=0, le=3600, description="Wall-clock limit for downloading one page, its redirect hops included.")
    max_redirects: int = Field(5, ge=0, le=20, description="Redirects followed per URL; loops are detected and dropped.")
    user_agent: str = Field(
        "KilnBot/0.1 (+https://github.com/kiln-pipeline/kiln)", min_length=1, max_length=256,
        description="User-Agent header; its product token (before '/') selects the robots.txt group.",
    )
    allow_private_networks: bool = Field(
        False, description="Allow private, loopback and link-local addresses (tests and intranet crawls only)."
    )
    ca_bundle: str | None = Field(
        None, description="PEM file of CAs to trust for https (intranet crawls); default: the certifi bundle."
    )

    @field_validator("seeds")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"seed {url!r} is not an http(s) URL")
        return value

    @field_validator("user_agent")
    @classmethod
    def _printable_header(cls, value: str) -> str:
        if not re.fullmatch(r"[\x20-\x7e]+", value):
            raise ValueError("must be printable ASCII on one line")
        return value


class RefreshConfig(Section):
    cron: str = Field("0 6 * * *", description="When the snapshot_refresh schedule looks for new snapshots (cron, UTC).")
    common_crawl: CommonCrawlSource | None = Field(
        None, description="Source for newly published Common Crawl crawls (leave `crawl` empty); null: do not look for them."
    )
    common_crawl_since: str = Field(
        "CC-MAIN-2024-22", pattern=f"^{COMMON_CRAWL_ID}$", description="Crawls older than this id are never added."
    )
    seed_crawl: SeedCrawlSource | None = Field(
        None, description="Seed crawl started on every tick as snapshot seed-YYYY-MM-DD; null: no scheduled seed crawls."
    )

    @field_validator("cron")
    @classmethod
    def _five_cron_fields(cls, value: str) -> str:
        fields = value.split()
        if len(fields) != 5 or not all(re.fullmatch(r"[0-9A-Za-z*/,\-]+", f) for f in fields):
            raise ValueError("must be a cron expression of five fields, e.g. '0 6 * * *'")
        return value

    @model_validator(mode="after")
    def _template_has_no_crawl_id(self) -> "RefreshConfig":
        if self.common_crawl is not None and self.common_crawl.crawl is not None:
            raise ValueError("common_crawl.crawl must be empty: the discovered crawl id fills it")
        return self


# `kind` picks the model, so an invalid source is reported against its own fields only.
CrawlSource = Annotated[SampleSource | WarcDirSource | CommonCrawlSource | SeedCrawlSource, Field(discriminator="kind")]


class RawCrawlConfig(Section):
    snapshots: dict[str, CrawlSource] = Field(
        default_factory=lambda: {"sample": SampleSource()},
        description="Crawl snapshots (partitions of the per-snapshot assets) and where each comes from.",
    )
    refresh: RefreshConfig = Field(
        default_factory=RefreshConfig, description="What the snapshot_refresh schedule discovers and when."
    )

    @model_validator(mode="after")
    def _common_crawl_snapshots_name_a_crawl(self) -> "RawCrawlConfig":
        for name, source in self.snapshots.items():
            if isinstance(source, CommonCrawlSource) and source.crawl is None and not re.fullmatch(COMMON_CRAWL_ID, name):
                raise ValueError(f"snapshots.{name}: set `crawl` (e.g. CC-MAIN-2024-22) or name the snapshot after the crawl")
        return self


class DocumentsConfig(Section):
    extractor: Literal["kiln", "resiliparse", "trafilatura"] = Field(
        "kiln",
        description="Main-content extractor: kiln (resiliparse plus boilerplate rules, trafilatura on pages it is "
        "unsure about; engine/boilerplate.py), or one library alone.",
    )
    domain_buckets: dict[str, str] = Field(
        default_factory=lambda: {"docs.reference.test": "reference"},
        description="Domain (or domain suffix) to mixture bucket; everything else goes to `default_bucket`.",
    )
    default_bucket: str = Field("web", description="Bucket of documents no domain rule matches.")
    max_bytes: int = Field(10_000_000, ge=1, description="HTTP payloads larger than this are skipped as too_large.")


class ClassifierConfig(Section):
    positive_buckets: list[str] = Field(
        default_factory=lambda: ["reference"],
        description="Buckets whose crawled documents are reference-quality text ([] with reference_paths: "
        "the external corpus alone).",
    )
    reference_paths: list[str] = Field(
        default_factory=list,
        description="External reference corpus, used with the positive_buckets' documents: text or JSONL files, or "
        "folders searched recursively for reference_patterns (relative to the repo or absolute).",
    )
    reference_field: str = Field("text", min_length=1, description="Field holding the text in JSONL reference files.")
    reference_patterns: list[str] = Field(
        default_factory=lambda: ["*.txt", "*.jsonl", "*.txt.gz", "*.jsonl.gz"], min_length=1,
        description="File-name patterns taken from reference folders; .jsonl(.gz) is one document per line, "
        "anything else plain text.",
    )
    reference_exclude: list[str] = Field(
        default_factory=lambda: ["SOURCE*", "README*", "LICENSE*"],
        description="File-name patterns skipped in reference folders (provenance notes, not reference text).",
    )
    reference_passage_chars: int = Field(
        2000, ge=200, le=100_000,
        description="Plain-text reference files are cut at paragraph breaks into passages of about this many "
        "characters, near a web page's length: a book becomes many training examples.",
    )
    max_docs_per_class: int = Field(5000, ge=10, description="Cap on training documents per class.")
    epoch: int = Field(20, ge=1, le=500, description="fastText training epochs.")
    holdout: float = Field(0.2, gt=0, lt=1, description="Fraction of documents held out to report accuracy.")
    seed: int = 0

    @model_validator(mode="after")
    def _has_positives(self) -> "ClassifierConfig":
        if not self.positive_buckets and not self.reference_paths:
            raise ValueError("positive_buckets and reference_paths are both empty: the classifier has no reference text")
        return self


class SignalsConfig(Section):
    lid_model_path: str | None = Field(
        None, description="fastText language-ID model; default: lid.176.ftz fetched offline into the state folder."
    )
    badword_paths: list[str] = Field(default_factory=list, description="Word lists (one word per line) for bad-word counts.")
    url_blocklist: list[str] = Field(default_factory=list, description="Blocked domains or URL prefixes.")
    num_perm: int = Field(112, ge=16, le=1024, description="MinHash permutations (bands x rows of dedup must fit).")
    ngram: int = Field(5, ge=1, le=32, description="Word n-gram size of MinHash shingles.")
    minhash_seed: int = 1


class TokenizedConfig(Section):
    num_shards: int = Field(2, ge=1, le=4096, description="Token shards written per snapshot.")


class TrainingModelConfig(Section):
    """Overrides of the preset's shape; null keeps the preset's value (vocabulary and context length
    come from the mixed_shards data, BOS from the tokenizer)."""

    dim: int | None = Field(None, ge=8, description="Model width.")
    n_layers: int | None = Field(None, ge=1, description="Decoder blocks.")
    n_heads: int | None = Field(None, ge=1, description="Attention (query) heads; dim must be a multiple.")
    n_kv_heads: int | None = Field(None, ge=1, description="Key/value heads (GQA); must divide n_heads.")
    hidden_dim: int | None = Field(None, ge=1, description="SwiGLU width.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool | None = Field(None, description="Share the input embedding and the output head.")
    init_std: float | None = Field(None, gt=0, description="Standard deviation of the initial weights.")


class TrainingConfig(Section, SharedTrainingSettings):
    """The pipeline's training run: the settings run.json shares (training/settings.py) plus the
    demo-sized defaults and the launcher's settings below."""

    preset: Literal[tuple(MODEL_PRESETS)] = Field("tiny", description="Model size preset.")
    model: TrainingModelConfig = Field(default_factory=TrainingModelConfig,
                                       description="Overrides of the preset (e.g. n_kv_heads for GQA, tie_embeddings).")
    steps: int = Field(150, ge=1, description="Optimizer steps.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per rank per micro step.")
    grad_accum: int = Field(1, ge=1, description="Micro steps per optimizer step.")
    lr: float = Field(3e-3, gt=0, le=1, description="Peak learning rate.")
    warmup_steps: int = Field(15, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (matrices only).")
    checkpoint_every: int = Field(50, ge=1, description="Checkpoint cadence in steps (the final step is saved too).")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between MLflow system metric samples.")
    num_gpus: int | None = Field(
        None, ge=1, description="Ranks per node; null: every visible GPU (CUDA_VISIBLE_DEVICES honoured), 2 CPU "
                                "processes without a GPU, or each hostfile host's slots.")
    num_nodes: int = Field(1, ge=1, description="Nodes (more than 1 needs hostfile).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs.")
    seed: int = Field(0, description="Seed of the initial weights and of the data order.")
    dry_run: bool = Field(False, description="Log the exact launcher command and materialize nothing.")

    @model_validator(mode="after")
    def _model_shape_fits_preset(self) -> "TrainingConfig":
        """The overrides over the chosen preset must build a model: fail at config load, naming the
        overridden field, not later when the ranks start."""
        overrides = self.model.model_dump(exclude_none=True)
        errors = model_shape_errors({**MODEL_PRESETS[self.preset], **overrides})
        if not errors:
            return self
        details = []
        for fields, message in errors:
            # A preset's own shape is valid, so one of the fields involved was overridden.
            field = next(f for f in fields if f in overrides)
            details.append(InitErrorDetails(
                type=PydanticCustomError("model_shape", "{message} (preset {preset})",
                                         {"message": message, "preset": self.preset}),
                loc=("model", field), input=overrides[field]))
        raise ValidationError.from_exception_data(type(self).__name__, details)


class EvaluationConfig(Section):
    max_sequences_per_bucket: int = Field(64, ge=1, description="Held-out sequences evaluated per bucket.")
    cloze_items_per_bucket: int = Field(
        64, ge=0, description="LAMBADA-style last-word items per bucket, built from held-out documents (0: none).")
    cloze_min_context_words: int = Field(20, ge=1, description="Words a cloze passage has before its target word.")
    prompts: list[str] = Field(
        default_factory=lambda: ["The best way to learn a new skill is", "In the garden this spring,",
                                 "To fix a flat tyre, first"],
        description="Fixed prompts, decoded greedily and with one seeded sample each through the HF export.")
    sample_max_new_tokens: int = Field(48, ge=1, le=4096, description="Tokens generated per sample at most.")
    sample_temperature: float = Field(0.8, gt=0, le=10, description="Temperature of the sampled decoding.")
    sample_top_k: int = Field(40, ge=0, description="Top-k of the sampled decoding (0: the whole vocabulary).")
    seed: int = Field(0, ge=0, description="Seed of the cloze item choice and of the sampled decodings.")
    max_contamination_rate: float = Field(
        0.01, ge=0, le=1,
        description="Blocking check: the share of an eval set's items (mix.decontam) that may overlap documents "
                    "left in the training data.")
    lm_eval_task_dir: str | None = Field(
        None, description="Folder of lm-evaluation-harness task YAMLs and their local data (relative to the repo or "
                          "absolute); null skips the step, as does an environment without lm_eval ([eval] extra).")
    lm_eval_tasks: list[str] = Field(default_factory=list, description="Task (or tag/group) names to run from it.")
    lm_eval_limit: int | None = Field(None, ge=1, description="Documents per lm_eval task at most (null: all).")
    lm_eval_device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Device of lm_eval's hf model: auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N.")
    lm_eval_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype in lm_eval: auto is bfloat16 on a GPU that supports it, else float32.")
    lm_eval_batch_size: int = Field(
        1, ge=1, description="lm_eval batch size; 1 scores every request unpadded (raise it on a GPU for speed).")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(None, description="Default: sqlite store in the state folder.")
    experiment: str = "kiln"
    dagster_ui_url: EndpointUrl = Field(
        "http://127.0.0.1:3000",
        description="Dagster UI that training runs link back to (MLflow tag dagster_run_url); default: `make ui`.",
    )


class SparkConfig(Section):
    master: str = Field("local[2]", description="spark.master: local[N], spark://host:7077, yarn, k8s://...")
    conf: dict[str, str] = Field(default_factory=dict, description="Extra Spark settings.")


S3_ROOT = r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?"


class StorageConfig(Section):
    root: str | None = Field(
        None,
        description="Storage root: a local or mounted folder or "
        "s3://bucket/prefix, written through boto3 (credentials from the environment or the IAM role); "
        "default: <state>/storage.",
    )
    endpoint_url: EndpointUrl = Field(None, description="S3-compatible endpoint for an s3:// root; default: AWS (or AWS_ENDPOINT_URL_S3).")
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 request for an s3:// root (botocore standard-mode retries).")
    upload_concurrency: int = Field(4, ge=1, le=64, description="Parallel uploads (and multipart parts) when publishing to an s3:// root.")
    local_dir: str | None = Field(
        None,
        description="For an s3:// root: local folder for staging, resumable work folders and the read cache of "
        "published artifacts (keyed by data version); default: <state>/s3.",
    )

    @field_validator("root")
    @classmethod
    def _root_is_s3_or_a_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must be s3://bucket/prefix or a local path, not empty")
        if value.startswith("s3://"):
            if "@" in value.split("/")[2]:
                raise ValueError("must not carry credentials; they come from the environment or the IAM role")
            if not re.fullmatch(S3_ROOT, value):
                raise ValueError("must be s3://bucket/prefix with a valid bucket name (3-63 lowercase letters, digits, dots, hyphens)")
        elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", value):
            raise ValueError(f"unsupported scheme {value.split('://')[0]!r}: use s3://bucket/prefix or a local path "
                             "(for s3a:// or other file systems, mount them or use s3://)")
        return value


class PipelineConfig(Section):
    raw_crawl: RawCrawlConfig = RawCrawlConfig()
    documents: DocumentsConfig = DocumentsConfig()
    quality_classifier: ClassifierConfig = ClassifierConfig()
    quality_signals: SignalsConfig = SignalsConfig()
    filters: FilterConfig = FilterConfig()
    dedup: DedupConfig = DedupConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    tokenized: TokenizedConfig = TokenizedConfig()
    mix: MixConfig = MixConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    mlflow: MlflowConfig = MlflowConfig()
    spark: SparkConfig = SparkConfig()
    storage: StorageConfig = StorageConfig()

    @property
    def buckets(self) -> list[str]:
        return sorted({*self.documents.domain_buckets.values(), self.documents.default_bucket})

    @model_validator(mode="after")
    def _cross_section_checks(self) -> "PipelineConfig":
        known = self.buckets
        for name in self.mix.bucket_weights:
            if name not in known:
                raise ValueError(
                    f"mix.bucket_weights: unknown bucket {name!r}; buckets come from documents.domain_buckets "
                    f"and documents.default_bucket: {', '.join(known)}"
                )
        for name in self.quality_classifier.positive_buckets:
            if name not in known:
                raise ValueError(f"quality_classifier.positive_buckets: unknown bucket {name!r}; known: {', '.join(known)}")
        if self.dedup.num_perm != self.quality_signals.num_perm:
            raise ValueError(
                f"dedup.num_perm ({self.dedup.num_perm}) must equal quality_signals.num_perm "
                f"({self.quality_signals.num_perm}): dedup reads the stored signatures"
            )
        if self.dedup.bands * self.dedup.rows > self.quality_signals.num_perm:
            raise ValueError(
                f"dedup.bands * dedup.rows = {self.dedup.bands * self.dedup.rows} exceeds "
                f"quality_signals.num_perm = {self.quality_signals.num_perm}"
            )
        return self


# Which config sections feed each stage's code_version.
STAGE_SECTIONS = {
    # A snapshot's source is data, not code: adding a snapshot or changing the refresh cron must
    # not mark every existing partition changed. The WARC bytes decide raw_crawl's data version.
    "raw_crawl": [],
    "documents": ["documents"],
    "quality_classifier": ["quality_classifier"],
    "quality_signals": ["quality_signals"],
    "filtered": ["filters"],
    "deduplicated": ["dedup"],
    "tokenizer": ["tokenizer"],
    "tokenized": ["tokenized"],
    "mixed_shards": ["mix"],
    "checkpoints": ["training"],
    "eval_report": ["evaluation"],
}

# Config fields that name files (or folders) whose contents shape a stage's output, per section, as
# dotted paths into the section; a list is walked item by item (every eval set's `path`). Their
# sha256 goes into the stage's code_version beside the section text, so editing an eval set or a
# word list marks that stage changed, and a missing file fails at config load with its field named.
# (training.hostfile is left out on purpose: which hosts run a job is deployment, not data.)
SECTION_FILE_FIELDS = {
    "quality_classifier": ["reference_paths"],
    "quality_signals": ["lid_model_path", "badword_paths"],
    "mix": ["decontam.eval_sets.path"],
    "evaluation": ["lm_eval_task_dir"],
}


def _classifier_reference_files(section: ClassifierConfig, path: Path) -> list[Path]:
    return reference_files([path], section.reference_patterns, section.reference_exclude)


# Fields whose folders the stage reads only in part, with the stage's own listing of the files it
# reads: those are hashed, so a README beside a reference corpus is not part of the code_version
# (nor rehashed). Folders of other fields are hashed whole (content_sha256).
SECTION_FILE_LISTERS = {
    ("quality_classifier", "reference_paths"): _classifier_reference_files,
}


class ConfigError(ValueError):
    """An invalid pipeline config; the message names each bad field and what is allowed."""


def _missing_file(field: str, value: str) -> str:
    return f"{field}: {value!r} does not exist (relative paths are relative to {REPO_ROOT})"


def parse_config(data: dict, source: Path | str = "<dict>") -> PipelineConfig:
    try:
        config = PipelineConfig.model_validate(data or {})
    except ValidationError as error:
        raise ConfigError(format_validation_errors(f"Invalid pipeline config {Path(source)}:", error)) from None
    missing = [f"  - {_missing_file(field, value)}"
               for field, value, path, _ in config_files(config, list(SECTION_FILE_FIELDS)) if not path.exists()]
    if missing:
        raise ConfigError("\n".join([f"Invalid pipeline config {Path(source)}:", *missing]))
    return config


def config_path() -> Path:
    return Path(os.environ.get("KILN_CONFIG", DEFAULT_CONFIG_PATH)).resolve()


def load_config(path: str | Path | None = None) -> PipelineConfig:
    path = Path(path) if path else config_path()
    if not path.exists():
        raise ConfigError(f"Pipeline config {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"Pipeline config {path} is not valid YAML: {error}") from None
    return parse_config(data, path)


def _field_values(data, parts: list[str], label: str):
    if isinstance(data, list):
        for i, item in enumerate(data):
            yield from _field_values(item, parts, f"{label}.{i}")
    elif not parts:
        if data is not None:
            yield label, data
    elif isinstance(data, dict) and parts[0] in data:
        yield from _field_values(data[parts[0]], parts[1:], f"{label}.{parts[0]}")
    elif data is not None:  # a typo here would silently hash nothing
        raise KeyError(f"SECTION_FILE_FIELDS: {label} has no field {parts[0]!r}")


def config_files(config: PipelineConfig, sections: list[str]) -> list[tuple[str, str, Path, Callable | None]]:
    """(field, configured value, resolved path, path -> the files a stage reads under it, or None:
    all) of every file named in `sections`."""
    out = []
    for section in sections:
        dumped = getattr(config, section).model_dump(mode="json")
        for spec in SECTION_FILE_FIELDS.get(section, []):
            lister = SECTION_FILE_LISTERS.get((section, spec))
            lister = lister and partial(lister, getattr(config, section))
            for field, value in _field_values(dumped, spec.split("."), section):
                out.append((field, value, resolve_path(value), lister))
    return out


_FILE_SHA256: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)  # code_version runs at every load: hash once
    if key not in _FILE_SHA256:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _FILE_SHA256[key] = digest.hexdigest()
    return _FILE_SHA256[key]


def content_sha256(path: Path, files: Iterable[Path] | None = None) -> str:
    """sha256 of a file, or of a folder's files (relative path and content): `files` (those under
    `path` a stage reads) when given, else all but hidden ones."""
    if not path.is_dir():
        return _file_sha256(path)
    if files is None:
        files = [file for file in sorted(path.rglob("*")) if file.is_file() and not any(
            part.startswith(".") or part == "__pycache__" for part in file.relative_to(path).parts)]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path).as_posix()}\x00{_file_sha256(file)}\n".encode())
    return digest.hexdigest()


def section_hash(config: PipelineConfig, stage: str) -> str:
    sections = {name: getattr(config, name).model_dump(mode="json") for name in STAGE_SECTIONS[stage]}
    files = {}
    for field, value, path, lister in config_files(config, STAGE_SECTIONS[stage]):
        if not path.exists():
            raise ConfigError(_missing_file(field, value))
        try:
            read = lister(path) if lister and path.is_dir() else None
        except ValueError as error:  # e.g. a reference folder with no file the patterns take
            raise ConfigError(f"{field}: {error}") from None
        files[field] = content_sha256(path, read)
    if files:  # only then, so stages that name no files keep their code_version
        sections["_file_sha256"] = files
    return hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:12]


def code_version(config: PipelineConfig, stage: str) -> str:
    return f"v{STAGE_CODE_VERSIONS[stage]}-{section_hash(config, stage)}"


def state_dir() -> Path:
    """Git-ignored folder holding the Dagster home, the MLflow store and the default storage root."""
    return Path(os.environ.get("KILN_STATE_DIR", REPO_ROOT / ".kiln")).resolve()
