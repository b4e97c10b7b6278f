"""Engine code under the assets: plain functions of DataFrames, arrays and files.

Nothing here imports Dagster, so every stage is testable on its own.
"""
