"""``embodied check-render`` / ``embodied setup-render``: does SAPIEN rendering work here, and if not,
make it work (install lavapipe, a CPU Vulkan driver). ``check-render`` also renders a MetaWorld frame in
MetaWorld's interpreter where it is installed (MuJoCo's EGL backend; LIBERO renders the same way).

They take no flags and no overrides: they test the machine, not a config. Exit 0 when rendering
works, 1 when it does not (the table in embodied/cli.py).
"""

from __future__ import annotations

import argparse

from envs.rendering import check_render, install_egl, install_lavapipe

RENDER_FAILED = 1  # EXIT_FAILED in embodied/cli.py's table: the check ran, and rendering does not work


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``check-render`` and ``setup-render``: no arguments."""
    check = subparsers.add_parser("check-render", help="does SAPIEN rendering work here? what to install if not",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.set_defaults(run=run_check)
    setup = subparsers.add_parser("setup-render", help="make SAPIEN and MetaWorld rendering work (installs lavapipe, "
                                  "EGL if needed)",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    setup.set_defaults(run=run_setup)


def run_check(args: argparse.Namespace) -> int:
    """Print what rendering does here; exit 1 if it does not work (SAPIEN's, or an installed MetaWorld's)."""
    from envs.metaworld import check_metaworld_render  # torch, through the env processes' module: not for --help

    works, message = check_render()
    print(message)
    metaworld_works, metaworld_message = check_metaworld_render()
    print(metaworld_message)
    return 0 if works and metaworld_works is not False else RENDER_FAILED


def run_setup(args: argparse.Namespace) -> int:
    """Make SAPIEN rendering work (nothing to do where a Vulkan driver works already), and an installed
    MetaWorld's (EGL: nothing to do where it renders already)."""
    from envs.metaworld import check_metaworld_render

    works, message = check_render()
    if not works:
        print(f"No working Vulkan driver; installing lavapipe: {install_lavapipe(verbose=False)}")
        from envs.metaworld import check_metaworld_render  # torch, through the env processes' module: not for --help

    works, message = check_render()
    print(message)
    metaworld_works, metaworld_message = check_metaworld_render()
    if metaworld_works is False:
        print(f"MetaWorld does not render; installing EGL: {install_egl(verbose=False)}")
        metaworld_works, metaworld_message = check_metaworld_render()
    print(metaworld_message)
    return 0 if works and metaworld_works is not False else RENDER_FAILED
