"""The accuracy-budget search: which layers to keep in higher precision (restore_search), how a candidate is judged against the target (judging), and what the search aims at and judges with (goal)."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "search_goal": "goal",
    "search_margin": "goal",
})
