"""The accuracy-budget search: which layers to keep in higher precision (restore_search), and how a candidate is judged against the target (judging)."""
