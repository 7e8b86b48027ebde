"""Tokenize a text corpus into fixed-length sequences of --seq_len tokens and save them for train.py.

    python examples/llama3_8B_128K/bookcorpus.py --data_name bookcorpus/bookcorpus \\
        --tokenizer meta-llama/Meta-Llama-3-8B --seq_len 131072 --save_path ./bookcorpus_llama3_128K
    python examples/llama3_8B_128K/bookcorpus.py --offline --seq_len 128 --save_path ./bytes_128

With --data_name and --tokenizer (and a network, and `pip install datasets`) the documents come from
Hugging Face datasets and are tokenized by the HF tokenizer. Otherwise, or with --offline, the text is
--text_file or the Python standard library's sources, tokenized by an offline byte-level tokenizer
(bytes 0..255, BOS 256, EOS 257; vocab 258); it says so. Documents are packed as BOS text EOS one after
another and cut into rows of --seq_len tokens (the remainder is dropped). The saved dataset is a
directory with tokens.npy (rows x seq_len, int32) and meta.json, read by data.TokenDataset.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from examples.llama3_8B_128K.data import BYTE_VOCAB, DatasetMeta, byte_encode, save_dataset  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_path", required=True, help="output directory (tokens.npy, meta.json)")
    p.add_argument("--seq_len", type=int, default=131072, help="tokens per row")
    p.add_argument("--data_name", default=None, help="a Hugging Face dataset (e.g. bookcorpus/bookcorpus)")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer id or local directory")
    p.add_argument("--offline", action="store_true", help="local text and the byte tokenizer, no network")
    p.add_argument("--text_file", default=None, help="local text instead of the standard library's sources")
    p.add_argument("--max_rows", type=int, default=None, help="stop after this many rows")
    p.add_argument("--max_chars", type=int, default=2_000_000, help="characters of local text to read")
    return p.parse_args(argv)


def stdlib_files() -> list[Path]:
    """The Python standard library's top-level .py files, sorted (every machine reads the same)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_sources(max_chars: int) -> Iterator[str]:
    """The texts of stdlib_files(), max_chars characters in all."""
    left = max_chars
    for f in stdlib_files():
        if left <= 0:
            return
        text = f.read_text(encoding="utf-8", errors="replace")[:left]
        left -= len(text)
        yield text


def pack(docs: Iterator[list[int]], seq_len: int, max_rows: int | None) -> np.ndarray:
    """Concatenate the token lists and cut rows of seq_len."""
    rows, buf = [], []
    for ids in docs:
        buf.extend(ids)
        while len(buf) >= seq_len:
            rows.append(buf[:seq_len])
            buf = buf[seq_len:]
            if max_rows and len(rows) >= max_rows:
                return np.array(rows, dtype=np.int32)
    return np.array(rows, dtype=np.int32).reshape(len(rows), seq_len)


def hf_docs(data_name: str, tokenizer_id: str) -> tuple[Iterator[list[int]], int]:
    """Tokenized documents of a Hugging Face dataset (streamed) and the tokenizer's vocab size."""
    import datasets  # noqa: PLC0415 (optional: pip install datasets)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(tokenizer_id)
    ds = datasets.load_dataset(data_name, split="train", streaming=True)

    def gen() -> Iterator[list[int]]:
        for doc in ds:
            yield tok(doc["text"])["input_ids"] + [tok.eos_token_id]

    return gen(), len(tok)


def main(argv: list[str] | None = None) -> DatasetMeta:
    args = parse_args(argv)
    meta = None
    if not args.offline and args.data_name and args.tokenizer:
        try:
            docs, vocab = hf_docs(args.data_name, args.tokenizer)
            rows = pack(docs, args.seq_len, args.max_rows)
            meta = DatasetMeta(args.data_name, args.tokenizer, vocab, args.seq_len, len(rows))
        except Exception as err:  # no `datasets`, no network, a gated tokenizer
            print(f"could not read {args.data_name} with {args.tokenizer} ({type(err).__name__}: {err})")
    if meta is None:
        if args.text_file:
            source, texts = args.text_file, iter([Path(args.text_file).read_text(encoding="utf-8")])
        else:
            source, texts = "python-stdlib-sources", stdlib_sources(args.max_chars)
        print(f"offline: tokenizing {source} with the byte-level tokenizer (vocab {BYTE_VOCAB})")
        rows = pack((byte_encode(t) for t in texts), args.seq_len, args.max_rows)
        meta = DatasetMeta(source, "bytes", BYTE_VOCAB, args.seq_len, len(rows))
    if len(rows) == 0:
        raise SystemExit(
            f"no full row of --seq_len {args.seq_len} tokens: give more text or a shorter --seq_len"
        )
    save_dataset(args.save_path, rows, meta)
    print(
        f"saved {meta.rows} sequences of {meta.seq_len} tokens (vocab {meta.vocab_size}) to {args.save_path}"
    )
    return meta


if __name__ == "__main__":
    main()
