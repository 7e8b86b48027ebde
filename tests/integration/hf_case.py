"""Workers of the Hugging Face checkpoint tests (tests/integration/test_hf_checkpoints.py).

A tiny Qwen2 built from its config (no downloads); `SOURCE_SEED` builds the weights saved as the
pretrained checkpoint, `OTHER_SEED` the model every rank parallelizes (so only load_pretrained can
make them equal). Each rank's bytes read are counted twice: by `load_pretrained` itself and by a
wrapper around `safe_open` that adds up every slice / tensor handed out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SOURCE_SEED, OTHER_SEED = 0, 1
VOCAB, SEQ = 128, 8
SGD_LR = 0.1


def build_qwen2(seed: int, tie: bool = True, layers: int = 2) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=tie,
    )
    cfg._attn_implementation = "sdpa"
    cfg.loss_type = "ForCausalLM"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float().train()


class Wrapped(nn.Module):
    """A user's model holding the Hugging Face model as `self.m` (prefix "m.") and returning the loss."""

    def __init__(self, seed: int, tie: bool = True):
        super().__init__()
        self.m = build_qwen2(seed, tie)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


def batch(step: int, batch_size: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def train_reference(path: str, steps: int, batch_size: int = 2) -> tuple[list[float], nn.Module]:
    """One process: transformers' from_pretrained, `steps` SGD steps on `batch(step)`."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path).float().train()
    model.config.loss_type = "ForCausalLM"
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for step in range(steps):
        loss = model(**batch(step, batch_size)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


class _CountingSlice:
    def __init__(self, inner: Any, counter: list[int]):
        self.inner, self.counter = inner, counter

    def __getitem__(self, idx: Any) -> torch.Tensor:
        t = self.inner[idx]
        self.counter[0] += t.numel() * t.element_size()
        return t

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()


class _CountingFile:
    def __init__(self, inner: Any, counter: list[int]):
        self.inner, self.counter = inner, counter

    def __enter__(self) -> _CountingFile:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(name), self.counter)

    def get_tensor(self, name: str) -> torch.Tensor:
        t = self.inner.get_tensor(name)
        self.counter[0] += t.numel() * t.element_size()
        return t


def count_reads() -> list[int]:
    """Wrap the reader's `safe_open` so every tensor byte handed out is counted; returns the counter."""
    from safetensors import safe_open

    import nnscaler.integration.hf.reader as reader

    counter = [0]
    reader.safe_open = lambda *a, **k: _CountingFile(safe_open(*a, **k), counter)
    return counter


def expected_share(pm: Any, zero3: bool = False) -> int:
    """Bytes this rank should read: its shard of every tensor (under ZeRO-3 its flat slices, plus at
    most two partial rows per tensor; counted by the caller's bound)."""
    if not zero3:
        return sum(
            torch.Size(i.local_shape).numel() * i.dtype.itemsize for i in pm.fullmap.values() if i.persistent
        )
    z = pm._zero3
    total = 0
    for flat in z.flats:
        total += (min(flat.hi, flat.numel) - min(flat.lo, flat.numel)) * flat.dtype.itemsize
    return total


def compare_dirs(a: str, b: str) -> list[str]:
    """Keys whose tensors differ between two HF checkpoint directories (tied names resolved)."""
    from transformers import Qwen2ForCausalLM

    ma, mb = Qwen2ForCausalLM.from_pretrained(a), Qwen2ForCausalLM.from_pretrained(b)
    sa, sb = ma.state_dict(), mb.state_dict()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


def micro_batches(step: int, nmicros: int) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of step `step` (one: `batch(step)`)."""
    return [batch(step)] if nmicros == 1 else [batch(step * 10 + m) for m in range(nmicros)]


def train_reference_micro(path: str, steps: int, nmicros: int) -> tuple[list[float], nn.Module]:
    """One process, gradient accumulation over `micro_batches` (a sum, as train_step does)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path).float().train()
    model.config.loss_type = "ForCausalLM"
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for step in range(steps):
        for micro in micro_batches(step, nmicros):
            loss = model(**micro).loss
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model


