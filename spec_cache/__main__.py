"""``python -m spec_cache`` runs the same CLI as the ``spec-cache`` script."""

from spec_cache.cli import main

raise SystemExit(main())
