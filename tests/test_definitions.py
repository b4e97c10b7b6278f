"""The graph: exactly the eleven assets of DESIGN.md, in their groups, with their dependencies."""
import dagster as dg

EXPECTED = {
    "raw_crawl": ("ingest", True, set()),
    "documents": ("ingest", True, {"raw_crawl"}),
    "quality_classifier": ("curate", False, {"documents"}),
    "quality_signals": ("curate", True, {"documents", "quality_classifier"}),
    "filtered": ("curate", True, {"documents", "quality_signals"}),
    "deduplicated": ("curate", True, {"filtered", "quality_signals"}),
    "tokenizer": ("tokenize", False, {"deduplicated"}),
    "tokenized": ("tokenize", True, {"deduplicated", "tokenizer"}),
    "mixed_shards": ("mix", False, {"tokenized", "tokenizer", "deduplicated"}),
    "checkpoints": ("train", False, {"mixed_shards", "tokenizer"}),
    "eval_report": ("evaluate", False, {"checkpoints", "mixed_shards", "tokenizer"}),
}


def test_definitions_load_with_exactly_the_designed_graph():
    from workflows.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert keys == set(EXPECTED)
    for name, (group, partitioned, deps) in EXPECTED.items():
        node = graph.get(dg.AssetKey(name))
        assert node.group_name == group, name
        assert node.is_partitioned == partitioned, name
        assert {k.to_user_string() for k in node.parent_keys} == deps, name


def test_code_version_follows_only_its_own_config_section():
    from workflows.config import code_version, load_config

    config = load_config()
    changed = config.model_copy(update={"filters": config.filters.model_copy(update={"min_words": 51})})
    differs = {stage for stage in EXPECTED if code_version(config, stage) != code_version(changed, stage)}
    assert differs == {"filtered"}


def test_filtered_has_a_blocking_keep_rate_check():
    from workflows.definitions import defs

    specs = list(defs.resolve_asset_graph().get(dg.AssetKey("filtered")).assets_def.check_specs)
    assert [(s.name, s.blocking) for s in specs] == [("keep_rate_in_band", True)]
