"""Shared by every subject: the error family (each message says how to fix it), files and hashes, the files and libraries a stage's output depends on, native-output capture, the user's own modules, latency statistics, a build's resident memory and its budget."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "AccuracyError": "errors",
    "ConfigError": "errors",
    "MemoryBudgetError": "memory",
    "MemoryWatch": "memory",
    "STAGE_LIBRARIES": "deps",
    "SegmentBuildError": "errors",
    "StageError": "errors",
    "StageResult": "util",
    "TrtforgeError": "errors",
    "UnavailableError": "errors",
    "all_stage_libraries": "deps",
    "budget_from_config": "memory",
    "cause": "errors",
    "changed": "deps",
    "host_total_mib": "memory",
    "library_versions": "deps",
    "merge_deps": "deps",
    "quiet_native": "native",
    "recording": "deps",
    "sha256_file": "util",
    "sha256_json": "util",
    "write_json": "util",
})
