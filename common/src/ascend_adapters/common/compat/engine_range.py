"""The engine-range policy: which vLLM releases this project supports and is tested on, and the start-up refusal outside them.

Reading the engine version imports nothing from vLLM (it reads the installed distribution's metadata).
"""

from __future__ import annotations

import functools

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ascend_adapters.common.versions import engine_distribution

# The supported engine range: start-up goes on inside it. Keep in step with the README, docs/install.md
# and each pyproject.toml (classifier/description), which say the same.
ENGINE_MIN = "0.27.1"
ENGINE_MAX_SERIES = "0.32"  # every 0.32.x release
ENGINE_RANGE = f">={ENGINE_MIN},<0.33"
ENGINE_RANGE_TEXT = f"vLLM {ENGINE_MIN} to {ENGINE_MAX_SERIES}.x"
# The releases the gates run on (noxfile: the primary ENGINE and COMPAT_ENGINES): a release between them
# is supported, not tested.
TESTED_RELEASES = ("0.27.1", "0.28.0", "0.32.0")
TESTED_RELEASES_TEXT = ", ".join(TESTED_RELEASES[:-1]) + f" and {TESTED_RELEASES[-1]}"
# The engine `nox -s tests` runs the full suite on; evidence of other engines is kept beside it.
PRIMARY_ENGINE_SERIES = "0.32"
# Set to on to start on an engine outside ENGINE_RANGE (read with common.flags).
ENGINE_OVERRIDE_ENV = "ASCEND_ADAPTERS_ALLOW_UNTESTED_ENGINE"


@functools.lru_cache(maxsize=1)
def engine_version() -> Version | None:
    """The installed engine's release (local label such as ``+cpu`` or ``+empty`` dropped), or None."""
    found = engine_distribution()
    if found is None:
        return None
    return Version(Version(found[1]).base_version)


def engine_release(version: str | None = None) -> str | None:
    """``0.28.0`` for ``0.28.0+empty`` (default: the installed engine); None when unknown."""
    if version is None:
        current = engine_version()
        return str(current) if current is not None else None
    try:
        return Version(version).base_version
    except ValueError:
        return None


def is_primary_engine(version: str) -> bool:
    """Whether ``version`` belongs to the primary engine series (``PRIMARY_ENGINE_SERIES``)."""
    return SpecifierSet(f"=={PRIMARY_ENGINE_SERIES}.*").contains(Version(version), prereleases=True)


def engine_in_range(version: str | Version) -> bool:
    """Whether ``version`` (a local label such as ``0.28.0+empty`` is allowed) lies in ``ENGINE_RANGE``."""
    return SpecifierSet(ENGINE_RANGE).contains(Version(str(version)), prereleases=True)


def engine_check(installed: str | None, override: bool) -> str | None:
    """The one refusal line for an engine outside the supported range, or None when start-up may go on.

    ``installed`` is the engine distribution's version string (None: no engine
    found, nothing to check); ``override`` is the value of ``ENGINE_OVERRIDE_ENV``.
    """
    if installed is None or override:
        return None
    try:
        if engine_in_range(installed):
            return None
    except ValueError:
        pass  # an unparseable version is outside every range
    return (
        f"ascend-adapters: vLLM {installed} is outside the supported range {ENGINE_RANGE_TEXT} ({ENGINE_RANGE}; "
        f"tested on {TESTED_RELEASES_TEXT}); "
        f"install an engine in that range or set {ENGINE_OVERRIDE_ENV}=on to start anyway"
    )


def engine_status() -> dict:
    """The engine, the supported range, the tested releases and whether the override is on (for
    ``ascend-adapters status``)."""
    from ascend_adapters.common.flags import env_flag

    found = engine_distribution()
    installed = found[1] if found else None
    try:
        override = env_flag(ENGINE_OVERRIDE_ENV)
    except ValueError as exc:
        override = f"invalid ({exc})"
    in_range = None
    if installed is not None:
        try:
            in_range = engine_in_range(installed)
        except ValueError:
            in_range = False
    return {
        "distribution": found[0] if found else None,
        "version": installed,
        "supported_range": ENGINE_RANGE,
        "tested_releases": list(TESTED_RELEASES),
        "in_range": in_range,
        "override_env": ENGINE_OVERRIDE_ENV,
        "override": override,
    }


class EngineVersionError(RuntimeError):
    """The installed engine is outside the supported range and the override is off."""


def require_supported_engine() -> None:
    """Refuse start-up (one line) on an engine outside ``ENGINE_RANGE`` unless the override is on."""
    from ascend_adapters.common.flags import env_flag

    try:
        override = env_flag(ENGINE_OVERRIDE_ENV)
    except ValueError as exc:  # flags.FlagError: a word outside the on/off vocabulary
        raise EngineVersionError(f"ascend-adapters: {exc}") from None
    found = engine_distribution()
    message = engine_check(found[1] if found else None, override)
    if message is not None:
        raise EngineVersionError(message)
