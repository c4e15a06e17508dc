"""pydocs_cloze: an lm-eval task over held-out Python-docs sentences (multiple choice, 4 words).

Each item is one prose sentence of `pydocs.val.jsonl` (the held-out split of setup.prepare_corpus)
without its last word; the choices are that word and three last words of other held-out sentences, so
a model scores by how well it predicts documentation prose, not by format. Sentences whose context also
occurs in a training chunk (docstrings share sentences) are left out: no item was trained on.

    python -m apps.main.eval_tasks.pydocs_cloze --corpus data/corpus/pydocs   # rewrite the data

lm-eval reads `pydocs_cloze.yaml`, whose `custom_dataset` is `load_dataset` below: the committed
`pydocs_cloze.jsonl` (written by this script from CPython 3.11's docs), no download and no datasets cache.
"""

import argparse
import json
import random
import re
from pathlib import Path

DATA_FILE = Path(__file__).with_name("pydocs_cloze.jsonl")
SEED = 0
N_CHOICES = 4
MAX_ITEMS = 500
MIN_WORDS, MAX_WORDS = 8, 40
# Prose only: code, grammar rules, reST markup and doctest lines make the next word a guess about syntax.
NOT_PROSE = re.compile(r"[`*<>=|{}\[\]\\_#@$]|::|\.\.\.|\d\)")
SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")
LAST_WORD = re.compile(r"^(.*\S)\s+([a-z]{3,})\.$", re.DOTALL)


def prose_sentences(doc: str) -> list[str]:
    """The sentences of a document's prose paragraphs (title, indented and marked-up paragraphs skipped)."""
    sentences = []
    for paragraph in doc.split("\n\n")[1:]:
        lines = paragraph.split("\n")
        if any(line.startswith((" ", "\t")) or not line.strip() for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        sentences.extend(SENTENCE_END.split(text))
    return sentences


def build_items(val_docs: list[str], train_docs: list[str] = (), max_items: int = MAX_ITEMS,
                seed: int = SEED) -> list[dict]:
    """Cloze items from the held-out documents, in document order, none whose context a training document
    holds; same input and seed -> same items."""
    # Compared with single spaces: a sentence wrapped differently in another docstring is the same text.
    train_text = "\n".join(" ".join(doc.split()) for doc in train_docs)
    pairs, seen = [], set()
    for doc in val_docs:
        for sentence in prose_sentences(doc):
            match = LAST_WORD.match(sentence)
            if not match or NOT_PROSE.search(sentence) or not MIN_WORDS <= len(sentence.split()) <= MAX_WORDS:
                continue
            context, word = match.groups()
            if context not in seen and context not in train_text:
                seen.add(context)
                pairs.append((context, word))
    words = sorted({word for _, word in pairs})
    if len(words) < N_CHOICES:
        raise ValueError(f"the held-out documents hold only {len(pairs)} usable sentences; pass the corpus's "
                         f"held-out split (python -m setup.prepare_corpus writes data/corpus/pydocs).")
    rng = random.Random(seed)
    items = []
    for context, word in pairs[:max_items]:
        choices = [word] + rng.sample([w for w in words if w != word], N_CHOICES - 1)
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(word)})
    return items


def load_dataset(**kwargs):
    """lm-eval's `custom_dataset` hook: the committed items as a one-split DatasetDict (kwargs unused)."""
    import datasets

    items = [json.loads(line) for line in DATA_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def read_texts(paths) -> list[str]:
    return [json.loads(line)["text"] for path in paths for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="data/corpus/pydocs", help="pydocs.val.jsonl + the training chunks")
    parser.add_argument("--out", default=str(DATA_FILE))
    args = parser.parse_args(argv)
    corpus = Path(args.corpus)
    if not (corpus / "pydocs.val.jsonl").is_file():
        raise SystemExit(f"error: '{corpus}' holds no pydocs.val.jsonl; run python -m setup.prepare_corpus first.")
    items = build_items(read_texts([corpus / "pydocs.val.jsonl"]), read_texts(sorted(corpus.glob("*.chunk.*.jsonl"))))
    with open(args.out, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} items to {args.out}")


if __name__ == "__main__":
    main()
