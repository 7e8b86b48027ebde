"""The Llama model the trainer parallelizes: HF `LlamaForCausalLM` behind a causal-LM loss.

`LlamaLM(model_id, config, seq_len, meta)` builds the HF model from `config` (a dict) or from
`model_id`'s config (a local directory with config.json, a Hugging Face id, or
`meta-llama/Meta-Llama-3-8B` from the values hard-coded below when it cannot be fetched). Weights
are loaded when `model_id` is a local directory that holds them (safetensors or pytorch_model*.bin)
and `meta` is False; otherwise the model is randomly initialised (a Hugging Face id gives only the
config: download the weights once, `huggingface-cli download ID --local-dir DIR`, and pass DIR);
on the meta device when `meta` (nothing is allocated: for `--run_mode compile`).

The forward returns the mean token cross-entropy of the micro-batch. The rows are packed to a fixed
length (bookcorpus.py), so every micro-batch has the same number of target tokens and the trainer's
`mean` over micro-batches and replicas is the mean over all tokens of the step. (A forward returning
`(loss_sum, num_tokens)` for `per-token-mean` does not work here: `ParallelModule.train_step` hands the
trainer only each micro-batch's first output, so `aggregate_outputs_fn` never sees the counts.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import nnscaler
from examples.llama3_8B_128K.data import IGNORE_INDEX

LLAMA3_8B_ID = "meta-llama/Meta-Llama-3-8B"
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
"""config.json of meta-llama/Meta-Llama-3-8B (used when it cannot be fetched)."""


def load_config(
    model_id: str, seq_len: int | None = None, verbose: bool = True, offline: bool = False
) -> LlamaConfig:
    """The LlamaConfig of `model_id`, made ready for training on `seq_len`-token sequences:
    sdpa attention (causal, no materialised seq x seq mask), no KV cache, no dropout, and
    max_position_embeddings raised to seq_len (the rotary frequencies do not depend on it).
    `offline`: look only in the local Hugging Face cache."""
    path = Path(model_id)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"--model_id {model_id}: the directory has no config.json; "
                "create one with examples/llama3_8B_128K/create_mini_model.py or save_pretrained"
            )
        config = LlamaConfig.from_pretrained(path)
    else:
        try:
            config = LlamaConfig.from_pretrained(model_id, local_files_only=offline)
        except Exception as err:  # no network, no cache, or a gated repository without a token
            if model_id != LLAMA3_8B_ID:
                raise FileNotFoundError(
                    f"--model_id {model_id}: neither a local directory with config.json nor fetchable "
                    f"from Hugging Face ({type(err).__name__}); pass a local directory"
                ) from err
            if verbose:
                print(
                    f"could not fetch {model_id}'s config ({type(err).__name__}); using the Llama-3-8B "
                    "values built into examples/llama3_8B_128K/model.py",
                    flush=True,
                )
            config = LlamaConfig(**LLAMA3_8B)
    if seq_len and seq_len > config.max_position_embeddings:
        config.max_position_embeddings = seq_len
    config.use_cache = False
    config.attention_dropout = 0.0
    config._attn_implementation = "sdpa"
    return config


@contextmanager
def one_progress_bar_per_job() -> Iterator[None]:
    """Hugging Face's progress bars (the "Loading weights" bar of from_pretrained) on rank 0 only:
    every rank loads the weights, but the job shows one bar, not one per rank."""
    if int(os.environ.get("RANK", "0")) == 0 or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def has_weights(model_id: str) -> bool:
    """Whether `model_id` is a local directory holding weights."""
    path = Path(model_id)
    return path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")))


class LlamaLM(torch.nn.Module):
    """`LlamaForCausalLM` whose forward returns the mean next-token loss."""

    def __init__(
        self,
        model_id: str,
        config: dict | None = None,
        seq_len: int | None = None,
        meta: bool = False,
        chunk_loss: bool = False,
    ):
        super().__init__()
        self.chunk_loss = chunk_loss
        if config is not None:  # resolved once by train.py (no second fetch on every rank)
            config = LlamaConfig.from_dict(config)
            config._attn_implementation = "sdpa"
        else:
            config = load_config(model_id, seq_len, verbose=False)
        if meta:
            with torch.device("meta"):
                self.model = LlamaForCausalLM(config)
        elif has_weights(model_id):
            with one_progress_bar_per_job():
                self.model = LlamaForCausalLM.from_pretrained(model_id, config=config, dtype=torch.float32)
        else:  # a Hugging Face id (config only) or a directory without weights
            self.model = LlamaForCausalLM(config)  # random init (seeded by the trainer)
        self.vocab_size = config.vocab_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model(input_ids=input_ids).last_hidden_state
        if self.chunk_loss:  # --enable_chunk_loss: per-token losses over chunks, logits never whole
            flat = labels.reshape(-1)
            losses = nnscaler.chunk_linear_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]),
                self.model.lm_head.weight,
                flat,
                ignore_index=IGNORE_INDEX,
            )
            return losses.sum() / (flat != IGNORE_INDEX).sum().clamp(min=1)
        logits = self.model.lm_head(hidden)
        loss = F.cross_entropy(
            logits.float().view(-1, self.vocab_size),
            labels.view(-1),
            ignore_index=IGNORE_INDEX,
        )
        return loss


def describe(config: LlamaConfig) -> str:
    """One line naming the model's size."""
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return json.dumps({k: getattr(config, k) for k in keys})
