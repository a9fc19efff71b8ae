"""Who owns a model, and who may read it: the ``[models]`` table and first publishers.

A model name is an object like a region: it has owners. They are the principals
``[models] owners`` names for it (``MODEL=PRINCIPAL`` entries), or, for a model the
config does not list, the principal that first published a version of it on this
daemon (for the daemon's life). Only an owner publishes a version or a part of it,
drains it or retires it. Its readers (who may lease it, and so read its bytes, and
fetch its manifest) are everyone by default, or the principals ``[models] readers``
names for it (its owners read it too).

Pure: no I/O; the handlers pass the request's :class:`~refitd.daemon.access.auth.Principal`.
Unauthenticated loopback clients are one principal, so nothing here is enforced
between them; root on the Unix socket acts on any model.
"""

from __future__ import annotations

from collections.abc import Iterable

from refitd.config import parse_model_table
from refitd.daemon.access.auth import Principal
from refitd.errors import AccessDenied, ConflictError, QuotaExceeded

__all__ = ["ModelOwners", "parse_model_table"]


class ModelOwners:
    """The owners and readers of every model one daemon serves."""

    def __init__(self, owners: Iterable[str] = (), readers: Iterable[str] = ()) -> None:
        self._configured = parse_model_table(owners, "models.owners")
        self._readers = parse_model_table(readers, "models.readers")
        self._first: dict[str, str] = {}  # model -> its first publisher (unlisted models)
        self._held: set[str] = set()  # models the daemon holds as host mirrors
        #: principal -> the models it published into that the config does not list:
        #: each keeps records in the daemon for its life, so they are counted
        self._models_of: dict[str, set[str]] = {}

    def owners(self, model: str) -> frozenset[str]:
        """The principals that own ``model`` (empty: nobody yet, the next publisher will)."""
        if model in self._configured:
            return self._configured[model]
        first = self._first.get(model)
        return frozenset((first,)) if first is not None else frozenset()

    def check_owner(self, who: Principal, model: str, action: str) -> None:
        """Refuse (:class:`AccessDenied`, 403) ``action`` on ``model`` by a principal
        that does not own it. A model nobody owns yet passes (its first publisher
        becomes its owner, see :meth:`claim`), unless the config lists its owners."""
        owners = self.owners(model)
        if owners and not who.sees(*owners):
            named = ", ".join(sorted(owners))
            raise AccessDenied(
                f"{who.name} may not {action} model {model!r}: it belongs to {named}; only a "
                "model's owners publish, drain and retire its versions"
            )

    def admit(self, who: Principal, limit: int, model: str) -> None:
        """Refuse (:class:`QuotaExceeded`, 429) a publish by ``who`` into ``model``, a
        model it has not published into, once it has published into ``limit``
        (``limits.max_models_per_principal``); models the config lists are not
        counted (the config bounds them)."""
        if model in self._configured:
            return
        mine = self._models_of.get(who.name, set())
        if model not in mine and len(mine) >= limit:
            raise QuotaExceeded(
                f"publishing into model {model!r} refused: {who.name} has published into "
                f"{len(mine)} models, its cap (limits.max_models_per_principal = {limit}); "
                "each keeps its records in the daemon"
            )

    def claim(self, who: Principal, model: str) -> None:
        """Record ``who`` as the owner of ``model`` if nobody owns it yet (called
        after its first publish succeeded), and count the model as one of ``who``'s."""
        if model not in self._configured:
            self._models_of.setdefault(who.name, set()).add(model)
        if who.authenticated and not self.owners(model):
            self._first[model] = who.name

    def hold(self, model: str, name: str) -> None:
        """Make principal ``name`` (the daemon itself: a name no token or uid takes) the
        owner of ``model``, which it publishes on its own behalf (a host mirror), so no
        tenant publishes into, drains or retires it. A model ``[models] owners`` lists
        keeps its configured owners (the same rules as at the source, when every host
        lists the same). Refused (:class:`ConflictError`) when another principal owns
        it here: the daemon never publishes into a tenant's model."""
        if model in self._configured:
            self._held.add(model)
            return
        first = self._first.get(model)
        if first is not None and first != name:
            raise ConflictError(
                f"model {model!r} belongs to {first} on this daemon; the daemon does not "
                "publish into a tenant's model"
            )
        self._first[model] = name
        self._held.add(model)

    def held(self, model: str) -> bool:
        """Whether the daemon holds ``model`` as a host mirror (see :meth:`hold`)."""
        return model in self._held

    def may_read(self, who: Principal, model: str) -> bool:
        """Whether ``who`` may lease ``model`` and read its manifest. (A model the daemon
        holds as a host mirror is leased only under a live lease at its source as well:
        :meth:`refitd.daemon.mirror.mirrors.Mirrors.admit_lease`.)"""
        readers = self._readers.get(model)
        return readers is None or who.sees(*readers, *self.owners(model))

    def check_read(self, who: Principal, model: str, action: str) -> None:
        """Refuse (:class:`AccessDenied`, 403) ``action`` by a principal that is not
        one of ``model``'s readers."""
        if not self.may_read(who, model):
            raise AccessDenied(
                f"{who.name} may not {action} model {model!r}: its readers are listed in "
                "[models] readers, and this principal is neither one of them nor an owner"
            )