def parallel_worker(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Parallelize a fresh model, load the checkpoint, train, export. `case` keys: src, out, gen,
    plan, steps, wrapped, config (ComputeConfig kwargs), nmicros, bad (name -> bad checkpoint dir),
    optimizer_first (build the optimizer before loading: ZeRO-3 then holds only slices)."""
    import nnscaler
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.integration.hf import load_pretrained, save_pretrained

    nnscaler.init()
    counter = count_reads()
    wrapped, nmicros = case.get("wrapped", False), case.get("nmicros", 1)
    model = (
        Wrapped(OTHER_SEED, case.get("tie", True))
        if wrapped
        else build_qwen2(OTHER_SEED, case.get("tie", True))
    )
    prefix = "m." if wrapped else ""
    cfg = ComputeConfig(case["plan"], world, **case.get("config", {}))
    pm = parallelize(model, batch(0), case.get("policy", "tp"), cfg, gen_savedir=case["gen"])
    errors = {}
    for name, bad in case.get("bad", {}).items():
        try:
            load_pretrained(pm, bad, prefix)
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            errors[name] = f"{type(err).__name__}: {err}"
    opt = build_optimizer(pm, torch.optim.SGD, lr=SGD_LR) if case.get("optimizer_first") else None
    counter[0] = 0
    result = load_pretrained(pm, case["src"], prefix)
    read_by_wrapper = counter[0]
    opt = opt or build_optimizer(pm, torch.optim.SGD, lr=SGD_LR)
    losses = []
    for step in range(case["steps"]):
        if cfg.use_end2end:
            losses.extend(float(x) for x in pm.train_step(micro_batches(step, nmicros)))
        else:
            loss = loss_of(pm(**batch(step)))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    config = (model.m if wrapped else model).config if case.get("pass_config") else None
    save_pretrained(pm, case["out"], prefix, config=config, max_shard_size="40KB")
    return {
        "losses": losses,
        "bytes_read": result.bytes_read,
        "read_by_wrapper": read_by_wrapper,
        "share": expected_share(pm, zero3=pm._zero3 is not None),
        "tp_share": sum(
            torch.Size(i.local_shape).numel() * i.dtype.itemsize for i in pm.fullmap.values() if i.persistent
        ),
        "rows_slack": sum(
            2 * torch.Size(i.local_shape[1:]).numel() * i.dtype.itemsize for i in pm.fullmap.values()
        ),
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "errors": errors,
    }


class TokenSamples(torch.utils.data.Dataset):
    """Sample i: `SEQ` input ids and the next tokens as labels, fixed by i."""

    def __init__(self, size: int = 8):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids[:-1].clone(), "labels": ids[1:].clone()}


def trainer_yaml(tmp: str, src: str, out: str, steps: int, micro: int) -> str:
    """A Trainer config: Wrapped Qwen2 under tp on 2 ranks, loaded from `src`, exported to `out`."""
    return f"""
compute_config: {{plan_ngpus: 2, runtime_ngpus: 2}}
pas_policy: tp
seed: 0
micro_batch_size: {micro}
grad_accumulation_steps: 1
max_train_steps: {steps}
enable_progress_bar: false
gen_savedir: {tmp}/gen
model:
  type: tests.integration.hf_case.Wrapped
  args: {{seed: {OTHER_SEED}}}
  pretrained_path: {src}
  hf_prefix: m.
optimizer:
  type: torch.optim.SGD
  args: {{lr: {SGD_LR}}}
dataset:
  type: tests.integration.hf_case.TokenSamples
  train_args: {{size: {steps * micro}}}
dataset_sampler:
  train_args: {{shuffle: false}}
checkpoint:
  no_save: true
  export_hf: {out}
"""


def trainer_worker(rank: int, world: int, yaml_path: str) -> list[float]:
    from nnscaler.cli import Trainer

    trainer = Trainer(["-f", yaml_path])
    trainer.run()
    return trainer.losses


def train_reference_samples(path: str, steps: int, micro: int) -> tuple[list[float], nn.Module]:
    """One process: SGD on TokenSamples in order, `micro` samples per step."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path).float().train()
    model.config.loss_type = "ForCausalLM"
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    data, losses = TokenSamples(steps * micro), []
    for step in range(steps):
        samples = [data[step * micro + j] for j in range(micro)]
        loss = model(**{k: torch.stack([s[k] for s in samples]) for k in samples[0]}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model
