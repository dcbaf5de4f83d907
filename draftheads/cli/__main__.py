"""``python -m draftheads.cli``: the ``draftheads`` command."""
from . import main

raise SystemExit(main())
