"""What an offline CPU machine lacks for nnScaler 0.8's examples, made locally: synthetic text and images
in place of downloaded data sets, tiny model configs (random weights) and a word-level tokenizer in
place of Hugging Face hub ids. Imported by the adapted examples (tests/nnscaler08/run_examples.sh);
not part of the test suite."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = "the a one two three red green blue cat dog bird runs jumps sleeps over under near big small".split()


def synthetic_text(lines: int = 2000, seed: int = 0) -> str:
    """Learnable sentences: a template of words from a small vocabulary (the loss can fall)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        adj, noun, verb, prep = (
            rng.choice(WORDS[5:8]),
            rng.choice(WORDS[8:11]),
            rng.choice(WORDS[11:14]),
            rng.choice(WORDS[14:17]),
        )
        out.append(f"the {adj} {noun} {verb} {prep} the {rng.choice(WORDS[17:])} {rng.choice(WORDS[8:11])} .")
    return "\n".join(out) + "\n"


def write_text(path: str | Path, lines: int = 2000) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(synthetic_text(lines))
    return path


def tiny_tokenizer(out_dir: str | Path) -> int:
    """A word-level fast tokenizer with bos/eos/pad saved under `out_dir`; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + ["."])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out_dir))
    return len(vocab)


def tiny_llama(out_dir: str | Path, layers: int = 4) -> Path:
    """A Llama config (hidden 64, 4 heads, 2 kv heads) and tokenizer under `out_dir`, loadable with
    AutoConfig / AutoTokenizer / AutoModelForCausalLM.from_pretrained (random weights saved too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same random weights every run
    out = Path(out_dir)
    vocab = tiny_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    return out


def tiny_vit(out_dir: str | Path, image: int = 32) -> Path:
    """A ViT (image 32, patch 8, hidden 64, 2 layers) and its image processor under `out_dir`."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)  # the same random weights every run
    out = Path(out_dir)
    cfg = ViTConfig(
        image_size=image,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    ViTForImageClassification(cfg).save_pretrained(str(out))
    ViTImageProcessor(size={"height": image, "width": image}).save_pretrained(str(out))
    return out


CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def synthetic_cifar10(split, samples: int = 200, image: int = 32, seed: int = 0):
    """In place of `load_dataset("cifar10", split=[...])`: a list with one `datasets.Dataset` per split
    asked for, of `samples` RGB images whose colour depends on the label (learnable), with cifar10's
    features ('img': Image, 'label': ClassLabel of its 10 names)."""
    import numpy as np
    import pyarrow as pa
    from datasets import ClassLabel, Dataset, DatasetInfo, Features
    from datasets import Image as ImageFeature
    from PIL import Image

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, samples)
    imgs = []
    for y in labels:
        base = np.array([25 * y, 255 - 25 * y, (80 * y) % 256], dtype=np.float64)
        pix = np.clip(base + rng.normal(0, 30, (image, image, 3)), 0, 255).astype(np.uint8)
        imgs.append(Image.fromarray(pix))
    feats = Features({"img": ImageFeature(), "label": ClassLabel(names=CIFAR10_NAMES)})
    batch = feats.encode_batch({"img": imgs, "label": [int(y) for y in labels]})
    table = pa.Table.from_pydict(batch, schema=feats.arrow_schema)
    # a fixed fingerprint: hashing the table (Dataset.from_dict) pickles pyarrow types dill cannot
    ds = Dataset(table, info=DatasetInfo(features=feats), fingerprint=f"synthetic_cifar10_{samples}_{seed}")
    return [ds for _ in (split if isinstance(split, list) else [split])]
