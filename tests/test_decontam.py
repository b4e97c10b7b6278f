import gzip
import json

import pytest
from pydantic import ValidationError

from engine.decontam import (
    GSM8K_FIELDS, HUMANEVAL_FIELDS, DecontamConfig, EvalSetConfig, decontaminate, ngram_hashes, normalize_words,
)

FILLER = "The quality of mercy is not strained; it droppeth as the gentle rain from heaven upon the place beneath. "


@pytest.fixture(scope="module")
def eval_sets(shared_data):
    root = shared_data / "decontam"
    return [
        EvalSetConfig(name="gsm8k", path=str(root / "gsm8k_test" / "grade_school_math_data_test.jsonl"), fields=GSM8K_FIELDS),
        EvalSetConfig(name="humaneval", path=str(root / "humaneval" / "data_HumanEval.jsonl.gz"),
                      fields=HUMANEVAL_FIELDS, id_field="task_id"),
    ]


@pytest.fixture(scope="module")
def gsm8k_items(eval_sets):
    with open(eval_sets[0].path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def humaneval_items(eval_sets):
    with gzip.open(eval_sets[1].path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_normalisation_lowercases_and_drops_punctuation():
    assert normalize_words("Janet’s ducks lay 16 eggs... $2 per_egg!") == ["janet", "s", "ducks", "lay", "16", "eggs", "2", "per", "egg"]


def test_ngram_hashes_are_positional_and_stable():
    words = "a b c d e f".split()
    grams = ngram_hashes(words, 3)
    assert len(grams) == 4 and len(set(grams.tolist())) == 4
    assert (ngram_hashes(words[1:4], 3) == grams[1:2]).all()
    assert len(ngram_hashes(words[:2], 3)) == 0


def test_planted_gsm8k_question_is_caught(eval_sets, gsm8k_items):
    question = gsm8k_items[42]["question"]
    # change case and punctuation: the match is on normalised words
    planted = FILLER * 3 + "\n" + question.upper().replace(",", " ,") + "\n" + FILLER
    docs = [("clean", FILLER * 10), ("planted", planted)]
    drop, report = decontaminate(docs, DecontamConfig(eval_sets=eval_sets))
    assert drop == {"planted"}
    gsm = report["eval_sets"]["gsm8k"]
    assert gsm["items"] == 1319 and gsm["documents_matched"] == 1 and gsm["items_matched"] == 1
    example = gsm["examples"][0]
    assert example["doc_id"] == "planted" and example["item"] == "42"
    assert normalize_words(question)[:13] == normalize_words(example["span"])[:13]
    assert report["eval_sets"]["humaneval"]["documents_matched"] == 0
    assert report["documents_scanned"] == 2 and report["contaminated_doc_ids"] == ["planted"]


def test_planted_humaneval_prompt_is_caught_and_reported_by_task_id(eval_sets, humaneval_items):
    item = humaneval_items[10]
    docs = [("code", "# utilities\n" + item["prompt"] + item["canonical_solution"])]
    drop, report = decontaminate(docs, DecontamConfig(eval_sets=eval_sets))
    assert drop == {"code"}
    assert report["eval_sets"]["humaneval"]["examples"][0]["item"] == item["task_id"]


def test_flag_mode_reports_but_drops_nothing(eval_sets, gsm8k_items):
    docs = [("planted", FILLER + gsm8k_items[0]["question"])]
    drop, report = decontaminate(docs, DecontamConfig(eval_sets=eval_sets, mode="flag"))
    assert drop == set()
    assert report["documents_contaminated"] == 1 and report["documents_removed"] == 0


def test_short_overlap_below_ngram_is_not_a_match(eval_sets, gsm8k_items):
    words = gsm8k_items[5]["question"].split()
    docs = [("partial", FILLER + " ".join(words[:12]) + " " + FILLER)]
    drop, _ = decontaminate(docs, DecontamConfig(eval_sets=eval_sets[:1], ngram=13))
    assert drop == set()
    drop, _ = decontaminate(docs, DecontamConfig(eval_sets=eval_sets[:1], ngram=8))
    assert drop == {"partial"}


def test_short_eval_items_are_counted(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"q": "too short"}) + "\n" + json.dumps({"q": " ".join(["word"] * 20)}) + "\n")
    _, report = decontaminate([("d", "nothing here")], DecontamConfig(eval_sets=[EvalSetConfig(name="t", path=str(path), fields=["q"])]))
    assert report["eval_sets"]["t"]["items"] == 2 and report["eval_sets"]["t"]["items_too_short"] == 1


