#!/usr/bin/env bash
# Regenerate assets/reference: tiny OpenVLA / OpenVLA-OFT checkpoints built and run by the upstream code.
#
# Nothing here runs in the project's venv, and no upstream code is copied into the project: the
# script makes a throwaway venv with upstream's pins, imports upstream's sources from snapshots
# you fetched yourself, and writes only the checkpoints and what upstream computed on them.
#
# Usage:
#   benchmarks/reference/make_fixtures.sh OPENVLA_SRC OFT_SRC TRANSFORMERS_OFT_SRC SIMPLEVLA_SRC [REFENV]
#     OPENVLA_SRC           a work tree of openvla/openvla at c8f03f4 (prismatic/extern/hf, experiments/robot)
#     OFT_SRC               a work tree of moojink/openvla-oft at 213c5ff
#     TRANSFORMERS_OFT_SRC  a work tree of moojink/transformers-openvla-oft at bc339d9 (v4.40.1 + bidirectional
#                           Llama SDPA attention); its src/ goes on PYTHONPATH for the OFT fixtures only. Its
#                           directory name must contain "transformers-openvla-oft" (build_fixtures.py checks)
#     SIMPLEVLA_SRC         a work tree of PRIME-RL/SimpleVLA-RL at 7c51662 (verl/utils/vla_utils/openvla_oft)
#     REFENV                the throwaway venv (default /tmp/embodied-refenv; reused when it exists)
#   e.g. git clone https://github.com/openvla/openvla && git -C openvla checkout c8f03f4 (likewise the others)
#
# Then, in the project's venv: .venv/bin/python benchmarks/reference/capture_inputs.py (the input
# frames; run it first when the envs change) and .venv/bin/python -m pytest tests/test_reference_parity.py.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
openvla="$(cd "$1" && pwd)"; oft="$(cd "$2" && pwd)"; fork="$(cd "$3" && pwd)"; simplevla="$(cd "$4" && pwd)"
refenv="${5:-/tmp/embodied-refenv}"

if [ ! -x "$refenv/bin/python" ]; then
  python3 -m venv "$refenv"
  # torch + torchvision that import together on CPU (2.13.0+cpu and PyPI torchvision do not:
  # docs/architecture.md, "Measured facts"); upstream's own pins for the rest
  "$refenv/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
  "$refenv/bin/pip" install -q transformers==4.40.1 timm==0.9.10 tokenizers==0.19.1 "huggingface-hub<0.26" \
    diffusers==0.30.3 sentencepiece protobuf safetensors "numpy<2" pillow tensorflow-cpu imageio json_numpy requests
fi

test -f "$repo/assets/reference/inputs.npz" || { echo "run capture_inputs.py in the project venv first" >&2; exit 1; }
cd "$repo"
"$refenv/bin/python" "$here/build_fixtures.py" openvla --src "$openvla" --out assets/reference
PYTHONPATH="$fork/src" "$refenv/bin/python" "$here/build_fixtures.py" oft --src "$oft" --out assets/reference
PYTHONPATH="$fork/src" "$refenv/bin/python" "$here/build_fixtures.py" simplevla --src "$simplevla" --out assets/reference
# options the first fixtures do not use; "oft_aloha" on the command line makes OFT's constants.py pick ALOHA's
"$refenv/bin/python" "$here/build_fixtures.py" openvla_single --src "$openvla" --out assets/reference
PYTHONPATH="$fork/src" "$refenv/bin/python" "$here/build_fixtures.py" oft_aloha --src "$oft" --out assets/reference
PYTHONPATH="$fork/src" "$refenv/bin/python" "$here/build_fixtures.py" oft_proprio_mask --src "$oft" --out assets/reference
du -sh assets/reference
