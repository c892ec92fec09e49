"""A traffic proposal shown and written: the picture of the requests and profiles, the text, and the model YAML's
``profiles:`` block."""
from __future__ import annotations

from pathlib import Path

from tasks.data.proposal import Proposal
from tasks.data.traffic import Traffic, serving, varying_dims


def plot(traffic: Traffic, proposal: Proposal, path: Path) -> Path | None:
    """The requests (area ~ count) over the two dims that vary most after the leading one (the batch, usually), one
    panel per value of the leading dim, with each profile's box and opt (x); outliers in red."""
    lead = varying_dims(traffic, top=None, order="input")[:1]
    rest = [d for d in varying_dims(traffic, top=None) if d not in lead]
    if len(rest) < 2 and lead:  # too few other dims: the leading one is an axis too
        rest, lead = (rest + lead)[:2], []
    if not rest:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457"]
    (nx, dx), (ny, dy) = rest[0], (rest[1] if len(rest) > 1 else (None, None))
    leads = sorted({tuple(s[n][d] for n, d in lead) for s in traffic.shapes})[:6]
    fig, axes = plt.subplots(1, len(leads), figsize=(4.2 * len(leads) + 1, 4.6), squeeze=False, sharey=True)
    cmax = max(traffic.counts)
    which = [serving(proposal.profiles, s) for s in traffic.shapes]
    for ax, lv in zip(axes[0], leads):
        idx = [i for i, s in enumerate(traffic.shapes) if tuple(s[n][d] for n, d in lead) == lv]
        ys = [traffic.shapes[i][ny][dy] if ny else 0 for i in idx]
        ax.scatter([traffic.shapes[i][nx][dx] for i in idx], ys,
                   s=[10 + 300 * traffic.counts[i] / cmax for i in idx], alpha=0.55, edgecolors="none",
                   c=[colors[which[i] % len(colors)] if which[i] is not None else "#c62828" for i in idx])
        for k, p in enumerate(proposal.profiles):
            if lead and not all(p[n]["min"][d] <= v <= p[n]["max"][d] for (n, d), v in zip(lead, lv)):
                continue
            col = colors[k % len(colors)]
            x0, x1 = p[nx]["min"][dx], p[nx]["max"][dx]
            y0, y1 = (p[ny]["min"][dy], p[ny]["max"][dy]) if ny else (-0.5, 0.5)
            ax.add_patch(Rectangle((x0, y0), max(x1 - x0, 1), max(y1 - y0, 1), fill=False, lw=1.8, ec=col,
                                   label=f"profile {k}: {proposal.per_profile[k]} requests"))
            ax.plot([p[nx]["opt"][dx]], [p[ny]["opt"][dy] if ny else 0], marker="x", ms=11, mew=2.5, color=col)
        ax.set_title(", ".join(f"{n}[{d}] = {v}" for (n, d), v in zip(lead, lv)) or "requests", fontsize=9)
        ax.set_xlabel(f"{nx}[{dx}]")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel(f"{ny}[{dy}]" if ny else "")
    n_out = sum(o["count"] for o in proposal.outliers)
    fig.suptitle(f"traffic: {proposal.requests} requests (area ~ count), {proposal.coverage:.2%} covered by "
                 f"{len(proposal.profiles)} profile(s), x = opt" + (f"; {n_out} outliers in red" if n_out else ""),
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def describe(p: Proposal) -> str:
    """The proposal as text: profiles with their coverage, the outliers, the objective per K and why this K."""
    lines = [f"{p.requests} requests; {p.covered} covered ({p.coverage:.3%}) by {len(p.profiles)} profile(s); cost: "
             f"{p.cost_how}"]
    for k, prof in enumerate(p.profiles):
        act = p.activation_mib[k] if k < len(p.activation_mib) else None
        lines.append(f"  profile {k}: {p.per_profile[k]} requests"
                     + (f", ~{act:.0f} MiB activations at max" if act is not None else ""))
        for n, r in prof.items():
            lines.append(f"    {n}: min {r['min']} opt {r['opt']} max {r['max']}")
    if p.outliers:
        lines.append(f"  outliers ({sum(o['count'] for o in p.outliers)} requests, left out):")
        for o in p.outliers[:10]:
            lines.append("    " + ", ".join(f"{k}={v}" for k, v in o.items()))
        if len(p.outliers) > 10:
            lines.append(f"    ... and {len(p.outliers) - 10} more")
    if p.objective:
        lines.append("  objective (mean |log(cost / opt cost)|) by number of profiles: "
                     + ", ".join(f"{k}: {v:.3f}" for k, v in p.objective.items()))
    if p.opt_distance is not None:
        lines.append(f"  mean distance of a request to its profile's opt: {p.opt_distance:.1%} of the opt's cost")
    lines.append(f"  why: {p.k_reason}")
    return "\n".join(lines)


def yaml_fragment(profiles: list[dict]) -> str:
    """``profiles:`` in the model YAML's style, one flow mapping per input."""
    out = ["profiles:"]
    for p in profiles:
        first = True
        for n, r in p.items():
            out.append(f"  {'- ' if first else '  '}{n}: {{min: {r['min']}, opt: {r['opt']}, max: {r['max']}}}")
            first = False
    return "\n".join(out) + "\n"


def write_profiles(model_yaml: Path, profiles: list[dict]) -> None:
    """Replace (or add) the top-level ``profiles:`` block of a model YAML, keeping every other line as it is."""
    lines = model_yaml.read_text().splitlines()
    out, skip = [], False
    for line in lines:
        if line.startswith("profiles:"):
            skip = True
            continue
        if skip and (line.startswith((" ", "-", "\t")) or not line.strip()):
            continue
        skip = False
        out.append(line)
    text = "\n".join(out).rstrip("\n") + "\n" + yaml_fragment(profiles)
    model_yaml.write_text(text)

