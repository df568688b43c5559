"""The ``embodied`` commands, one module each (``train``, ``sft``, ``eval`` + ``evals``, ``record``,
``bench``, ``plan``, ``chaos``, ``render``: check-render + setup-render), and ``common``, what they share.

Each module has ``add_parser(subparsers)``, which declares the command's flags and only those (so a
flag another command takes is refused, never silently ignored), and the functions its parser's
``run`` default points at. ``embodied/cli.py`` assembles them, explains errors and owns the exit codes.
"""
