"""Cut a graph into consecutive pieces (pipeline stages): what each piece reads from earlier pieces,
what it must hand to later ones, and each piece as a Graph of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnscaler.graph.ir.graph import Graph, Node, Ref, Value

__all__ = ["Piece", "cut_graph"]


@dataclass
class Piece:
    """Nodes [start, end) of a graph as a Graph whose inputs are the values it receives.

    received: activations produced by earlier pieces, in the order the piece receives them (the
      activations alive at its start that it or a later piece still reads, or that the graph returns).
    sent: what it hands on (for the last piece: the graph's flat outputs, which may be constants).
    graph_inputs: forward inputs (of the whole graph) it reads itself.
    params: parameters and buffers it reads.
    """

    index: int
    start: int
    end: int
    graph: Graph
    received: list[str] = field(default_factory=list)
    sent: list = field(default_factory=list)
    graph_inputs: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)


def cut_graph(graph: Graph, starts: list[int]) -> list[Piece]:
    """Pieces beginning at node indices `starts` (the first must be 0, increasing).

    Activations that skip a piece are relayed through it: a piece receives everything alive at its
    start that a later node or the graph's output needs, and sends on everything alive at its end.
    """
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"piece starts must begin at 0 and increase, got {starts}")
    if starts[-1] >= len(graph.nodes):
        raise ValueError(f"piece start {starts[-1]} is past the last node ({len(graph.nodes)} nodes)")
    bounds = list(zip(starts, starts[1:] + [len(graph.nodes)]))
    producer_piece: dict[str, int] = {}
    for p, (a, b) in enumerate(bounds):
        for node in graph.nodes[a:b]:
            for out in node.outputs:
                producer_piece[out] = p
    last_piece_reading: dict[str, int] = {}
    for p, (a, b) in enumerate(bounds):
        for node in graph.nodes[a:b]:
            for name in node.input_names():
                last_piece_reading[name] = p
    final = len(bounds)  # the graph's outputs are read "after" the last piece
    for name in graph.output_names():
        last_piece_reading[name] = final

    def alive_between(p: int) -> list[str]:
        """Activations made before piece p and read at or after it, in production order."""
        out = []
        for node in graph.nodes[: bounds[p][0]]:
            for name in node.outputs:
                if last_piece_reading.get(name, -1) >= p:
                    out.append(name)
        return out

    pieces = []
    for p, (a, b) in enumerate(bounds):
        nodes = graph.nodes[a:b]
        received = alive_between(p) if p > 0 else []
        if p + 1 < len(bounds):
            sent: list = [Ref(n) for n in alive_between(p + 1)]
        else:
            sent = list(graph.outputs)
        reads = list(dict.fromkeys(name for n in nodes for name in n.input_names()))
        graph_inputs = [n for n in graph.inputs if n in reads]
        params = [n for n in reads if graph.values[n].kind in ("param", "buffer")]
        pieces.append(
            Piece(
                p,
                a,
                b,
                _piece_graph(graph, nodes, received, graph_inputs, params, sent),
                received,
                sent,
                graph_inputs,
                params,
            )
        )
    return pieces


def _piece_graph(
    graph: Graph,
    nodes: list[Node],
    received: list[str],
    graph_inputs: list[str],
    params: list[str],
    sent: list,
) -> Graph:
    values: dict[str, Value] = {}
    for name in graph_inputs + params:
        values[name] = graph.values[name]
    for name in received:
        v = graph.values[name]
        values[name] = Value(name, v.meta, "input", None, name)
    for node in nodes:
        for name in node.input_names():
            if name not in values:  # defined earlier in this piece, or a non-tensor value
                values[name] = graph.values[name]
        for name in node.outputs:
            values[name] = graph.values[name]
    inputs = received + graph_inputs
    return Graph(
        values=values,
        nodes=list(nodes),
        inputs=inputs,
        forward_args=list(inputs),
        outputs=list(sent),
        module_class=graph.module_class,
        module_classes=dict(graph.module_classes),
        input_leaves=list(inputs),
    )
