"""Operator commands: ``refitd status | regions | sources | pulls | experts`` and
``refitd config check``. Each module exposes ``add_arguments(parser)`` and
``run(args) -> int`` for :mod:`refitd.cli`; the shared plumbing (which daemon to
talk to, tables, ``--json``, progress bars) lives in :mod:`refitd.ops.console`."""
