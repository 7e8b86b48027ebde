"""`--model` / `--hf-config` of the planning and profiling commands: a model and its dummy inputs.

`--model` names a builder: a callable returning (module, dummy_kwargs) or (module, make_batch)
with make_batch(seed, batch_size) -> kwargs. `--hf-config` builds a
transformers causal LM from a config.json on the meta device (no weights are allocated).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

__all__ = ["build_model"]


def _resolve(spec: str):
    module, _, name = spec.replace(":", ".").rpartition(".")
    if not module:
        raise SystemExit(f"--model {spec!r}: give a dotted path 'package.module.builder'")
    return getattr(importlib.import_module(module), name)


def build_model(spec: str | None, hf_config: str | None, batch: int, seq: int):
    """(module, dummy forward kwargs) from a builder or a Hugging Face config file."""
    if hf_config:
        from transformers import AutoConfig, AutoModelForCausalLM

        data = json.loads(Path(hf_config).read_text())
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return model.train(), {"input_ids": ids, "labels": ids}
    out = _resolve(spec)()
    if isinstance(out, torch.nn.Module):
        raise SystemExit("--model returned a module without inputs: return (module, dummy_kwargs)")
    module, inputs = out
    if callable(inputs):
        inputs = inputs(0, batch)
    return module, inputs
