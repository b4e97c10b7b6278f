"""Language-ID benchmark: Kiln's language column against lid.176 called directly, per language.

    python tests/benchmarks/bench_langid.py [--quick] [--merge-confusable]

Data: lingua's held-out test sentences (/work/shared/data/langid/lingua_sentences, 75 languages,
200 lines each; Leipzig corpora news/web sentences). The label is the file name (ISO 639-1);
lid.176 spells Norwegian Bokmål `no`, so `nb` maps to `no`. Languages whose label lid.176 does
not have (read from the model, not hard-coded) are listed and left out of the macro average.

Kiln: `compute_signals_pandas` (the same `signals_for_batch` the quality_signals stage runs on
every Spark batch: whitespace normalisation, batched `LanguageIdentifier.predict`), one
document per sentence. Direct: the model's `predict(sentence, k=1)` on the raw sentence, newlines
replaced by spaces, as datatrove's LanguageFilter calls it. Same model file, same run.

Accuracy per language = share of its sentences whose top label is the language; the macro
average is over supported languages. `--merge-confusable` also reports accuracies where a label
inside one group of near-identical standards counts as right (hr/sr/bs/sh, no/nn, ms/id): these
are the pairs lid.176 mostly confuses, and whether that matters depends on the use.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))
SENTENCES = SHARED / "langid" / "lingua_sentences"

from engine.langid import ensure_lid_model, load_fasttext_model  # noqa: E402
from engine.signals import compute_signals_pandas  # noqa: E402

# lingua (ISO 639-1) -> lid.176 label, where they differ.
LINGUA_TO_LID = {"nb": "no"}
CONFUSABLE = [{"hr", "sr", "bs", "sh"}, {"no", "nn"}, {"ms", "id"}]


def load_sentences(per_language: int | None) -> dict[str, list[str]]:
    out = {}
    for path in sorted(SENTENCES.glob("*.txt")):
        if path.name == "SOURCE.txt":
            continue
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        out[path.stem] = lines[:per_language] if per_language else lines
    return out


def merged(label: str) -> str:
    for group in CONFUSABLE:
        if label in group:
            return "+".join(sorted(group))
    return label


def accuracies(truth: list[str], predicted: list[str], languages: list[str], merge: bool = False) -> dict[str, float]:
    hits: dict[str, list[int]] = {lang: [0, 0] for lang in languages}
    for gold, guess in zip(truth, predicted):
        if gold not in hits:
            continue
        hits[gold][1] += 1
        hits[gold][0] += (merged(gold) == merged(guess)) if merge else (gold == guess)
    return {lang: h / n for lang, (h, n) in hits.items() if n}


def macro(per_language: dict[str, float]) -> float:
    return sum(per_language.values()) / len(per_language) if per_language else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 sentences per language")
    parser.add_argument("--merge-confusable", action="store_true", help="also report hr/sr/bs, no/nn, ms/id merged")
    args = parser.parse_args()
    if not SENTENCES.exists():
        raise SystemExit(f"lingua sentences not found at {SENTENCES} (set KILN_SHARED_DATA)")

    model_path = ensure_lid_model(str(REPO / ".kiln" / "models"))
    model = load_fasttext_model(model_path)
    lid_labels = {label.removeprefix("__label__") for label in model.get_labels()}
    sentences = load_sentences(60 if args.quick else None)
    gold = {code: LINGUA_TO_LID.get(code, code) for code in sentences}
    supported = sorted(code for code in sentences if gold[code] in lid_labels)
    unsupported = sorted(code for code in sentences if gold[code] not in lid_labels)

    rows = [(gold[code], text) for code in sentences for text in sentences[code]]
    truth = [label for label, _ in rows]
    texts = [text for _, text in rows]
    supported_labels = [gold[c] for c in supported]

    frame = pd.DataFrame({"doc_id": [f"s{i:06d}" for i in range(len(texts))], "text": texts})
    kiln_labels = compute_signals_pandas(frame, lid_model_path=model_path, with_minhash=False)["language"].tolist()
    direct_labels = [model.predict(text.replace("\n", " "), k=1)[0][0].removeprefix("__label__") for text in texts]

    kiln_acc = accuracies(truth, kiln_labels, supported_labels)
    direct_acc = accuracies(truth, direct_labels, supported_labels)
    result = {
        "benchmark": "bench_langid",
        "macro_accuracy": round(macro(kiln_acc), 4),
        "direct_macro_accuracy": round(macro(direct_acc), 4),
        "languages": len(supported),
        "unsupported_languages": unsupported,
        "sentences": len(texts),
        "sentences_per_language": max(len(v) for v in sentences.values()),
        "same_label_share": round(sum(a == b for a, b in zip(kiln_labels, direct_labels)) / len(texts), 4),
    }
    if args.merge_confusable:
        result["merged_macro_accuracy"] = round(macro(accuracies(truth, kiln_labels, supported_labels, merge=True)), 4)
        result["direct_merged_macro_accuracy"] = round(
            macro(accuracies(truth, direct_labels, supported_labels, merge=True)), 4)

    code_of = {gold[c]: c for c in supported}
    print("| language | lid label | Kiln | direct |")
    print("|---|---|---|---|")
    for label in sorted(kiln_acc, key=lambda lab: (kiln_acc[lab], lab)):
        print(f"| {code_of[label]} | {label} | {kiln_acc[label]:.3f} | {direct_acc[label]:.3f} |")
    print(f"not in lid.176 (excluded): {', '.join(unsupported)}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