def test_disabled_without_eval_sets():
    assert decontaminate([("a", "text")], DecontamConfig()) == (set(), {"enabled": False})


@pytest.mark.parametrize("bad", [
    dict(ngram=2),
    dict(mode="delete"),
    dict(eval_sets=[dict(name="a", path="x.json", fields=["q"])]),
    dict(eval_sets=[dict(name="a", path="x.jsonl", fields=[])]),
    dict(eval_sets=[dict(name="a", path="x.jsonl", fields=["q"]), dict(name="a", path="y.jsonl", fields=["q"])]),
])
def test_config_rejects_invalid_values(bad):
    with pytest.raises(ValidationError):
        DecontamConfig(**bad)


# --- eval-set paths in the pipeline config -------------------------------------------------------

def _pipeline_with_eval_set(path: str) -> dict:
    import yaml

    from workflows.config import DEFAULT_CONFIG_PATH

    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["mix"]["decontam"]["eval_sets"] = [{"name": "gsm8k", "path": path, "fields": GSM8K_FIELDS}]
    return data


def test_relative_eval_set_path_is_relative_to_the_repo_root_not_the_cwd(eval_sets, gsm8k_items, tmp_path, monkeypatch):
    import os

    from workflows.config import REPO_ROOT, parse_config, resolve_path

    relative = os.path.relpath(eval_sets[0].path, REPO_ROOT)  # ../shared/data/... in this checkout
    monkeypatch.chdir(tmp_path)
    config = parse_config(_pipeline_with_eval_set(relative))
    eval_set = config.mix.decontam.eval_sets[0]
    assert eval_set.path == relative  # the config stays as written (it is hashed into code_version)
    assert os.path.samefile(resolve_path(eval_set.path), eval_sets[0].path)
    docs = [("planted", FILLER + gsm8k_items[3]["question"])]
    assert decontaminate(docs, config.mix.decontam)[0] == {"planted"}  # from tmp_path, not the repo
    assert decontaminate(docs, config.mix.decontam, base_dir=REPO_ROOT)[0] == {"planted"}
    with pytest.raises(FileNotFoundError):  # another base is honoured, not the repo root
        decontaminate(docs, config.mix.decontam, base_dir=tmp_path)


def test_missing_eval_set_fails_at_config_load_naming_the_field():
    from workflows.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"mix\.decontam\.eval_sets\.0\.path: 'no/such/gsm8k\.jsonl' does not exist"):
        parse_config(_pipeline_with_eval_set("no/such/gsm8k.jsonl"), "pipeline.yaml")


def test_editing_an_eval_file_changes_only_mixed_shards_code_version(eval_sets, tmp_path):
    import os
    import shutil

    from workflows.config import STAGE_SECTIONS, code_version, parse_config

    eval_file = tmp_path / "gsm8k.jsonl"
    shutil.copyfile(eval_sets[0].path, eval_file)
    config = parse_config(_pipeline_with_eval_set(str(eval_file)))
    before = {stage: code_version(config, stage) for stage in STAGE_SECTIONS}
    os.utime(eval_file, ns=(1, 1))  # a new mtime with the same bytes is not a change
    assert {stage: code_version(config, stage) for stage in STAGE_SECTIONS} == before
    with open(eval_file, "a", encoding="utf-8") as f:
        f.write(json.dumps({"question": "How many ducks does Janet keep if she sells none?", "answer": "16"}) + "\n")
    after = {stage: code_version(config, stage) for stage in STAGE_SECTIONS}
    assert {stage for stage in STAGE_SECTIONS if before[stage] != after[stage]} == {"mixed_shards"}
    # Same size, new bytes: the hash cache is keyed by (path, mtime, size), and an edit moves the
    # mtime (set explicitly: two writes can share a clock tick).
    text = eval_file.read_text(encoding="utf-8")
    eval_file.write_text(text.replace("Janet", "Jonas"), encoding="utf-8")
    os.utime(eval_file, ns=(2, 2))
    assert code_version(config, "mixed_shards") not in (before["mixed_shards"], after["mixed_shards"])
