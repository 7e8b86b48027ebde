"""The model zoo for tests: tiny models built from a seed, and batches built from a seed.

Every builder returns `(model, make_batch)`: `model` is an fp32 `nn.Module` in train mode whose
forward returns a scalar loss (a tensor, or an object with `.loss` for transformers models), and
`make_batch(seed, batch_size)` returns a dict of forward keyword arguments. The same seed gives
the same model and the same batch in every process. No weights are downloaded.

    model, make_batch = build("gpt", seed=0)
    loss = model(**make_batch(seed=1, batch_size=2))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "PARITY_MODELS", "build", "extract_loss"]

Batch = dict[str, Any]
MakeBatch = Callable[[int, int], Batch]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_batch(vocab: int, seq_len: int, input_key: str, label_key: str, shift: bool) -> MakeBatch:
    """Random token ids; labels are a separate tensor (torch.export would merge identical inputs)."""

    def make_batch(seed: int, batch_size: int) -> Batch:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=_generator(seed))
        if shift:  # nanoGPT takes already-shifted targets
            inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        else:  # transformers shift the labels inside the model
            inputs, labels = tokens[:, :-1].clone(), tokens[:, :-1].clone()
        return {input_key: inputs, label_key: labels}

    return make_batch


# ---------------------------------------------------------------------------------------------
# mlp
# ---------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Three linear layers with biases; forward(x, y) returns the mean squared error."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = F.gelu(self.fc2(h))
        return F.mse_loss(self.fc3(h), y)


def build_mlp(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    torch.manual_seed(seed)
    model = MLP()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        return {"x": torch.randn(batch_size, 16, generator=g), "y": torch.randn(batch_size, 8, generator=g)}

    return model.train(), make_batch


# ---------------------------------------------------------------------------------------------
# gpt (nanoGPT-style, in the repo)
# ---------------------------------------------------------------------------------------------
def build_gpt(seed: int = 0, n_layer: int = 2) -> tuple[nn.Module, MakeBatch]:
    from examples.nanogpt.model import GPT, GPTConfig

    config = GPTConfig(
        block_size=32, vocab_size=128, n_layer=n_layer, n_head=4, n_embd=64, dropout=0.0, bias=True
    )
    torch.manual_seed(seed)
    model = GPT(config)
    return model.train(), _token_batch(config.vocab_size, 16, "idx", "targets", shift=True)


# ---------------------------------------------------------------------------------------------
# transformers models (tiny configs, random init)
# ---------------------------------------------------------------------------------------------
def _settle(config: Any) -> None:
    """Fix choices transformers would otherwise make from the environment (and warn about)."""
    config._attn_implementation = "sdpa"
    config.loss_type = "ForCausalLM"


def _settle_model(model: nn.Module) -> nn.Module:
    # transformers guesses the loss from the class name; GPT2LMHeadModel's name does not match
    model.loss_type = "ForCausalLM"
    return model.float().train()


def build_llama(seed: int = 0, num_hidden_layers: int = 2) -> tuple[nn.Module, MakeBatch]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(LlamaForCausalLM(config))
    return model, _token_batch(config.vocab_size, 16, "input_ids", "labels", shift=False)


def build_gpt2(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(GPT2LMHeadModel(config))
    return model, _token_batch(config.vocab_size, 16, "input_ids", "labels", shift=False)


def build_llama3_8b_meta(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Llama-3-8B's shapes on the meta device: no memory is allocated, for tracing and planning."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    _settle(config)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _settle_model(LlamaForCausalLM(config))
    return model, _token_batch(config.vocab_size, 1024, "input_ids", "labels", shift=False)


def _tiny_decoder(config_cls, model_cls, seed: int, **extra: Any) -> tuple[nn.Module, MakeBatch]:
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **extra,
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(model_cls(config))
    return model, _token_batch(config.vocab_size, 16, "input_ids", "labels", shift=False)


def build_mistral(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    from transformers import MistralConfig, MistralForCausalLM

    return _tiny_decoder(MistralConfig, MistralForCausalLM, seed, sliding_window=None)


def build_mixtral(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Mixture of experts: 4 experts, top-2 routing, grouped expert matmuls."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _tiny_decoder(
        MixtralConfig,
        MixtralForCausalLM,
        seed,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        router_jitter_noise=0.0,
    )


def build_bert(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Masked LM with tied input/output embeddings; labels are -100 except at masked positions."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).float().train()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        ids = torch.randint(0, config.vocab_size, (batch_size, 16), generator=g)
        # the same number of masked positions in every row: data-parallel replicas average their mean
        # losses, which equals the global token mean only when every replica counts the same tokens
        order = torch.rand(batch_size, 16, generator=g).argsort(dim=1)
        masked = torch.zeros(batch_size, 16, dtype=torch.bool).scatter(1, order[:, :5], True)
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return {"input_ids": torch.where(masked, torch.full_like(ids, 3), ids), "labels": labels}

    return model, make_batch


def build_vit(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = ViTForImageClassification(config).float().train()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        return {
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 10, (batch_size,), generator=g),
        }

    return model, make_batch


class CNN(nn.Module):
    """conv -> batch norm -> relu -> max pool -> conv -> relu -> global average pool -> linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(
            3, 16, 3, padding=1, bias=False
        )  # batch norm follows: a bias would be redundant
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.adaptive_avg_pool2d(F.relu(self.conv2(h)), 1).flatten(1)
        return F.cross_entropy(self.head(h), y)


