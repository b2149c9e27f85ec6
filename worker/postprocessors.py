"""Model-specific postprocessors that run before quantisation (e.g. MUVERA: multivector → dense).

Each postprocessor is keyed by the option that enables it; it receives the plan and the raw
outputs of a batch and returns the outputs the client asked for.
"""

from __future__ import annotations

from typing import Any


def apply_postprocessors(plan, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    requested = plan.requested_outputs
    if "muvera" in plan.options and "dense" in requested:
        from worker.muvera import muvera_outputs

        raws = muvera_outputs(plan, raws)
    # drop intermediate outputs the client did not ask for
    return [{k: v for k, v in raw.items() if k in requested} for raw in raws]
