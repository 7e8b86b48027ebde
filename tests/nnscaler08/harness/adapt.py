"""Adapt nnScaler 0.8's test helper modules (not its test files) to run against this package on CPU.

    python adapt.py UPSTREAM_REPO DEST

writes DEST/tests/utils.py and DEST/tests/parallel_module/common.py from the upstream ones (imports
of nnScaler 0.8 internals guarded, `init_distributed` on gloo, `PASMegatron` raising) and
DEST/tests/parallel_module/test_end2end.py holding only its `MLP` (tests/cli/common.py imports it;
the file's own tests use internals and are not run).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_CUDA_ONLY = """

def _is_cuda_dev(dev):  # harness: only CUDA devices are redirected (meta / fake tensors stay as they are)
    return str(dev).startswith("cuda")


@contextmanager
def replace_all_device_with("""


def adapt_utils(text: str) -> str:
    """`replace_all_device_with` redirects only CUDA devices: forcing every constructor and `.to` onto
    the CPU would also move the meta / fake tensors this package traces with."""
    text = text.replace("\n\n@contextmanager\ndef replace_all_device_with(", _CUDA_ONLY, 1)
    text = text.replace(
        '            kwargs["device"] =device\n',
        '            if _is_cuda_dev(kwargs.get("device")):\n                kwargs["device"] = device\n',
    )
    text = text.replace(
        "if len(args) > 0 and isinstance(args[0], (torch.device, str)):",
        "if len(args) > 0 and isinstance(args[0], (torch.device, str)) and _is_cuda_dev(args[0]):",
    )
    text = text.replace(
        "        if 'device' in kwargs:\n", "        if _is_cuda_dev(kwargs.get('device')):\n"
    )
    text = text.replace(
        "from nnscaler.runtime.device import DeviceGroup, CompileFlag",
        "try:\n    from nnscaler.runtime.device import DeviceGroup, CompileFlag\n"
        "except ImportError:  # nnScaler 0.8 internals\n    DeviceGroup = CompileFlag = None",
    )
    return text.replace(
        "    from nnscaler.graph.tracer import wrap_utils\n",
        "    try:\n        from nnscaler.graph.tracer import wrap_utils\n    except ImportError:\n"
        "        import types as _t\n        wrap_utils = _t.SimpleNamespace(default_autowrap_leaf_function={})\n",
    )


def adapt_common(text: str) -> str:
    text = re.sub(r"from nnscaler\.(graph|ir|policies)[^\n]*\n", "", text)
    text = text.replace(
        "import more_itertools as mitr",
        "try:\n    import more_itertools as mitr\nexcept ImportError:\n    mitr = None",
    )
    text = re.sub(
        r"def init_distributed\(\):\n(    .*\n)+",
        "def init_distributed():\n    torch.distributed.init_process_group(backend='gloo')\n\n\n",
        text,
    )
    return text.replace(
        "def PASMegatron(graph: IRGraph, config: ComputeConfig):",
        "def PASMegatron(graph, config: ComputeConfig):\n"
        "    raise NotImplementedError('PASMegatron uses nnScaler 0.8 graph internals')",
    )


def mlp_only(text: str) -> str:
    mlp = re.search(r"\nclass MLP\(nn\.Module\):\n(?:(?:    .*)?\n)+", text).group(0)
    head = (
        "from typing import Dict\n\nimport torch\nfrom torch import nn\n\nfrom ..utils import init_random\n\n"
    )
    return head + "DIM = 16\nLAYERS = 16\n\n" + mlp


def main(upstream: str, dest: str) -> None:
    up, out = Path(upstream) / "tests", Path(dest) / "tests"
    (out / "utils.py").write_text(adapt_utils((up / "utils.py").read_text()))
    pm = out / "parallel_module"
    (pm / "common.py").write_text(adapt_common((up / "parallel_module" / "common.py").read_text()))
    (pm / "test_end2end.py").write_text(mlp_only((up / "parallel_module" / "test_end2end.py").read_text()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
