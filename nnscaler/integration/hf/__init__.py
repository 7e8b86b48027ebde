"""Hugging Face checkpoints in and out of parallel modules.

    from nnscaler.integration.hf import load_pretrained, save_pretrained
    pm = nnscaler.parallelize(model, dummy, "tp", ComputeConfig(2, 2))
    load_pretrained(pm, "Qwen2-0.5B/")             # each rank reads only its slices
    ...                                            # train
    save_pretrained(pm, "out/", config=model.config)   # transformers' from_pretrained loads it

`tensors` lists what each rank holds (and gathers every rank's metadata), `reader` reads slices of
safetensors files lazily, `load` and `save` are the two entry points. See docs/hf_checkpoints.md.
"""

from nnscaler.integration.hf.load import LoadResult, load_pretrained
from nnscaler.integration.hf.save import find_config, save_pretrained

__all__ = ["load_pretrained", "save_pretrained", "LoadResult", "find_config"]
