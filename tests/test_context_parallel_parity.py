"""Context parallelism reproduces one device (parity harness, SGD steps, sequence 1,024 on gloo).

Models (tests/models_long.py): Hugging Face Llama (RoPE, grouped-query attention), nanoGPT (learned
positions), a packed-document decoder (block-causal masks from position-id resets) and a decoder whose
loss is the chunked linear + cross-entropy. Every cp kind at cp 2 and 4, with tensor parallelism, with
a pipeline, and at other sequence lengths than the traced one.
"""

from __future__ import annotations

import pytest

from tests.parity import ParityCase, run_parity, run_parity_many

LLAMA = "tests.models_long:build_llama_long"
GPT = "tests.models_long:build_gpt_long"
PACKED = "tests.models_long:build_packed_long"
CHUNKED = "tests.models_long:build_chunked_loss_long"
KINDS = ("zigzag", "ring", "ulysses", "hybrid")


def _case(model: str, plan: int, cp: int, kind: str, policy: str = "tp", **extra) -> ParityCase:
    pas = {"cp_size": cp, "cp_kind": kind, **extra.pop("pas", {})}
    return ParityCase(model, policy, plan, {"pas_config": pas, **extra}, optimizer="sgd")


def test_cp4_every_kind_llama_gpt_packed(tmp_path):
    cases = [_case(m, 4, 4, kind) for m in (LLAMA, GPT) for kind in KINDS]
    cases += [_case(PACKED, 4, 4, kind) for kind in ("zigzag", "ulysses", "hybrid")]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=900)


def test_cp2_with_tp2_and_chunked_loss(tmp_path):
    cases = [_case(m, 4, 2, "zigzag") for m in (LLAMA, GPT, PACKED)]
    cases += [_case(LLAMA, 4, 2, "ulysses"), _case(CHUNKED, 4, 2, "zigzag"), _case(CHUNKED, 4, 4, "ring")]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=900)


def test_cp2_every_kind_on_two_ranks(tmp_path):
    cases = [_case(LLAMA, 2, 2, kind) for kind in ("zigzag", "ring", "ulysses")]
    cases += [_case(PACKED, 2, 2, "ring"), _case(CHUNKED, 2, 2, "zigzag")]
    run_parity_many(cases, 2, tmp_path=tmp_path, timeout=600)


def test_cp2_with_a_pipeline(tmp_path):
    pas = {"pp_size": 2, "pipeline_nmicros": 2, "cp_size": 2, "cp_kind": "zigzag"}
    run_parity(
        LLAMA,
        "hybrid",
        4,
        4,
        steps=2,
        tmp_path=tmp_path,
        optimizer="sgd",
        nmicros=2,
        config_kwargs={"pas_config": pas, "use_end2end": True},
        timeout=600,
    )


@pytest.mark.parametrize("kind", ["zigzag", "ulysses"])
def test_other_sequence_lengths_after_compile(kind, tmp_path):
    """Compiled at 1,024 tokens, called at 512, 256 and 1,024 with other batch sizes."""
    run_parity(
        LLAMA,
        "tp",
        2,
        2,
        tmp_path=tmp_path,
        optimizer="sgd",
        config_kwargs={"pas_config": {"cp_size": 2, "cp_kind": kind}},
        shapes=[(2, 512), (1, 256), (4, 1024)],
        timeout=600,
    )
