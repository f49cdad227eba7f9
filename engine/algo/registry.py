"""Name -> implementation tables for the config-selectable parts of the PPO algorithm.

Each *kind* corresponds to one config key; its names are the values that key accepts:

==================  ==========================================================================
kind                config key(s)
==================  ==========================================================================
``adv_estimator``   ``algorithm.adv_estimator``
``kl_estimator``    ``algorithm.kl_penalty``, ``actor_rollout_ref.actor.kl_loss_type``
``kl_controller``   ``algorithm.kl_ctrl.type``
``policy_loss``     ``actor_rollout_ref.actor.policy_loss.loss_mode``
``loss_agg_mode``   ``actor_rollout_ref.actor.loss_agg_mode``, ``critic.loss_agg_mode``
==================  ==========================================================================

The implementations register themselves with :func:`register` when their modules
(``advantages``, ``kl``, ``losses``) are imported; :func:`names` and :func:`get` import them on
first use, so a config validator can import only this module::

    from engine.algo import registry
    registry.names("adv_estimator")            # ['gae', 'grpo', ...]
    registry.get("policy_loss", "vanilla")     # the function
    registry.get("adv_estimator", "gea")       # UnknownNameError naming the key and valid names
"""
from __future__ import annotations

import importlib
from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable)

# The config key each kind is selected by; also the fixed set of kinds.
CONFIG_KEYS: dict[str, str] = {
    "adv_estimator": "algorithm.adv_estimator",
    "kl_estimator": "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type",
    "kl_controller": "algorithm.kl_ctrl.type",
    "policy_loss": "actor_rollout_ref.actor.policy_loss.loss_mode",
    "loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode / critic.loss_agg_mode",
}

_TABLES: dict[str, dict[str, Callable]] = {kind: {} for kind in CONFIG_KEYS}
# Modules whose import fills the tables (they call `register` at import time).
_IMPLEMENTING_MODULES = ("engine.algo.advantages", "engine.algo.kl", "engine.algo.losses")


class UnknownNameError(ValueError):
    """A config value names no registered implementation; the message lists the valid names."""


def register(kind: str, *names: str) -> Callable[[_F], _F]:
    """Decorator: make the function selectable under each of ``names`` for ``kind``."""
    table = _table(kind)

    def decorator(fn: _F) -> _F:
        for name in names:
            if name in table and table[name] is not fn:
                raise ValueError(f"{kind} name {name!r} is registered twice")
            table[name] = fn
        return fn

    return decorator


def names(kind: str) -> list[str]:
    """All names (aliases included) accepted for ``kind``, sorted."""
    _load_implementations()
    return sorted(_table(kind))


def get(kind: str, name: str, config_key: str | None = None) -> Callable:
    """The implementation registered as ``name`` for ``kind``.

    Raises:
        UnknownNameError: ``name`` is not registered; the message names ``config_key`` (default:
            the key(s) of ``kind`` from :data:`CONFIG_KEYS`) and lists the valid names.
    """
    _load_implementations()
    table = _table(kind)
    if name not in table:
        key = config_key or CONFIG_KEYS[kind]
        raise UnknownNameError(
            f"{key}={name!r} is not a known {kind}; valid names: {', '.join(sorted(table))}"
        )
    return table[name]


def _table(kind: str) -> dict[str, Callable]:
    if kind not in _TABLES:
        raise ValueError(f"unknown registry kind {kind!r}; kinds: {', '.join(_TABLES)}")
    return _TABLES[kind]


def _load_implementations() -> None:
    # Imported lazily: the implementing modules import this one to register themselves.
    for module in _IMPLEMENTING_MODULES:
        importlib.import_module(module)
