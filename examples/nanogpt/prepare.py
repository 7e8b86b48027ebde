"""Character-level data for the nanoGPT example, as nanoGPT's shakespeare_char prepares it.

    python examples/nanogpt/prepare.py                      # tinyshakespeare, or the offline corpus
    python examples/nanogpt/prepare.py --offline            # never touch the network

Downloads tinyshakespeare (5 s timeout). Without a network (or with --offline) it says so and uses
a corpus every machine has: the docstrings of the Python standard library's own sources, read in
sorted file order (deterministic for one Python version). Writes to --data_dir:

    train.bin, val.bin   the first 90% / last 10% of the text as uint16 character ids
    meta.json            {"vocab_size", "itos", "source", "max_chars", ...}

Existing files are reused (delete the directory to rebuild). `ensure_data` is the same under a
file lock, for several processes at once.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

__all__ = ["CharData", "DEFAULT_DATA_DIR", "prepare", "ensure_data", "load_meta", "encode", "decode"]

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data" / "shakespeare_char"
OFFLINE_CHARS = 400_000
"""Size of the offline corpus when --max_chars is not given."""


@dataclass
class CharData:
    """What `prepare` wrote (or found)."""

    data_dir: Path
    source: str
    """'tinyshakespeare' or 'python-stdlib-docstrings'."""
    vocab_size: int
    train_tokens: int
    val_tokens: int
    reused: bool


def download(timeout: float = 5.0) -> str | None:
    """tinyshakespeare's text, or None (with the reason printed) when the network does not allow."""
    try:
        with urllib.request.urlopen(URL, timeout=timeout) as resp:
            return resp.read().decode("utf-8")
    except Exception as err:  # no network, DNS, proxy, HTTP error, timeout: all mean "fall back"
        print(f"prepare: could not download tinyshakespeare ({type(err).__name__}: {err})", flush=True)
        return None


def stdlib_docstrings(max_chars: int) -> str:
    """Docstrings of the standard library's top-level modules (sorted by file name), ASCII only."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    text = doc.encode("ascii", "ignore").decode("ascii").replace("\t", "    ") + "\n\n"
                    parts.append(text)
                    total += len(text)
        if total >= max_chars:
            break
    if total == 0:  # no .py sources installed: the built-in functions' docstrings
        import builtins

        parts = [f"{n}\n{getattr(builtins, n).__doc__}\n\n" for n in sorted(dir(builtins))]
        parts = [p for p in parts if not p.endswith("None\n\n")]
    return "".join(parts)[:max_chars]


def encode(text: str, stoi: dict[str, int]) -> list[int]:
    unknown = sorted(set(text) - set(stoi))
    if unknown:
        raise ValueError(
            f"characters {unknown!r} are not in the vocabulary; use only characters of the corpus"
        )
    return [stoi[c] for c in text]


def decode(ids: list[int], itos: list[str]) -> str:
    return "".join(itos[i] for i in ids)


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared data dir (vocab_size, itos, stoi added)."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    meta["stoi"] = {c: i for i, c in enumerate(meta["itos"])}
    return meta


def _complete(data_dir: Path) -> bool:
    return all((data_dir / f).is_file() for f in ("train.bin", "val.bin", "meta.json"))


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def prepare(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    offline: bool = False,
    max_chars: int | None = None,
    verbose: bool = True,
) -> CharData:
    """Write train.bin / val.bin / meta.json into `data_dir` unless they are there already (then
    say so when `verbose`; what is written, and a fallback to the offline corpus, is always said)."""
    data_dir = Path(data_dir)
    if _complete(data_dir):
        meta = load_meta(data_dir)
        if verbose:
            print(f"prepare: reusing {data_dir} ({meta['source']}, vocab {meta['vocab_size']})", flush=True)
        return CharData(
            data_dir, meta["source"], meta["vocab_size"], meta["train_tokens"], meta["val_tokens"], True
        )
    text = None if offline else download()
    source = "tinyshakespeare"
    if text is None:
        source = "python-stdlib-docstrings"
        why = "--offline" if offline else "no download"
        print(
            f"prepare: {why}: using the offline corpus instead of Shakespeare: docstrings of the Python "
            "standard library's sources",
            flush=True,
        )
        text = stdlib_docstrings(max_chars or OFFLINE_CHARS)
    if max_chars:
        text = text[:max_chars]
    if len(text) < 1000:
        raise RuntimeError(
            f"prepare: the {source} corpus has only {len(text)} characters; pass --max_chars >= 1000"
        )
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = np.array(encode(text, stoi), dtype=np.uint16)
    split = int(0.9 * len(ids))
    data_dir.mkdir(parents=True, exist_ok=True)
    _write(data_dir / "train.bin", ids[:split].tobytes())
    _write(data_dir / "val.bin", ids[split:].tobytes())
    meta = {
        "vocab_size": len(itos),
        "itos": itos,
        "source": source,
        "max_chars": max_chars,
        "chars": len(text),
        "train_tokens": split,
        "val_tokens": len(ids) - split,
    }
    _write(data_dir / "meta.json", json.dumps(meta, indent=1).encode())  # last: marks the dir complete
    print(
        f"prepare: wrote {data_dir}: {source}, {len(text):,} characters, vocab {len(itos)}, "
        f"train {split:,} / val {len(ids) - split:,} tokens",
        flush=True,
    )
    return CharData(data_dir, source, len(itos), split, len(ids) - split, False)


def ensure_data(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    offline: bool = False,
    max_chars: int | None = None,
    verbose: bool = True,
) -> CharData:
    """`prepare` under a file lock beside the data dir: safe when several processes call it at once."""
    data_dir = Path(data_dir)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(data_dir) + ".lock"):
        return prepare(data_dir, offline, max_chars, verbose)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--offline", action="store_true", help="skip the download; use the offline corpus")
    parser.add_argument("--max_chars", type=int, default=None, help="keep only the first N characters")
    args = parser.parse_args(argv)
    ensure_data(args.data_dir, args.offline, args.max_chars)


if __name__ == "__main__":
    main()
