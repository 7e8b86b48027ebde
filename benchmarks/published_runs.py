"""Load and check benchmarks/published_runs.yaml (the published training runs of issue 42).

    rows = load_rows()                        # every row, checked
    rows = load_rows(split="held_aside")      # one split

A row missing a field, or with a value of the wrong kind, is refused with a ValueError naming the row
and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["PublishedRun", "load_rows", "SPLITS", "KINDS", "RECOMPUTE", "DEFAULT_PATH"]

DEFAULT_PATH = Path(__file__).with_name("published_runs.yaml")
SPLITS = ("calibrate", "held_aside")
KINDS = ("tokens_per_s_per_gpu", "tflops_per_gpu_hw", "mfu_megatron", "mfu_6n", "step_s")
RECOMPUTE = ("none", "selective", "selective_op", "full")
SCHEDULERS = ("none", "1f1b", "1f1b_interleaved", "gpipe")

_MODEL = {
    "family": str,
    "hidden": int,
    "layers": int,
    "heads": int,
    "kv_heads": int,
    "ffn": int,
    "vocab": int,
}
_HARDWARE = {
    "device": str,
    "gpus": int,
    "nodes": int,
    "devices_per_node": int,
    "intra_gbs": float,
    "inter_gbs": float,
}
_HARDWARE_OPTIONAL = {"power_w": float, "clock_mhz": float, "memory_gb": float, "mem_bw_gbs": float}
_LAYOUT = {
    "tp": int,
    "pp": int,
    "dp": int,
    "cp": int,
    "vpp": int,
    "scheduler": str,
    "zero": int,
    "micro_batch": int,
    "global_batch": int,
    "recompute": str,
    "sequence_parallel": bool,
}


@dataclass(frozen=True)
class PublishedRun:
    """One published run (see the YAML file's header for the fields' meaning)."""

    id: str
    source: dict
    model: dict
    hardware: dict
    layout: dict
    seq: int
    precision: str
    published: dict
    split: str
    verified: bool
    note: str

    @property
    def nmicros(self) -> int:
        """Micro-batches per step of one data-parallel replica."""
        lay = self.layout
        return lay["global_batch"] // (lay["dp"] * lay["micro_batch"])

    @property
    def model_key(self) -> tuple:
        """What a capture depends on: the architecture and the sequence length."""
        return (tuple(sorted(self.model.items())), self.seq)


def _check(where: str, data: object, fields: dict, optional: dict | None = None) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    for key in fields:
        if key not in data:
            raise ValueError(f"{where} lacks field {key!r}")
    for key, kind in {**fields, **(optional or {})}.items():
        if key not in data:
            continue
        value = data[key]
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is float
            else (isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
        )
        if not ok:
            raise ValueError(f"{where}.{key} must be {kind.__name__}, got {value!r}")
    return data


def _row(data: dict, index: int) -> PublishedRun:
    rid = data.get("id") if isinstance(data, dict) else None
    where = f"published_runs row {rid or index}"
    _check(
        where, data, {"id": str, "seq": int, "precision": str, "split": str, "verified": bool, "note": str}
    )
    for key in ("source", "model", "hardware", "layout", "published"):
        if key not in data:
            raise ValueError(f"{where} lacks field {key!r}")
    _check(f"{where}.source", data["source"], {"name": str, "url": str, "where": str})
    _check(f"{where}.model", data["model"], _MODEL)
    _check(f"{where}.hardware", data["hardware"], _HARDWARE, _HARDWARE_OPTIONAL)
    lay = _check(f"{where}.layout", data["layout"], _LAYOUT, {"edge_chunks": bool})
    pub = _check(f"{where}.published", data["published"], {"value": float, "kind": str})
    if data["split"] not in SPLITS:
        raise ValueError(f"{where}.split must be one of {SPLITS}, got {data['split']!r}")
    if pub["kind"] not in KINDS:
        raise ValueError(f"{where}.published.kind must be one of {KINDS}, got {pub['kind']!r}")
    if lay["recompute"] not in RECOMPUTE:
        raise ValueError(f"{where}.layout.recompute must be one of {RECOMPUTE}, got {lay['recompute']!r}")
    if lay["scheduler"] not in SCHEDULERS:
        raise ValueError(f"{where}.layout.scheduler must be one of {SCHEDULERS}, got {lay['scheduler']!r}")
    gpus = data["hardware"]["gpus"]
    if lay["tp"] * lay["pp"] * lay["dp"] * lay["cp"] != gpus:
        raise ValueError(f"{where}.layout: tp x pp x dp x cp must equal hardware.gpus ({gpus})")
    if lay["global_batch"] % (lay["dp"] * lay["micro_batch"]):
        raise ValueError(f"{where}.layout: global_batch must be a multiple of dp x micro_batch")
    keys = set(PublishedRun.__dataclass_fields__)
    unknown = sorted(set(data) - keys)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}")
    return PublishedRun(**{k: data[k] for k in keys})


def load_rows(path: str | Path = DEFAULT_PATH, split: str | None = None) -> list[PublishedRun]:
    """The checked rows of the YAML file (of one split when `split` is given)."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: needs a 'rows' list")
    if doc.get("held_aside_split") != "held_aside":
        raise ValueError(f"{path}: needs held_aside_split: held_aside (the name of the held-aside split)")
    rows = [_row(r, i) for i, r in enumerate(doc["rows"])]
    ids = [r.id for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{path}: duplicate row ids {dup}")
    return [r for r in rows if split is None or r.split == split]
