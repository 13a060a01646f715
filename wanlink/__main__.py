"""``python -m wanlink info``: see wanlink.about."""
import sys

from wanlink.about import main

sys.exit(main())
