"""What the export stage says about a model specialised for model.constants."""
from __future__ import annotations

from tasks.sources.export import constants_text


def constants_warnings(constants: dict, folded: list[str]) -> list[str]:
    """The engine's specialisation for the bound inputs, then the warnings among the fold's notes (``folded``: the
    export's "constants" details)."""
    return [f"the engine is specialised for {constants_text(constants)} (model.constants): those inputs are gone, "
            "and the fp32 reference is the model with them bound",
            *(n[len("WARNING: "):] for n in folded if n.startswith("WARNING: "))]
