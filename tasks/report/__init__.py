"""What a person reads: report.html with its plots, the comparison table and page of `flows.compare`."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "compare_html": "compare",
    "compare_plot": "compare",
    "compare_text": "compare",
    "write_report": "report",
})
