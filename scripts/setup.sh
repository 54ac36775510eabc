#!/usr/bin/env bash
# Idempotent set-up for embodied on Debian/Ubuntu with Python 3.11.
#   scripts/setup.sh [EXTRAS]
# EXTRAS defaults to "maniskill,vla,mujoco,warp,libero,real,ray,megatron,dev".
# 1. System: ManiSkill (SAPIEN) needs a Vulkan device even for state observations. Without an
#    NVIDIA GPU that is Mesa's lavapipe, and only Mesa >= 24.3 works (Debian 12 ships 22.3), so
#    Mesa comes from bookworm-backports there.
# 2. Python: a virtual environment in .venv with the CPU build of torch installed *first*
#    (an unpinned torch pulls several GB of CUDA packages), then this package and its extras.
# 3. With the dev extra: Chromium, in which a test loads a run's report.html.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-maniskill,vla,mujoco,warp,libero,real,ray,megatron,dev}"
VENV="${EMBODIED_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

log() { printf '[setup] %s\n' "$*"; }
# pip warns once per package about this machine's file:// extra indexes; keep real errors only
quiet_pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "neither a file nor a directory" >&2); }

mesa_ok() {  # true when lavapipe from Mesa >= 24.3 is installed
  local v
  v=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null) || return 1
  dpkg --compare-versions "$v" ge 24.3 && dpkg-query -W libvulkan1 >/dev/null 2>&1
}

install_mesa() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    log "NVIDIA GPU found: using its Vulkan driver"; return
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get: install Mesa >= 24.3 (lavapipe) and libvulkan1 yourself"; return
  fi
  if mesa_ok; then
    log "Mesa lavapipe $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers) present"; return
  fi
  local codename; codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  if [ "$codename" = bookworm ]; then
    local src=/etc/apt/sources.list.d/embodied-backports.sources
    if [ ! -f "$src" ]; then
      # Copy the machine's own Debian entry (same mirror and keyring) with the backports suite.
      local uris keyring
      local debian=/etc/apt/sources.list.d/debian.sources
      uris=$(awk '/^URIs:/ && /debian\/?$/ {print $2; exit}' "$debian" 2>/dev/null || true)
      keyring=$(awk '/^Signed-By:/ {print $2; exit}' "$debian" 2>/dev/null || true)
      uris=${uris:-http://deb.debian.org/debian}
      keyring=${keyring:-/usr/share/keyrings/debian-archive-keyring.gpg}
      log "adding $src ($uris bookworm-backports)"
      printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
        "$uris" "$keyring" | $SUDO tee "$src" >/dev/null
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports \
      mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 \
      >/dev/null
  fi
  if ! mesa_ok; then
    log "Mesa >= 24.3 could not be installed; ManiSkill will not find a Vulkan device"; exit 1
  fi
  log "Mesa lavapipe $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers) installed"
}

install_egl() {  # MuJoCo renders offscreen through EGL (Mesa's llvmpipe on a CPU machine)
  if dpkg-query -W libegl1 libegl-mesa0 >/dev/null 2>&1; then return; fi
  if ! command -v apt-get >/dev/null 2>&1; then return; fi
  log "installing libegl1 libegl-mesa0 (MuJoCo offscreen rendering)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libegl1 libegl-mesa0 >/dev/null
}

install_chromium() {  # the tests load a run's report.html in a real headless browser
  if command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then return; fi
  log "installing chromium (the report test's headless browser)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
}

install_python() {
  [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    log "installing torch==2.13.0 (CPU build where no GPU)"
    quiet_pip install -q "torch==2.13.0"
  fi
  # Re-install only when pyproject.toml changed since the last successful install.
  local stamp
  stamp="$VENV/.embodied-$(echo "$EXTRAS" | tr ',' '-')-$(sha1sum pyproject.toml | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    log "installing embodied[$EXTRAS]"
    quiet_pip install -q -e ".[$EXTRAS]"
    case ",$EXTRAS," in *,libero,*)  # see the libero extra in pyproject.toml
      quiet_pip install -q --no-deps "hf-libero==0.1.4" "bddl==1.0.1" ;; esac
    case ",$EXTRAS," in *,real,*)  # see the real extra in pyproject.toml
      quiet_pip install -q --no-deps "lerobot==0.4.4" ;; esac
    touch "$stamp"
  fi
  local torch_version
  torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  log "python ready: $VENV (torch $torch_version)"
}

warm_warp() {  # MuJoCo Warp's kernels into Warp's cache (~/.cache/warp): compiled once, not per run
  local stamp="$VENV/.embodied-warp-warm-$(sha1sum simulators/mujoco/*.py | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return
  log "compiling MuJoCo Warp's kernels for the MuJoCo tasks (once; ~2 minutes on 2 cores)"
  "$VENV/bin/python" -m embodied.simulators.mujoco.warm && touch "$stamp"
}

case ",$EXTRAS," in *,maniskill,*) install_mesa ;; esac
case ",$EXTRAS," in *,mujoco,*|*,libero,*|*,warp,*) install_egl ;; esac
case ",$EXTRAS," in *,dev,*) install_chromium ;; esac
install_python
case ",$EXTRAS," in *,warp,*) warm_warp ;; esac
