"""KV-canary settings: whether it runs, what a violation does, and how often reads are checked.

    SGLANG_KV_CANARY                 off | log | raise   (default off; any case, none = off)
    SGLANG_KV_CANARY_SAMPLE_EVERY    int >= 1            (default 1: check every forward)
    SGLANG_KV_CANARY_DEFERRED_DRAIN  0 | 1               (default 1: read findings back behind the
                                                          forward; 0: at once, a host sync per forward)

Writes are fingerprinted on every forward once the canary is on: a skipped write would leave a
stale fingerprint behind and report a violation later. Sampling only thins out the checks.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

ENV_MODE = "SGLANG_KV_CANARY"
ENV_SAMPLE_EVERY = "SGLANG_KV_CANARY_SAMPLE_EVERY"
ENV_DEFERRED_DRAIN = "SGLANG_KV_CANARY_DEFERRED_DRAIN"


class CanaryMode(enum.Enum):
    OFF = "off"
    # log each violation, count it, keep serving
    LOG = "log"
    # log, then raise KVCanaryViolationError out of the forward's bracket
    RAISE = "raise"


# Every spelling --kv-canary and SGLANG_KV_CANARY accept (lower case; the input is lowered).
# "none" is newer upstream sglang's name for off.
MODE_SPELLINGS = {
    "off": CanaryMode.OFF,
    "none": CanaryMode.OFF,
    "log": CanaryMode.LOG,
    "raise": CanaryMode.RAISE,
}

# The flags whose explicit values parse_canary_config takes, named in its errors.
MODE_FLAG = "--kv-canary"
SAMPLE_EVERY_FLAG = "--kv-canary-sample-every"


@dataclass(frozen=True)
class CanaryConfig:
    mode: CanaryMode = CanaryMode.OFF
    # Check every Nth bracketed forward (1 = all) ...
    sample_every: int = 1
    # ... or, when set, this fraction of them, spread evenly (0 < f <= 1).
    sample_fraction: Optional[float] = None
    # Violation records kept per forward on the device; more are counted but not recorded.
    violation_capacity: int = 64
    # Log lines per drained forward; the rest are summarised in one line.
    max_log_lines: int = 16
    # Read a checked forward's findings back behind it (copy + event) and report them at a
    # later bracket, instead of syncing the host with the GPU after every checked forward,
    # which stalls the overlap scheduler. Raise mode then raises a few forwards late.
    deferred_drain: bool = True

    @property
    def enabled(self) -> bool:
        return self.mode is not CanaryMode.OFF


def parse_canary_config(
    mode: Union[str, CanaryMode, None] = None,
    sample_every: Union[int, str, None] = None,
    *,
    sample_fraction: Union[float, str, None] = None,
    deferred_drain: Union[bool, str, None] = None,
    env: Optional[Mapping[str, str]] = None,
) -> CanaryConfig:
    """Build the config from explicit values, falling back to the environment for unset ones.

    Explicit values come from --kv-canary / --kv-canary-sample-every; a bad value raises
    ValueError naming the flag or the variable it came from. The mode is case-insensitive.
    """
    env = os.environ if env is None else env
    mode_source = MODE_FLAG if mode is not None else ENV_MODE
    raw_mode = mode if mode is not None else env.get(ENV_MODE, "off")
    parsed_mode = _parse_mode(raw_mode, mode_source)

    if sample_every is not None and sample_fraction is not None:
        raise ValueError("give sample_every or sample_fraction, not both")
    every_source = SAMPLE_EVERY_FLAG if sample_every is not None else ENV_SAMPLE_EVERY
    raw_every = (
        sample_every if sample_every is not None else env.get(ENV_SAMPLE_EVERY, "1")
    )
    every = _parse_sample_every(raw_every, every_source)
    fraction = None if sample_fraction is None else _parse_fraction(sample_fraction)
    deferred_source = (
        "deferred_drain" if deferred_drain is not None else ENV_DEFERRED_DRAIN
    )
    raw_deferred = (
        deferred_drain
        if deferred_drain is not None
        else env.get(ENV_DEFERRED_DRAIN, "1")
    )
    deferred = _parse_bool(raw_deferred, deferred_source)
    return CanaryConfig(
        mode=parsed_mode,
        sample_every=every,
        sample_fraction=fraction,
        deferred_drain=deferred,
    )


def _parse_bool(raw: Union[bool, str], source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{source}={raw!r}: expected 0 or 1")


def _parse_mode(raw: Union[str, CanaryMode], source: str) -> CanaryMode:
    if isinstance(raw, CanaryMode):
        return raw
    text = str(raw).strip().lower() or "off"
    if text not in MODE_SPELLINGS:
        raise ValueError(
            f"{source}={raw!r}: expected one of {'|'.join(MODE_SPELLINGS)}"
        )
    return MODE_SPELLINGS[text]


def _parse_sample_every(raw: Union[int, str], source: str) -> int:
    try:
        if isinstance(raw, bool):
            raise ValueError
        value = raw if isinstance(raw, int) else int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{source}={raw!r}: expected an integer >= 1") from None
    if value < 1:
        raise ValueError(f"{source}={raw!r}: expected an integer >= 1")
    return value


def _parse_fraction(raw: Union[float, str]) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"sample_fraction={raw!r}: expected a number in (0, 1]"
        ) from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"sample_fraction={raw!r}: expected a number in (0, 1]")
    return value


class VerifySampler:
    """Decides, once per bracketed forward, whether that forward's reads are checked.

    Deterministic (a counter, no RNG), so a run with the same schedule checks the same forwards.
    """

    def __init__(self, config: CanaryConfig):
        self._every = config.sample_every
        self._fraction = config.sample_fraction
        self._ticks = 0

    def tick(self) -> bool:
        k = self._ticks
        self._ticks += 1
        if self._fraction is not None:
            # Check forward k when floor((k + 1) * f) steps past floor(k * f): evenly spread.
            return int((k + 1) * self._fraction) > int(k * self._fraction)
        return k % self._every == 0
