"""``python -m experiments.netbench --help``."""

import sys

from experiments.netbench import launcher

sys.exit(launcher.main())
