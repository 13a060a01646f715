"""Make the repository's `bench` package (it is not installed with wanlink) and netns_helpers importable."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parents[1]), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
