"""The checks and parsing of ``contextpilot-bench`` option values that argparse cannot do alone:
comma-separated lists, the planning-window options that only apply together, and the proxy
method's options, which apply to it alone.

Every function raises ``ValueError`` with the option's name on a bad value;
:func:`~contextpilot_bench.cli.main` prints it and exits with code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from contextpilot_bench.cli_arguments import (
    DEFAULT_WINDOW_POLICY,
    DEFAULT_WINDOWS_MS,
)
from contextpilot_integrations.core.window.window_policy import WindowPolicy

__all__ = [
    "parse_methods",
    "parse_numbers",
    "parse_sessions",
    "proxy_options_given",
    "window_settings",
]

_WINDOW_OPTIONS = ("window_ms", "rate", "max_batch", "window_adaptive", "seed")
"""The options that only apply with ``--arrival``, as ``argparse`` names them."""

_PROXY_OPTIONS = (
    "proxy_max_in_flight",
    "proxy_window_hold_ms",
    "proxy_target_workers",
    "proxy_kv_capacity",
)
"""The options of the proxy method of ``--replicas N --engine vllm-cpu`` alone, as
``argparse`` names them (``None``: not given)."""


def proxy_options_given(args: argparse.Namespace) -> list[str]:
    """The proxy method's options given, as written (``--no-...`` for a switch turned off), so
    a run without that method refuses them by name instead of ignoring them."""
    given = []
    for name in _PROXY_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            flag = name.replace("_", "-")
            given.append(f"--no-{flag}" if value is False else f"--{flag}")
    return given


def parse_methods(text: str | None, allowed: Sequence[str]) -> list[str]:
    """``--methods``: the names given, in their order, or all of ``allowed`` when not given.

    Raises:
        ValueError: an empty list, a name not in ``allowed``, or a name given twice.
    """
    if text is None:
        return list(allowed)
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods is empty: {text!r}")
    unknown = [m for m in methods if m not in allowed]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {list(allowed)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods must not repeat, got {methods}")
    return methods


def parse_sessions(text: str) -> list[int]:
    """``--sessions``: conversations open at a time, one run per value.

    Raises:
        ValueError: no value, a value that is not an integer, or one below 1.
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sessions must be integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--sessions must be integers >= 1, got {text!r}")
    return values


def parse_numbers(text: str, option: str, *, positive: bool) -> list[float]:
    """A comma-separated list of finite numbers for ``option`` (named in the errors); each
    ``> 0`` when ``positive``, else ``>= 0``.

    Raises:
        ValueError: no value, a value that is not a number, or one out of range.
    """
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} must be numbers separated by commas, got {text!r}") from None
    bad = [v for v in values if not (v > 0 if positive else v >= 0) or v == float("inf")]
    if not values or bad:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{option} must be finite numbers {bound}, got {text!r}")
    return values


def window_settings(args: argparse.Namespace) -> list[tuple[WindowPolicy, float | None]]:
    """The ``--arrival`` run's ``(policy, rate)`` per window length; ``[]`` without
    ``--arrival``.

    Raises:
        ValueError: a window option without ``--arrival``, ``--arrival`` with ``--mode
            offline``, a bad or negative value, or a ``--rate`` list of another length than
            ``--window-ms``.
    """
    if args.arrival is None:
        given = [name for name in _WINDOW_OPTIONS if getattr(args, name) is not None]
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ValueError(
                f"{option} needs --arrival (poisson or replay): windows group requests "
                "by their arrival times"
            )
        return []
    if args.mode != "online":
        raise ValueError(
            "--arrival needs --mode online (offline plans the whole workload as one batch)"
        )
    windows = parse_numbers(args.window_ms or DEFAULT_WINDOWS_MS, "--window-ms", positive=False)
    if len(set(windows)) != len(windows):
        raise ValueError(f"--window-ms must not repeat, got {args.window_ms!r}")
    rates: list[float | None]
    if args.rate is None:
        if args.arrival == "poisson":
            raise ValueError("--arrival poisson needs --rate (requests per second)")
        rates = [None] * len(windows)
    else:
        parsed = parse_numbers(args.rate, "--rate", positive=True)
        if len(parsed) not in (1, len(windows)):
            raise ValueError(
                f"--rate has {len(parsed)} values for {len(windows)} --window-ms values; give "
                "one, or one per window"
            )
        rates = list(parsed * len(windows) if len(parsed) == 1 else parsed)
    max_batch = DEFAULT_WINDOW_POLICY.max_batch if args.max_batch is None else args.max_batch
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    adaptive = (
        DEFAULT_WINDOW_POLICY.adaptive if args.window_adaptive is None else args.window_adaptive
    )
    return [
        (WindowPolicy(ms / 1000, max_batch, adaptive), rate)
        for ms, rate in zip(windows, rates, strict=True)
    ]
