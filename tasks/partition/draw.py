"""partition.png: the partitioned graph laid out by depth, each TensorRT subgraph in its own colour, native nodes in
red."""
from __future__ import annotations

from pathlib import Path

from tasks.partition.segments import Segment


def draw_partition(model, segments: list[Segment], path: Path) -> Path:
    """The graph laid out by depth, TensorRT islands in greens/blues, native nodes in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = model.graph
    producer = {o: i for i, n in enumerate(g.node) for o in n.output}
    depth = [0] * len(g.node)
    for i, n in enumerate(g.node):
        depth[i] = 1 + max((depth[producer[x]] for x in n.input if x in producer), default=-1)
    seg_of = {i: s for s in segments for i in s.nodes}
    rows: dict[int, int] = {}
    pos = []
    for i in range(len(g.node)):
        r = rows.get(depth[i], 0)
        rows[depth[i]] = r + 1
        pos.append((depth[i], r))
    width = max(6.0, min(40.0, (max(depth, default=0) + 1) * 0.12))
    height = max(3.0, min(20.0, max(rows.values(), default=1) * 0.4 + 1.5))
    fig, ax = plt.subplots(figsize=(width, height))
    palette = ["#2e7d32", "#1565c0", "#00838f", "#558b2f", "#283593"]
    for i, n in enumerate(g.node):
        for x in n.input:
            if x in producer:
                a, b = pos[producer[x]], pos[i]
                ax.plot([a[0], b[0]], [a[1], b[1]], color="#bbbbbb", lw=0.4, zorder=1)
    trt_ids = [s.index for s in segments if s.kind == "trt"]
    for i, (x, y) in enumerate(pos):
        s = seg_of[i]
        color = "#c62828" if s.kind == "native" else palette[trt_ids.index(s.index) % len(palette)]
        ax.scatter([x], [y], s=18 if s.kind == "trt" else 40, color=color, zorder=2,
                   marker="o" if s.kind == "trt" else "s")
        if s.kind == "native":
            ax.annotate(g.node[i].op_type, (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7, color=color)
    ax.set_title(f"partition: {len(trt_ids)} TensorRT subgraph(s) (green/blue), "
                 f"{sum(len(s.nodes) for s in segments if s.kind == 'native')} native node(s) (red)")
    ax.set_xlabel("depth (topological)")
    ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
