"""``python -m warsha``: the same as the ``warsha`` console script."""

from warsha.cli import main

raise SystemExit(main())
