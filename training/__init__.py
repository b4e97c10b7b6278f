"""Kiln training: model, shard reader, DeepSpeed ZeRO-3 entry point, export and evaluation.

Runs standalone under the `deepspeed` launcher and never imports Dagster. Importing this package
imports nothing heavy; DeepSpeed is imported only inside the training process and export.
"""
