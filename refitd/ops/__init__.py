"""Operator commands: ``refitd status | regions | sources | pulls | experts`` and
``refitd config check``. Each module exposes ``add_arguments(parser)`` and
``run(args) -> int`` for :mod:`refitd.cli`; the shared plumbing (which daemon to
talk to, tables, ``--json``, progress bars) lives in :mod:`refitd.ops.console`.

Modules:

- `console`: shared plumbing: reaching the daemon, tables, ``--json``
- `status`: ``refitd status``
- `regions`: ``refitd regions``
- `sources`: ``refitd sources``
- `pulls`: ``refitd pulls``
- `pull`: ``refitd pull FILE``
- `experts`: ``refitd experts``
- `gc`: ``refitd gc``
- `config_cmd`: ``refitd config check FILE``
"""
