"""The old import path of ``spec_cache.cli.repair`` (``spec-cache repair --to DIR``), kept for code that imports
it. New code imports ``spec_cache.cli.repair``; this module only re-exports it and imports nothing else."""

from spec_cache.cli.repair import cmd_repair, register

__all__ = ["cmd_repair", "register"]
