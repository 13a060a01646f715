"""A directory to put first on PYTHONPATH so that importing a named module fails, as on a plain install."""
from pathlib import Path


def blocking_path(where: Path, module: str) -> Path:
    """Returns a directory in which ``import module`` raises ImportError."""
    package = where / f"block-{module}" / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError('{module} is not part of a plain wanlink install')\n")
    return package.parent
