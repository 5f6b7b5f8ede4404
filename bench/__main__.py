"""``python -m bench`` from the top of a checkout: the bench shipped in the package,
nsbox/bench (also ``nsbox bench`` and ``python -m nsbox.bench``)."""

import sys

from nsbox.bench.__main__ import main

sys.exit(main())
