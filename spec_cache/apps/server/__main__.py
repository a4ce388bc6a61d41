import sys

from spec_cache.apps.server.cli import run_module

sys.exit(run_module())
