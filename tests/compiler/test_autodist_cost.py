"""autodist's device table, cluster files, alpha-beta collectives, resharding and memory models,
checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from nnscaler.errors import ConfigError
from nnscaler.graph.ir import Partial, Replicate, Shard
from nnscaler.policies.autodist import DEVICES, get_device, load_cluster, shipped_clusters
from nnscaler.policies.autodist.cluster import LinkSpec
from nnscaler.policies.autodist.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    reduce_scatter,
    ring_all_reduce,
    send_recv,
    tree_all_reduce,
)
from nnscaler.policies.autodist.cost import CostContext, node_flops, reshard_time
from nnscaler.policies.autodist.memory import MemoryModel

LINK = LinkSpec(bandwidth_gbs=100.0, latency_us=10.0)  # alpha = 1e-5 s, beta = 1e11 B/s


def test_device_table():
    assert set(DEVICES) >= {"h100", "h200", "a100", "mi300x", "cpu"}
    h100 = get_device("H100_SXM")
    assert (h100.bf16_tflops, h100.fp32_tflops, h100.mem_bw_gbs, h100.memory_gb) == (
        989.0,
        67.0,
        3350.0,
        80.0,
    )
    assert get_device("h200").memory_gb == 141.0 and get_device("a100").bf16_tflops == 312.0
    assert get_device("mi300x").memory_gb == 192.0
    assert h100.tflops("torch.bfloat16") == 989.0 and h100.tflops("float32") == 67.0
    with pytest.raises(ConfigError, match="unknown device 'tpu'.*h100"):
        get_device("tpu")


def test_shipped_clusters():
    assert shipped_clusters() == ["cpu_gloo", "h100x256_ib", "h100x64_ib", "h100x8"]
    one = load_cluster("h100x8")
    assert one.ndevices == 8 and one.device.name == "h100" and one.link(8) == one.intra_node
    many = load_cluster("h100x64_ib")
    assert many.ndevices == 64 and many.inter_node.bandwidth_gbs == 50.0  # 400 Gb/s per GPU
    assert many.link(8) == many.intra_node  # tensor parallel inside a node
    assert many.link(8, stride=8) == many.inter_node  # data parallel across nodes
    assert load_cluster("cpu_gloo").device.name == "cpu"


def test_cluster_file_and_errors(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "device: {name: h100, memory_gb: 94}\nnodes: 2\ndevices_per_node: 4\n"
        "intra_node: {bandwidth_gbs: 300, latency_us: 2}\ninter_node: {bandwidth_gbs: 25, latency_us: 8}\n"
    )
    c = load_cluster(str(path))
    assert (c.ndevices, c.device.memory_gb, c.intra_node, c.inter_node) == (
        8,
        94.0,
        LinkSpec(300.0, 2.0),
        LinkSpec(25.0, 8.0),
    )
    assert c.link(4) == c.intra_node and c.link(5) == c.inter_node
    with pytest.raises(ConfigError, match="needs 'device'"):
        load_cluster({"nodes": 1})
    with pytest.raises(ConfigError, match=r"unknown fields \['gpus'\]"):
        load_cluster({"device": "h100", "gpus": 8})
    with pytest.raises(ConfigError, match="bandwidth_gbs must be > 0"):
        load_cluster({"device": "h100", "intra_node": {"bandwidth_gbs": 0}})


def test_collective_formulas():
    gb = 1e9
    assert ring_all_reduce(gb, 4, LINK) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * gb / 1e11)  # 0.01506
    assert tree_all_reduce(gb, 4, LINK) == pytest.approx(2 * 2 * 1e-5 + 2 * gb / 1e11)  # 0.02004
    assert all_reduce(gb, 4, LINK) == pytest.approx(0.01506)  # big message: ring
    assert all_reduce(8, 8, LINK) == pytest.approx(tree_all_reduce(8, 8, LINK))  # small: tree
    assert tree_all_reduce(8, 8, LINK) == pytest.approx(6e-5 + 16 / 1e11)
    assert all_gather(gb, 4, LINK) == pytest.approx(3e-5 + 0.75 * 0.01)
    assert reduce_scatter(gb, 4, LINK) == all_gather(gb, 4, LINK)
    assert all_to_all(gb, 4, LINK) == pytest.approx(3e-5 + 0.75 * 0.01)
    assert send_recv(gb, 2, LINK) == pytest.approx(1e-5 + 0.01)
    assert all_reduce(gb, 1, LINK) == all_gather(gb, 1, LINK) == 0.0


def test_reshard_times():
    ctx = CostContext(
        load_cluster({"device": "h100", "intra_node": {"bandwidth_gbs": 100, "latency_us": 10}}), ways=4
    )
    b = 4e8
    ag, ar = all_gather(b, 4, LINK), all_reduce(b, 4, LINK)
    # forward a local slice; backward gathers the gradient
    assert reshard_time(Replicate(), Shard(0), b, ctx, True, True) == pytest.approx(ag)
    assert reshard_time(Replicate(), Shard(0), b, ctx, True, False) == 0.0
    # a split consumer of a replicated input returns partial gradients: all-reduce in backward
    assert reshard_time(Replicate(), Replicate(), b, ctx, True, True) == pytest.approx(ar)
    assert reshard_time(Replicate(), Replicate(), b, ctx, True, True, shared_grad_reduce=True) == 0.0
    assert reshard_time(Replicate(), Replicate(), b, ctx, False, True) == 0.0
    assert reshard_time(Partial(), Replicate(), b, ctx, False, True) == pytest.approx(ar)
    assert reshard_time(Partial(), Shard(1), b, ctx, True, True) == pytest.approx(2 * ag)
    assert reshard_time(Shard(0), Replicate(), b, ctx, False, True) == pytest.approx(ag)
    assert reshard_time(Shard(0), Replicate(), b, ctx, True, True) == pytest.approx(2 * ag)
    assert reshard_time(Shard(0), Shard(1), b, ctx, True, True) == pytest.approx(
        2 * all_to_all(b / 4, 4, LINK)
    )
    assert reshard_time(Shard(1), Shard(1), b, ctx, True, True) == 0.0
    assert math.isinf(reshard_time(Replicate(), Partial(), b, ctx, True, True))
    fwd = CostContext(ctx.cluster, ways=4, training=False)
    assert reshard_time(Shard(0), Shard(1), b, fwd, True, True) == pytest.approx(all_to_all(b / 4, 4, LINK))


@pytest.mark.parametrize("stage,expected", [(0, 400.0), (1, 250.0), (2, 175.0), (3, 100.0)])
def test_memory_by_zero_stage(stage, expected):
    """100 bytes of fp32 weights, Adam (2 moments), 4 data-parallel replicas."""
    ctx = CostContext(load_cluster("h100x8"), dp_size=4)
    assert MemoryModel(stage).param_state_bytes(100.0, ctx) == pytest.approx(expected)


def test_memory_mixed_precision_and_inference():
    ctx = CostContext(load_cluster("h100x8"))
    # bf16 weights 100 B + grads 100 B + fp32 master 200 B + two fp32 moments 400 B
    assert MemoryModel(0, mixed_precision=True).param_state_bytes(100.0, ctx) == pytest.approx(800.0)
    assert MemoryModel(0).param_state_bytes(100.0, CostContext(ctx.cluster, training=False)) == 100.0


def test_grad_sync_time():
    c = load_cluster("h100x64_ib")
    ctx = CostContext(c, dp_size=8, dp_stride=8)  # one device per node; bucketed: no per-tensor latency
    c = type(c)(
        c.device, c.nodes, c.devices_per_node, c.intra_node, LinkSpec(c.inter_node.bandwidth_gbs, 0.0)
    )
    assert MemoryModel(0).grad_sync_time(1e9, ctx) == pytest.approx(all_reduce(1e9, 8, c.inter_node))
    z = MemoryModel(1).grad_sync_time(1e9, ctx)
    assert z == pytest.approx(reduce_scatter(1e9, 8, c.inter_node) + all_gather(1e9, 8, c.inter_node))


def test_node_flops(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    q = next(n for n in graph.nodes if n.module_path == "model.layers.0.self_attn.q_proj")
    assert node_flops(q, graph) == 2 * 4 * 16 * 64 * 64  # batch 4, seq 16, 64 -> 64
    sdpa = next(n for n in graph.nodes if "scaled_dot_product_attention" in n.op)
    assert node_flops(sdpa, graph) == 2 * (4 * 4 * 16 * 16) * 16 * 2  # QK^T and AV, 4 heads of 16


def test_addmm_flops_count_the_contracted_dim(zoo_graphs):
    graph = zoo_graphs["gpt2"][0]
    addmm = next(n for n in graph.nodes if n.op == "aten.addmm.default")  # c_attn: (64, 64) @ (64, 192)
    assert node_flops(addmm, graph) == 2 * 64 * 192 * 64


def test_flops_follow_a_smaller_micro_batch(zoo_graphs):
    """A micro-batch half the traced one halves a linear's compute (its weight does not scale)."""
    from nnscaler.policies.autodist.choices import node_choices

    graph = zoo_graphs["llama"][0]
    q = next(n for n in graph.nodes if n.module_path == "model.layers.0.self_attn.q_proj")
    cluster = load_cluster({"device": {"name": "cpu", "mem_bw_gbs": 1e6, "kernel_overhead_us": 0}})
    full = CostContext(cluster, traced_batch=4)
    half = CostContext(cluster, traced_batch=4, batch_scale=0.5)
    t_full = node_choices(graph, q, full, MemoryModel(), set()).choices[0].compute
    t_half = node_choices(graph, q, half, MemoryModel(), set()).choices[0].compute
    assert t_half == pytest.approx(t_full / 2)


