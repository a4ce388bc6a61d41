"""The old import path of ``spec_cache.cli.shared`` (the shared tier's CLI side), kept for code that imports it.
New code imports ``spec_cache.cli.shared``; this module only re-exports it and imports nothing else."""

from spec_cache.cli.shared import (
    ENV,
    PROBE_TIMEOUT_S,
    add_shared_option,
    cmd_shared_stats,
    extend_stats,
    format_health,
    register,
    shared_health,
    shared_url,
)

__all__ = ["ENV", "PROBE_TIMEOUT_S", "add_shared_option", "cmd_shared_stats", "extend_stats", "format_health",
           "register", "shared_health", "shared_url"]
