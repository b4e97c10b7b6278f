"""The Dagster code location: `dagster dev -m workflows.definitions`."""
import dagster as dg

from assets.checkpoints import checkpoints
from assets.deduplicated import deduplicated
from assets.documents import documents
from assets.eval_report import eval_report
from assets.filtered import filtered
from assets.mixed_shards import mixed_shards
from assets.quality_classifier import quality_classifier
from assets.quality_signals import quality_signals
from assets.raw_crawl import raw_crawl
from assets.tokenized import tokenized
from assets.tokenizer import tokenizer
from jobs import JOBS, SCHEDULES, SENSORS
from workflows.kiln import KilnResource

# In pipeline order; the demo and the tests walk this list.
ALL_ASSETS = [
    raw_crawl,
    documents,
    quality_classifier,
    quality_signals,
    filtered,
    deduplicated,
    tokenizer,
    tokenized,
    mixed_shards,
    checkpoints,
    eval_report,
]

defs = dg.Definitions(
    assets=ALL_ASSETS,
    jobs=JOBS,
    sensors=SENSORS,
    schedules=SCHEDULES,
    resources={"kiln": KilnResource()},
    # One process per run: Spark starts once and is reused by every step, which matters on small machines.
    executor=dg.in_process_executor,
)
