"""A registered head named by MLflow's model URIs: ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``.

:class:`HeadRef` is the one parser of these references and the one place that pins an alias to a
version (every caller: the recipe's ``training.init_from`` check, the warm start, the evaluate stage's
champion, the register stage's downloads, Serve). A pinned reference carries the version's
:data:`HEAD_SHA256_TAG` (sha256 of the head's ``peagle_checksums.json``), so whoever downloads it can
check that the files are the ones registered. The MLflow calls are imported where used: parsing needs
nothing but this module.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "models:/"
# MLflow's error codes for a model, alias or version the registry does not have (sqlite and server stores alike);
# any other MlflowException (e.g. an unreachable server) is not "no such version" and propagates.
NOT_FOUND_CODES = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
HEAD_SHA256_TAG = "head_sha256"  # version tag: sha256 of the head's peagle_checksums.json

__all__ = ["HEAD_SHA256_TAG", "PREFIX", "HeadRef"]


@dataclass(frozen=True)
class HeadRef:
    """A registered model's version (``version``, pinned) or alias (``alias``): exactly one of them.

    ``head_sha256``: the pinned version's :data:`HEAD_SHA256_TAG` (None: not resolved, or the version has
    no such tag). ``str(ref)`` is the MLflow URI: ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``.
    """

    name: str
    alias: str | None = None
    version: str | None = None
    head_sha256: str | None = None

    def __post_init__(self) -> None:
        if not self.name or (self.alias is None) == (self.version is None):
            raise ValueError(f"HeadRef(name={self.name!r}, alias={self.alias!r}, version={self.version!r}): give a "
                             "name and exactly one of alias / version")

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}/{self.version}" if self.pinned else f"{PREFIX}{self.name}@{self.alias}"

    @property
    def pinned(self) -> bool:
        """Whether it names a version (not an alias, which may move)."""
        return self.version is not None

    @staticmethod
    def is_ref(text: str) -> bool:
        """Whether ``text`` names a registered model (``models:/...``); anything else is a local directory."""
        return text.startswith(PREFIX)

    @classmethod
    def parse(cls, text: str) -> HeadRef:
        """``[models:/]NAME@ALIAS`` or ``[models:/]NAME/VERSION`` (VERSION: digits) as a reference.

        Raises:
            ValueError: neither form (the message shows both).
        """
        body = text.removeprefix(PREFIX)
        name, sep, alias = body.rpartition("@")
        if sep and name and alias:
            return cls(name, alias=alias)
        name, sep, version = body.rpartition("/")
        if sep and name and version.isdigit():
            return cls(name, version=version)
        raise ValueError(f"model reference {text!r} must look like models:/NAME@ALIAS (e.g. models:/peagle-smollm2-"
                         "135m-instruct@champion) or models:/NAME/VERSION")

    def resolve(self, tracking_uri: str | None = None, *, field: str = "head", fix: str = "",
                missing_ok: bool = False) -> HeadRef | None:
        """This reference pinned now: an alias's current version (a version stays), with that version's
        :data:`HEAD_SHA256_TAG`. Asks the registry (``pipelines.registry.client.get_client``).

        Args:
            field: what the reference is called in the error (e.g. ``training.init_from``).
            fix: the end of the error: what to do.
            missing_ok: return None when the registry has no such model, alias or version.

        Raises:
            ValueError: the registry has no such model, alias or version (unless ``missing_ok``), naming ``field``,
                the registry and ``fix``.
            mlflow.exceptions.MlflowException: any other registry failure (e.g. it does not answer).
        """
        from mlflow.exceptions import MlflowException

        from pipelines.registry.client import get_client

        client = get_client(tracking_uri)
        try:
            if self.pinned:
                mv = client.get_model_version(self.name, self.version)
            else:
                mv = client.get_model_version_by_alias(self.name, self.alias)
        except MlflowException as e:
            if e.error_code not in NOT_FOUND_CODES:
                raise
            if missing_ok:
                return None
            what = f"version {self.version!r}" if self.pinned else f"alias {self.alias!r}"
            raise ValueError(f"{field}={str(self)!r}: the registry at {client.tracking_uri} has no such model "
                             f"version (registered model {self.name!r} has no {what}: {e.message})"
                             + (f"; {fix}" if fix else "")) from None
        return HeadRef(self.name, version=str(mv.version), head_sha256=(mv.tags or {}).get(HEAD_SHA256_TAG))
