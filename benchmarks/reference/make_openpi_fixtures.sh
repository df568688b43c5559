#!/usr/bin/env bash
# Regenerate the openpi pi0 / pi0.5 fixtures in assets/reference (openpi_pi0_tiny, openpi_pi05_tiny and
# their _outputs.npz): tiny checkpoints built and run by openpi's own PyTorch model
# (src/openpi/models_pytorch/pi0_pytorch.py), saved as openpi's examples/convert_jax_model_to_pytorch.py
# saves a converted checkpoint.
#
# Nothing here runs in the project's venv, and no openpi code is copied into the project: the script
# makes a throwaway venv with openpi's PyTorch pins (transformers 4.53.2, with openpi's
# transformers_replace files copied over the installed package, as openpi's README says), and
# openpi_fixtures.py imports openpi from the source tree you give it (no jax / flax: see its docstring
# for the two stub modules and the size patches). No Hugging Face hub access is needed.
#
# Usage:
#   benchmarks/reference/make_openpi_fixtures.sh OPENPI_SRC [REFENV]
#     OPENPI_SRC  an openpi checkout (its root or src/); the committed fixtures were built from
#                 Physical-Intelligence/openpi 15a9616a00943ada6c20a0f158e3adb39df2ccac, e.g.
#                 git clone https://github.com/Physical-Intelligence/openpi && git -C openpi checkout 15a9616
#     REFENV      the throwaway venv (default /tmp/openpi-refenv; reused when it exists). Its
#                 transformers package is patched in place, so do not share it with other work.
#
# openpi pins torch 2.7.1 and numpy < 2; this machine's torch is 2.13.0+cpu (the project's) and numpy
# only makes the inputs. Python 3.11 (openpi's).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
src="${1:?usage: $0 OPENPI_SRC [REFENV]}"
refenv="${2:-/tmp/openpi-refenv}"
src="$(cd "$src" && pwd)"
[ -d "$src/src/openpi" ] && src="$src/src"

if [ ! -x "$refenv/bin/python" ]; then
  python3 -m venv "$refenv"
  "$refenv/bin/pip" install -q torch==2.13.0 transformers==4.53.2 safetensors "numpy<2.3"
fi
# openpi's README: cp -r ./src/openpi/models_pytorch/transformers_replace/* <site-packages>/transformers/
site="$("$refenv/bin/python" -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')"
cp -r "$src/openpi/models_pytorch/transformers_replace/"* "$site/"

cd "$repo"
HF_HUB_OFFLINE=1 "$refenv/bin/python" "$here/openpi_fixtures.py" all --src "$src" --out assets/reference
du -ch assets/reference/openpi_pi0*_tiny* | tail -1
