"""What the calibrate stage says about layers its data left unquantized."""
from __future__ import annotations


def unreached_warning(segments: list[dict]) -> str | None:
    """The layers no calibration sample reaches (computed from constants alone), named; None when there are none."""
    unreached = [n for seg in segments for n in seg.get("unreached_by_data") or []]
    if not unreached:
        return None
    return (f"{len(unreached)} layer{'s' if len(unreached) > 1 else ''} left unquantized: no calibration sample reaches "
            f"{'them' if len(unreached) > 1 else 'it'} (computed from constants alone: {', '.join(unreached[:4])}"
            f"{' …' if len(unreached) > 4 else ''})")
