"""Convolutions, pooling and batch norm: split the batch or the channels; spatial dims stay whole."""

from __future__ import annotations

from nnscaler.graph.ir import Ref
from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule


def _spatial(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}^" for i in range(n)]


_CONV = [
    "aten.conv1d.default",
    "aten.conv2d.default",
    "aten.conv3d.default",
    "aten.conv1d.padding",
    "aten.conv2d.padding",
    "aten.conv3d.padding",
]
_CONV_TRANSPOSE = [
    "aten.conv_transpose1d.default",
    "aten.conv_transpose2d.input",
    "aten.conv_transpose3d.input",
]
_CONVOLUTION = "aten.convolution.default"


def _groups_index(op: str) -> tuple[int, str]:
    """Where `groups` is in the op's arguments (positional index, keyword name)."""
    return (8, "groups") if op == _CONVOLUTION else (6, "groups")


def _transposed(call: OpCall) -> bool:
    if call.node.op == _CONVOLUTION:
        return bool(call.arg(6, "transposed", False))
    return call.node.op in _CONV_TRANSPOSE


def _local_groups(
    args: tuple, kwargs: dict, splits: dict[str, int], index: int, name: str = "groups"
) -> tuple[tuple, dict]:
    """Split on the groups `g`: each device runs groups / devices of them (argument `index` / `name`)."""
    ways = splits.get("g")
    if not ways:
        return args, kwargs
    if index < len(args):
        return (*args[:index], args[index] // ways, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: kwargs[name] // ways}


@rule(_CONV + _CONV_TRANSPOSE, "conv", bias_input=2, local_args=lambda a, k, s: _local_groups(a, k, s, 6))
def conv(call: OpCall) -> str | tuple[str, dict[str, int]]:
    """Convolutions: the batch, output channels and input channels split.

    groups == 1: 'n c+ i.., o c+ k.. -> n o s..' (transposed: weight 'c+ o k..'). The input channels
    are a reduction (partial sums); with a bias (`bias_input`) the partition runs the local op without
    it, all-reduces, then adds the bias once (nnscaler.partition.conv_bias). groups > 1 (grouped, depthwise): channels are '(g ci)' in and
    '(g co)' out, weight '(g co) ci k..' (transposed '(g ci) co k..'): splitting `g` gives each device
    whole groups (the local op runs groups / devices of them), `co` a strided part of every group.
    Spatial dims stay whole.
    """
    x, w = call.inputs[0].shape, call.inputs[1].shape
    nsp = len(w) - 2
    batched = len(x) == nsp + 2
    index, name = _groups_index(call.node.op)
    groups = call.arg(index, name, 1)
    has_bias = len(call.inputs) > 2
    transposed = _transposed(call)
    n = "n " if batched else ""
    sp_in, sp_w, sp_out = (" ".join(_spatial(p, nsp)) for p in ("i", "k", "s"))
    if groups == 1:
        c = "c+"  # a reduction dim (partial sums); a bias is added once after the reduction
        weight = f"{c} o {sp_w}" if transposed else f"o {c} {sp_w}"
        ins = [f"{n}{c} {sp_in}", weight] + (["o"] if has_bias else [])
        return ", ".join(ins) + f" -> {n}o {sp_out}"
    ci = "ci+"
    weight = f"(g {ci}) co {sp_w}" if transposed else f"(g co) {ci} {sp_w}"
    ins = [f"{n}(g {ci}) {sp_in}", weight] + (["(g co)"] if has_bias else [])
    return ", ".join(ins) + f" -> {n}(g co) {sp_out}", {"g": groups}


@rule(_CONVOLUTION, "conv", bias_input=2, local_args=lambda a, k, s: _local_groups(a, k, s, 8))
def convolution(call: OpCall) -> str | tuple[str, dict[str, int]]:
    """aten.convolution (input, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups): annotated as conv / conv_transpose."""
    return conv(call)


@rule(
    [
        "aten.max_pool1d.default",
        "aten.max_pool2d.default",
        "aten.max_pool3d.default",
        "aten.avg_pool1d.default",
        "aten.avg_pool2d.default",
        "aten.avg_pool3d.default",
        "aten.adaptive_avg_pool1d.default",
        "aten.adaptive_avg_pool2d.default",
        "aten.adaptive_avg_pool3d.default",
        "aten.adaptive_max_pool2d.default",
        # resampling acts on the trailing spatial dims alike: the batch and channels split
        "aten.upsample_nearest1d.vec",
        "aten.upsample_nearest2d.vec",
        "aten.upsample_nearest3d.vec",
        "aten.upsample_linear1d.vec",
        "aten.upsample_bilinear2d.vec",
        "aten.upsample_bicubic2d.vec",
        "aten.upsample_trilinear3d.vec",
    ],
    "conv",
)
def pool(call: OpCall) -> str:
    op = call.node.op
    nsp = 1 if "1d" in op else 3 if "3d" in op else 2
    x = call.inputs[0].shape
    lead = letters(len(x) - nsp)
    outs = [" ".join(lead + _spatial("s", nsp)) for _ in call.outputs]
    return " ".join(lead + _spatial("i", nsp)) + " -> " + ", ".join(outs)


@rule(["aten.batch_norm.default", "aten.instance_norm.default"], "norm")
def batch_norm(call: OpCall) -> str:
    """Per-channel statistics: channels split; the batch only outside training (stats span it)."""
    x = call.inputs[0].shape
    training = bool(
        call.arg(5, "training" if call.node.op == "aten.batch_norm.default" else "use_input_stats", True)
    )
    n = "n^" if training or call.node.op == "aten.instance_norm.default" else "n"
    rest = _spatial("s", len(x) - 2)
    ins = [" ".join([n, "c"] + rest)]
    ins += ["c" for a in call.args[1:5] if isinstance(a, Ref)]
    return ", ".join(ins) + " -> " + " ".join([n, "c"] + rest)


@rule("aten.group_norm.default", "norm", local_args=lambda a, k, s: _local_groups(a, k, s, 1, "num_groups"))
def group_norm(call: OpCall) -> str | tuple[str, dict[str, int]]:
    """Statistics per (sample, group): the batch and whole groups split ('n (g c^) s..'), each device
    normalising groups / devices of them with its slice of the per-channel weight and bias."""
    x = call.inputs[0].shape
    groups = int(call.arg(1, "num_groups", 1))
    rest = _spatial("s", len(x) - 2)
    ch = "(g c^)" if groups > 1 else "c^"
    ins = [" ".join(["n", ch] + rest)] + [ch] * (len(call.inputs) - 1)
    out = ", ".join(ins) + " -> " + " ".join(["n", ch] + rest)
    return (out, {"g": groups}) if groups > 1 else out
