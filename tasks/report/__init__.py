"""What a person reads: report.html with its plots, the comparison table and page of `flows.compare`."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "compare_html": "report",
    "compare_plot": "report",
    "compare_text": "report",
    "write_report": "report",
})