def build_cnn(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    torch.manual_seed(seed)
    model = CNN()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        return {
            "x": torch.randn(batch_size, 3, 16, 16, generator=g),
            "y": torch.randint(0, 10, (batch_size,), generator=g),
        }

    return model.train(), make_batch


def build_userops(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """An MLP calling a torch.library custom op and a plain function registered with register_op."""
    from tests.user_ops import UserOpMLP

    torch.manual_seed(seed)
    model = UserOpMLP()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        return {"x": torch.randn(batch_size, 16, generator=g), "y": torch.randn(batch_size, 8, generator=g)}

    return model.train(), make_batch


def build_emitops(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """An MLP calling an op registered with an emit_fn (its generated call carries the rank)."""
    from tests.user_ops import EmitOpMLP

    torch.manual_seed(seed)
    model = EmitOpMLP()

    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        return {"x": torch.randn(batch_size, 16, generator=g), "y": torch.randn(batch_size, 8, generator=g)}

    return model.train(), make_batch


MODELS: dict[str, Callable[[int], tuple[nn.Module, MakeBatch]]] = {
    "mlp": build_mlp,
    "gpt": build_gpt,
    "llama": build_llama,
    "gpt2": build_gpt2,
    "meta": build_llama3_8b_meta,
    "mistral": build_mistral,
    "mixtral": build_mixtral,
    "bert": build_bert,
    "vit": build_vit,
    "cnn": build_cnn,
    "userops": build_userops,
    "emitops": build_emitops,
    # deeper versions for pipelines: enough layers for 8 (virtual) stages
    "gpt_deep": lambda seed=0: build_gpt(seed, n_layer=8),
    "llama_deep": lambda seed=0: build_llama(seed, num_hidden_layers=8),
}
"""Builders by name; each takes a seed and returns (model, make_batch)."""

PARITY_MODELS = ("mlp", "gpt", "llama", "gpt2")
"""The models small enough to train side by side with their parallel version."""


def build(name: str, seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Build zoo model `name` from `seed`; returns (model, make_batch).

    `name` may also be `"module:function"` (e.g. `"tests.models_tied:build_matmul"`): a builder kept
    beside the test that uses it, importable by spawned ranks."""
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)(seed)
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name](seed)


def extract_loss(output: Any) -> torch.Tensor:
    """The scalar loss of a forward output: the tensor itself, `output.loss`, or `output["loss"]`."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif hasattr(output, "loss") and output.loss is not None:
        loss = output.loss
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    else:
        raise TypeError(f"cannot find a loss in a forward output of type {type(output).__name__}")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the loss must be a scalar tensor, got {loss!r}")
    return loss


# ---------------------------------------------------------------------------------------------
# tensor-parallel families: Falcon (parallel blocks, fused multi-query / grouped QKV) and
# torch.nn.MultiheadAttention (packed in_proj_weight); see tests/test_tp_families.py
# ---------------------------------------------------------------------------------------------
def build_falcon(seed: int = 0, **extra: Any) -> tuple[nn.Module, MakeBatch]:
    """Falcon with parallel attention and MLP; multi-query (one K/V head) unless `extra` says otherwise."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        parallel_attn=True,
        alibi=False,
        bias=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cache=False,
        **({"multi_query": True} | extra),
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(FalconForCausalLM(config))
    return model, _token_batch(config.vocab_size, 8, "input_ids", "labels", shift=False)


class MHALM(nn.Module):
    """A small LM on torch.nn.MultiheadAttention (packed in_proj_weight, out_proj): pre-norm blocks of
    self-attention (need_weights=False) and an MLP, a linear head, cross entropy."""

    def __init__(self, batch_first: bool, bias: bool, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, dim)
        self.ln1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attn = nn.ModuleList(
            nn.MultiheadAttention(dim, 4, bias=bias, batch_first=batch_first) for _ in range(layers)
        )
        self.ln2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim, bias=bias), nn.GELU(), nn.Linear(2 * dim, dim, bias=bias))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if not self.batch_first:
            h = h.transpose(0, 1)  # (seq, batch, dim)
        for ln1, attn, ln2, mlp in zip(self.ln1, self.attn, self.ln2, self.mlp):
            x = ln1(h)
            h = h + attn(x, x, x, need_weights=False)[0]
            h = h + mlp(ln2(h))
        if not self.batch_first:
            h = h.transpose(0, 1)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_mha(seed: int = 0, batch_first: bool = True, bias: bool = True) -> tuple[nn.Module, MakeBatch]:
    torch.manual_seed(seed)
    model = MHALM(batch_first, bias)
    return model.train(), _token_batch(64, 8, "input_ids", "labels", shift=True)


MODELS.update(
    {
        "falcon_mq": build_falcon,
        "falcon_gqa": lambda seed=0: build_falcon(seed, new_decoder_architecture=True, num_kv_heads=2),
        "mha": build_mha,
        "mha_seq_first": lambda seed=0: build_mha(seed, batch_first=False, bias=False),
    }
)