def test_views_keep_no_activation_of_their_own(zoo_graphs):
    """A view shares its input's storage (counted where the input was made); an op that computes a
    new tensor keeps its output for backward."""
    from nnscaler.policies.autodist.choices import node_choices
    from nnscaler.policies.autodist.cost import is_free_op

    graph = zoo_graphs["llama"][0]
    ctx = CostContext(load_cluster("cpu_gloo"), traced_batch=4)
    views = [n for n in graph.nodes if n.op in ("aten.view.default", "aten.transpose.int")]
    assert views and all(is_free_op(n, graph) for n in views)
    for node in views:
        assert node_choices(graph, node, ctx, MemoryModel(), set()).choices[0].activation_bytes == 0
    q = next(n for n in graph.nodes if n.module_path == "model.layers.0.self_attn.q_proj")
    # q_proj's output only feeds the rotary mul (which saves cos, not q) and a cat: nothing kept
    # (saved_tensors.py); the norm output q, k and v read is kept once, by the node making it
    assert node_choices(graph, q, ctx, MemoryModel(), set()).choices[0].activation_bytes == 0
    norm = next(n for n in graph.nodes if q.input_names()[0] in n.outputs)
    kept = node_choices(graph, norm, ctx, MemoryModel(), set()).choices[0].activation_bytes
    assert kept == 4 * 16 * 64 * 4  # its (4, 16, 64) float32 output
