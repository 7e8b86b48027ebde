"""The cluster description: nodes, devices per node, and the links between devices (YAML).

    name: 8x H100 over InfiniBand
    device: h100            # a key of nnscaler.policies.autodist.devices.DEVICES, or a mapping
                            # {name: h100, bf16_tflops: 900, ...} changing some of its figures,
                            # e.g. {name: h100, power_w: 500} or {name: a100, clock_mhz: 1200}:
                            # caps that scale the compute peak (autodist/gemm_efficiency.py)
    nodes: 8
    devices_per_node: 8
    intra_node: {bandwidth_gbs: 450, latency_us: 3}    # NVLink, per device, one direction
    inter_node: {bandwidth_gbs: 50, latency_us: 6}     # 400 Gb/s InfiniBand NIC per device
    memory_gb: 80            # optional: overrides the device table

`load_cluster('h100x8')` loads a shipped example by name (nnscaler/policies/autodist/clusters/).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import yaml

from nnscaler.errors import ConfigError
from nnscaler.policies.autodist.devices import DeviceSpec, get_device
from nnscaler.policies.autodist.yaml_files import read_yaml

__all__ = ["LinkSpec", "ClusterSpec", "CLUSTER_FIELDS", "load_cluster", "shipped_clusters"]

CLUSTER_FIELDS = ("name", "device", "nodes", "devices_per_node", "intra_node", "inter_node", "memory_gb")
"""The keys of a cluster file; any other key is refused."""


@dataclass(frozen=True)
class LinkSpec:
    """A link as the alpha-beta model sees it: time(bytes) = latency + bytes / bandwidth."""

    bandwidth_gbs: float
    """Bandwidth per device in one direction, GB/s (1e9 bytes/s)."""
    latency_us: float
    """Latency of one message, microseconds."""

    @property
    def alpha(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbs * 1e9


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links of a cluster."""

    device: DeviceSpec
    nodes: int = 1
    devices_per_node: int = 8
    intra_node: LinkSpec = field(default_factory=lambda: LinkSpec(450.0, 3.0))
    inter_node: LinkSpec = field(default_factory=lambda: LinkSpec(50.0, 6.0))
    name: str = ""

    @property
    def ndevices(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        """ "'CPU processes over gloo' (1 node x 8 cpu, 8 GB each)" for messages."""
        name = f"{self.name!r} " if self.name else ""
        return (
            f"{name}({self.nodes} node(s) x {self.devices_per_node} {self.device.name}, "
            f"{self.device.memory_gb:g} GB each)"
        )

    def link(self, group_size: int, stride: int = 1) -> LinkSpec:
        """The bottleneck link of a group of `group_size` devices `stride` apart (ranks packed by node)."""
        if (group_size - 1) * stride < self.devices_per_node:
            return self.intra_node
        return self.inter_node

    def with_devices(self, n: int) -> ClusterSpec:
        """The same cluster cut or grown to `n` devices (whole nodes where n fills them)."""
        per = min(self.devices_per_node, n)
        return replace(self, nodes=max(1, -(-n // per)), devices_per_node=per)


def _link(data: object, where: str) -> LinkSpec:
    if not isinstance(data, dict) or "bandwidth_gbs" not in data:
        raise ConfigError(
            f"cluster field {where!r} needs {{bandwidth_gbs: <GB/s>, latency_us: <us>}}, got {data!r}"
        )
    unknown = sorted(set(data) - {"bandwidth_gbs", "latency_us"})
    if unknown:
        raise ConfigError(
            f"cluster field {where!r} has unknown keys {unknown}: give only bandwidth_gbs and latency_us"
        )
    bw = _number(data, "bandwidth_gbs", float, None, where, low=0.0)
    lat = _number(data, "latency_us", float, 5.0, where, low=0.0, inclusive=True)
    return LinkSpec(bw, lat)


_DEVICE_LIMITS = {  # DeviceSpec figure -> (lowest, lowest allowed itself, highest)
    "matmul_efficiency": (0.0, False, 1.0),
    "mem_efficiency": (0.0, False, 1.0),
    "kernel_overhead_us": (0.0, True, None),
    "gemm_half_gflops": (0.0, True, None),
    "clock_mhz": (0.0, False, None),
    "power_w": (0.0, False, None),
}


def _number(
    data: dict,
    key: str,
    kind: type,
    default,
    where: str = "",
    *,
    low: float | None = None,
    inclusive: bool = False,
    high: float | None = None,
):
    """data[key] as an int or float (`default` where absent), finite, above `low` (or equal to it when
    `inclusive`) and at most `high`; ConfigError naming the field otherwise."""
    value = data.get(key, default)
    field_name = f"{where}.{key}" if where else key
    what = "an integer" if kind is int else "a number"
    try:
        if isinstance(value, (bool, str)) or (
            kind is int and isinstance(value, float) and not value.is_integer()
        ):
            raise ValueError(value)
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"cluster field {field_name!r} must be {what}, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"cluster field {field_name!r} must be a finite number, got {value!r}")
    if low is not None and (number < low or (number == low and not inclusive)):
        raise ConfigError(
            f"cluster field {field_name} must be {'>=' if inclusive else '>'} {low:g}, got {value!r}: "
            "set it to the real figure, or leave it out to take the default"
        )
    if high is not None and number > high:
        raise ConfigError(f"cluster field {field_name!r} must be <= {high:g}, got {value!r}")
    return number


def cluster_from_dict(data: dict, name: str = "") -> ClusterSpec:
    """A ClusterSpec from a parsed YAML mapping (see the module docstring)."""
    known = set(CLUSTER_FIELDS)
    unknown = sorted(set(data) - known)
    if unknown:
        close = {u: difflib.get_close_matches(u, known, 1) for u in unknown}
        hints = "".join(f" ({u!r}: did you mean {c[0]!r}?)" for u, c in close.items() if c)
        raise ConfigError(f"cluster description has unknown fields {unknown}{hints}; known: {sorted(known)}")
    if "device" not in data:
        raise ConfigError("cluster description needs 'device' (one of h100, h200, a100, mi300x, cpu)")
    dev = data["device"]
    if isinstance(dev, dict):  # a known kind with some figures changed, e.g. {name: h100, memory_gb: 94}
        fields = {f for f in DeviceSpec.__dataclass_fields__} - {"name"}
        bad = sorted(set(dev) - fields - {"name"})
        if "name" not in dev or bad:
            raise ConfigError(
                f"cluster field 'device' as a mapping needs 'name' (a known kind) and only DeviceSpec fields "
                f"{sorted(fields)}; got {dev!r}"
            )
        figures = {k: _number(dev, k, float, None, "device", **_device_limits(k)) for k in dev if k != "name"}
        device = replace(get_device(str(dev["name"])), **figures)
    else:
        device = get_device(str(dev))
    if "memory_gb" in data:
        device = replace(device, memory_gb=_number(data, "memory_gb", float, None, low=0.0))
    nodes = _number(data, "nodes", int, 1, low=1, inclusive=True)
    per = _number(data, "devices_per_node", int, 8, low=1, inclusive=True)
    if not isinstance(data.get("name", ""), str):
        raise ConfigError(f"cluster field 'name' must be a string, got {data['name']!r}")
    intra = _link(data.get("intra_node", {"bandwidth_gbs": 450.0, "latency_us": 3.0}), "intra_node")
    inter = _link(data.get("inter_node", {"bandwidth_gbs": 50.0, "latency_us": 6.0}), "inter_node")
    return ClusterSpec(device, nodes, per, intra, inter, str(data.get("name", name)))


def _device_limits(key: str) -> dict:
    low, inclusive, high = _DEVICE_LIMITS.get(key, (0.0, False, None))
    return {"low": low, "inclusive": inclusive, "high": high}


def shipped_clusters() -> list[str]:
    """Names of the example cluster files shipped with nnscaler."""
    folder = resources.files("nnscaler.policies.autodist") / "clusters"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_cluster(spec: str | Path | dict | ClusterSpec) -> ClusterSpec:
    """A cluster from a YAML path, a shipped example's name ('h100x8', 'h100x64_ib', 'cpu_gloo'), or a dict."""
    if isinstance(spec, ClusterSpec):
        return spec
    if isinstance(spec, dict):
        return cluster_from_dict(spec)
    path = Path(spec)
    if not path.exists():
        shipped = resources.files("nnscaler.policies.autodist") / "clusters" / f"{spec}.yaml"
        if not shipped.is_file():
            raise ConfigError(
                f"cluster {str(spec)!r} is neither a file nor a shipped example; shipped: {shipped_clusters()}"
            )
        return cluster_from_dict(yaml.safe_load(shipped.read_text()), str(spec))
    data = read_yaml(path, "cluster file")
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} must hold a YAML mapping, got {type(data).__name__}")
    try:
        return cluster_from_dict(data, path.stem)
    except ConfigError as exc:
        raise ConfigError(f"cluster file {path}: {exc}") from exc
