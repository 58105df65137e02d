"""The profile's picture: a bar chart of time share by role (prefill, decode, weighted workload)."""

from __future__ import annotations

import io
from typing import Any

from opus.profiling import PHASES, ROLES


def plot_profile(profile: dict[str, Any]) -> bytes:
    """A PNG bar chart of time share by role for prefill, decode and the weighted workload."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    series = {p: profile[p]["shares"] for p in PHASES if profile.get(p)}
    series["workload"] = {role: g["share"] for role, g in profile["groups"].items()}
    roles = [r for r in ROLES if any(s.get(r, 0) > 0 for s in series.values())] or list(ROLES)
    fig = Figure(figsize=(7, 0.18 * len(roles) * len(series) + 1.4), dpi=100)
    ax = fig.add_subplot()
    height = 0.8 / len(series)
    for i, (label, shares) in enumerate(series.items()):
        ys = [j + i * height for j in range(len(roles))]
        ax.barh(ys, [100 * shares.get(r, 0.0) for r in roles], height=height, label=label)
    ax.set_yticks([j + height * (len(series) - 1) / 2 for j in range(len(roles))], roles)
    ax.invert_yaxis()
    ax.set_xlabel("share of time (%)")
    work = profile["workload"]
    ax.set_title(f"Time by role — batch {work['batch_size']}, input {work['input_len']}, "
                 f"{work['output_len']} decode steps")
    ax.legend(loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
