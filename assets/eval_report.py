"""eval_report: held-out bits-per-byte and perplexity per bucket, trained model vs. step 0."""
import json
import math
import time

import dagster as dg
import mlflow

from training.evaluate import evaluate
from training.export import load_exported
from training.model import build_model
from workflows.kiln import KilnResource, markdown_table, stage, write_json

FINITE_CHECK = dg.AssetCheckSpec("metrics_finite", asset="eval_report", blocking=True,
                                 description="Every bucket has finite bits-per-byte and perplexity.")


@stage("eval_report", "evaluate", partitioned=False, deps=["checkpoints", "mixed_shards", "tokenizer"],
       check_specs=[FINITE_CHECK])
def eval_report(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.evaluation
    ckpt = kiln.input("checkpoints")
    mixed = kiln.input("mixed_shards")
    tok = kiln.input("tokenizer")
    training = json.loads((ckpt.path / "result.json").read_text())
    model, model_cfg = load_exported(ckpt.path / "export")
    trained = evaluate(model, mixed.path, max_sequences_per_bucket=cfg.max_sequences_per_bucket)
    # build_model with the training seed reproduces the exact weights training started from.
    initial = evaluate(build_model(model_cfg, kiln.config.training.seed), mixed.path,
                       max_sequences_per_bucket=cfg.max_sequences_per_bucket)
    rows = [
        {"bucket": b, "bits_per_byte": m["bits_per_byte"], "bpb_step0": initial[b]["bits_per_byte"],
         "perplexity": m["perplexity"], "ppl_step0": initial[b]["perplexity"], "tokens": m["tokens"]}
        for b, m in sorted(trained.items())
    ]
    report = "\n".join([
        "# Kiln evaluation report",
        "",
        "Held-out split of `mixed_shards` (documents never seen in training). Bits per byte comes",
        "first: unlike perplexity it compares across tokenizers.",
        "",
        markdown_table(rows),
        "",
        f"Training: loss {training['first_loss']:.4f} → {training['final_loss']:.4f} over {training['steps']} steps, "
        f"{training['tokens']:,} tokens. MLflow run `{training.get('mlflow_run_id')}`.",
        "",
        f"Inputs: checkpoints `{ckpt.data_version}`, mixed_shards `{mixed.data_version}`, tokenizer `{tok.data_version}`.",
    ])
    finite = all(math.isfinite(m[k]) for m in trained.values() for k in ("bits_per_byte", "perplexity"))
    with kiln.staging(context) as out:
        write_json(out / "metrics.json", {"trained": trained, "initial": initial})
        (out / "report.md").write_text(report + "\n")
    result = kiln.publish(
        context,
        out,
        inputs={"checkpoints": ckpt, "mixed_shards": mixed, "tokenizer": tok},
        counts={f"bits_per_byte_{r['bucket']}": r["bits_per_byte"] for r in rows}
        | {f"perplexity_{r['bucket']}": r["perplexity"] for r in rows},
        metadata={"report": dg.MetadataValue.md(report)},
        started=started,
        check_results=[dg.AssetCheckResult(check_name=FINITE_CHECK.name, passed=finite)],
    )
    if training.get("mlflow_run_id"):
        client = mlflow.MlflowClient(kiln.mlflow_tracking_uri())
        for r in rows:
            client.log_metric(training["mlflow_run_id"], f"eval_bits_per_byte_{r['bucket']}", r["bits_per_byte"])
            client.log_metric(training["mlflow_run_id"], f"eval_perplexity_{r['bucket']}", r["perplexity"])
    return result
