import sys

from .cli import run_module

sys.exit(run_module())
