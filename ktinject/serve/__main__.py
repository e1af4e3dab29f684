"""``python -m ktinject.serve``: the same as ``ktinject serve`` (``ktinject.cli.serve``)."""
import sys

from ktinject.cli.serve import main

sys.exit(main())
