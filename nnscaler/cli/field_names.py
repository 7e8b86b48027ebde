"""Errors raised by `parallelize` name its parameters (`reuse='moo'`, `instance_name`, ...); a Trainer
user sets TrainerArgs fields instead. `in_trainer_terms` rewrites such a message in those terms."""

from __future__ import annotations

import re

from nnscaler.errors import ConfigError

__all__ = ["in_trainer_terms"]

_RENAMES = [
    (re.compile(r"\breuse='(\w+)'"), r"gen_reuse='\1'"),
    (re.compile(r"\breuse=(ReuseType\.)?(\w+)"), r"gen_reuse='\2'"),
    (re.compile(r"\bdummy_forward_args\b"), "the first training sample (or dummy_sample_gen_fn)"),
    (re.compile(r"\bmodule_dtype\b"), "precision"),
]


def in_trainer_terms(err: ConfigError) -> ConfigError:
    """A ConfigError like `err` whose message names TrainerArgs fields (gen_reuse, gen_savedir,
    instance_name, ...) instead of parallelize's parameters; `err` itself when nothing changes."""
    text = str(err)
    new = text
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, new)
    if new == text:
        return err
    try:
        out = type(err)(new)
    except TypeError:  # a subclass with another constructor
        out = ConfigError(new)
    out.__cause__ = err
    return out
