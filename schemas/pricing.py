"""Device prices in $ per device-hour, so reports can turn device-seconds into money.

The packaged table (`prices.yaml`) carries a date and a source for every number because prices
drift and some (Gaudi) are placeholders; runs and reports can override them per device type.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_PRICES_PATH = Path(__file__).with_name("prices.yaml")
OVERRIDE_SOURCE = "report override (--price)"  # where a price that replaced the table's came from


def device_cost(seconds: float, devices: int, usd_per_device_hour: float) -> float:
    """The one cost formula: `devices` devices held for `seconds` at a price per device-hour.
    schemas/metrics_views.sql defines the same as a macro; a test pins the two together."""
    return seconds * devices / 3600 * usd_per_device_hour


class UnknownDeviceError(KeyError):
    """A device type that the price table does not list."""

    def __init__(self, device_type: str, known: list[str]):
        self.device_type = device_type
        self.known = sorted(known)
        super().__init__(device_type)

    def __str__(self) -> str:
        return (
            f"no price for device type {self.device_type!r}; known device types: "
            f"{', '.join(self.known)}. Add it to the price table (YAML) or fix the name."
        )


class DevicePrice(BaseModel):
    """One row of the price table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    usd_per_hour: float = Field(ge=0.0)
    as_of: dt.date
    source: str = Field(min_length=1)


def load_prices(
    path: str | Path | None = None, overrides: dict[str, float] | None = None
) -> dict[str, DevicePrice]:
    """Read the price table, then apply per-run/per-report overrides (dated today).

    Overrides must name device types the table knows, so a typo cannot silently price nothing.
    """
    path = Path(path) if path is not None else DEFAULT_PRICES_PATH
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a mapping of device type -> price entry")
    prices: dict[str, DevicePrice] = {}
    for device_type, entry in raw.items():
        try:
            prices[str(device_type)] = DevicePrice.model_validate(entry)
        except ValidationError as exc:
            raise ValueError(
                f"{path}: bad price entry for device type {device_type!r} (needs usd_per_hour "
                f">= 0, as_of date, source): {exc}"
            ) from exc
    for device_type, usd in (overrides or {}).items():
        if device_type not in prices:
            raise UnknownDeviceError(device_type, list(prices))
        prices[device_type] = DevicePrice(
            usd_per_hour=usd, as_of=dt.date.today(), source=OVERRIDE_SOURCE
        )
    return prices


def price_for(prices: dict[str, DevicePrice], device_type: str) -> DevicePrice:
    """Look a device type up, failing with the list of known ones."""
    try:
        return prices[device_type]
    except KeyError:
        raise UnknownDeviceError(device_type, list(prices)) from None


def parse_price_overrides(items: list[str]) -> dict[str, float]:
    """Parse CLI `device=usd_per_hour` items (e.g. `gaudi2=1.5`)."""
    overrides: dict[str, float] = {}
    for item in items:
        device_type, sep, value = item.partition("=")
        try:
            if not sep or not device_type.strip():
                raise ValueError
            usd = float(value)
            if usd < 0:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--price {item!r}: expected DEVICE=USD_PER_HOUR with a non-negative number, "
                "e.g. --price gaudi2=1.50"
            ) from None
        overrides[device_type.strip()] = usd
    return overrides
