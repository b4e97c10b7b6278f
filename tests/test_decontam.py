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
