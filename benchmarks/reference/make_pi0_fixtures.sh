#!/usr/bin/env bash
# Regenerate the pi0 / pi0.5 fixtures in assets/reference: tiny checkpoints built and run by lerobot 0.6.1.
#
# Nothing here runs in the project's venv, and no lerobot code is copied into the project: the script
# makes a throwaway venv with lerobot's pins, imports lerobot's sources from a tree you fetched yourself
# (or the release wheel, fetched here with pip), and writes only the checkpoints and what lerobot
# computed on them. No Hugging Face hub access is needed (HF_HUB_OFFLINE=1).
#
# Usage:
#   benchmarks/reference/make_pi0_fixtures.sh [LEROBOT_SRC [REFENV]]
#     LEROBOT_SRC  lerobot at tag v0.6.1 (7e241bd): a checkout (its root or src/), or any directory
#                  holding lerobot/. Empty or left out: `pip download lerobot==0.6.1` (the release
#                  wheel, no dependencies; its .py files are those of the tag) into a temp dir
#     REFENV       the throwaway venv (default /tmp/lerobot-refenv; reused when it exists)
#   e.g. git clone https://github.com/huggingface/lerobot && git -C lerobot checkout v0.6.1
#
# lerobot 0.6.1 needs Python >= 3.12; pi0_fixtures.py imports it on 3.11 (see its docstring for the
# two syntax-only rewrites and the stubs). Python 3.12 works too.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
src="${1:-}"
refenv="${2:-/tmp/lerobot-refenv}"

if [ ! -x "$refenv/bin/python" ]; then
  python3 -m venv "$refenv"
  # lerobot's pins: transformers-dep ">=5.4.0,<5.6.0", draccus ">=0.11.6,<0.12.0", einops ">=0.8,<0.9",
  # numpy ">=2.0,<2.3"; torch: lerobot says <2.12, this machine has 2.13.0+cpu (the project's)
  "$refenv/bin/pip" install -q torch==2.13.0 transformers==5.5.4 safetensors "numpy>=2.0,<2.3" \
    "draccus>=0.11.6,<0.12" "einops>=0.8,<0.9"
fi

if [ -z "$src" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$refenv/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 lerobot==0.6.1 -d "$tmp"
  "$refenv/bin/python" -m zipfile -e "$tmp"/lerobot-0.6.1-py3-none-any.whl "$tmp/src"
  src="$tmp/src"
fi

cd "$repo"
HF_HUB_OFFLINE=1 "$refenv/bin/python" "$here/pi0_fixtures.py" all --src "$src" --out assets/reference
# the same checkpoints and inputs run with lerobot's dtype="bfloat16": <name>_bf16_outputs.npz
HF_HUB_OFFLINE=1 "$refenv/bin/python" "$here/pi0_fixtures.py" all --dtype bfloat16 --src "$src" --out assets/reference
HF_HUB_OFFLINE=1 "$refenv/bin/python" "$here/pi0_fixtures.py" layouts --src "$src" --out assets/reference
# pi0_tiny_odd / pi05_tiny_odd: every setting unlike lerobot's defaults, a BPE tokenizer saved in each directory
HF_HUB_OFFLINE=1 "$refenv/bin/python" "$here/pi0_odd_fixtures.py" all --src "$src" --out assets/reference
du -ch assets/reference/pi0*_tiny* | tail -1
