"""``python -m spec_cache`` runs the same CLI as the ``spec-cache`` script."""

from spec_cache.apps.cli import main

raise SystemExit(main())
