"""Model-specific postprocessors that run before quantisation (e.g. MUVERA: multivector → dense).

Each postprocessor is keyed by the option that enables it; it receives the plan and the raw
outputs of a batch and returns the outputs the client asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def matryoshka(raws: list[dict[str, Any]], dim: int, normalize: bool) -> list[dict[str, Any]]:
    """Keep the first ``dim`` dense components (Matryoshka-trained models put the most
    information first) and re-normalise, so cosine and dot product stay what they were."""
    out = []
    for raw in raws:
        dense = raw.get("dense")
        if dense is not None:
            dense = np.asarray(dense, dtype=np.float32)[..., :dim]
            if normalize:
                dense = dense / max(float(np.linalg.norm(dense)), 1e-12)
            raw = {**raw, "dense": dense}
        out.append(raw)
    return out


def apply_postprocessors(plan, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    requested = plan.requested_outputs
    if "muvera" in plan.options and "dense" in requested:
        from worker.muvera import muvera_outputs

        raws = muvera_outputs(plan, raws)
    if plan.options.get("output_dim") is not None and "dense" in requested:
        raws = matryoshka(raws, int(plan.options["output_dim"]), bool(plan.options.get("normalize", True)))
    # drop intermediate outputs the client did not ask for
    return [{k: v for k, v in raw.items() if k in requested} for raw in raws]
