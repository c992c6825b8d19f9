"""Pricing table and cost/acceptance reporting over the committed metrics dataset."""

from __future__ import annotations

import datetime as dt

import pytest

from schemas.pricing import (
    DEFAULT_PRICES_PATH,
    UnknownDeviceError,
    load_prices,
    parse_price_overrides,
    price_for,
)


def test_packaged_prices_cover_required_devices_with_date_and_source():
    prices = load_prices()
    assert {"cpu", "cuda-h100", "gaudi2", "gaudi3"} <= set(prices)
    for device_type, price in prices.items():
        assert price.usd_per_hour > 0, device_type
        assert isinstance(price.as_of, dt.date)
        assert price.source.strip()
    assert "placeholder" in prices["gaudi2"].source


def test_price_overrides_replace_the_entry_and_say_so():
    prices = load_prices(overrides={"gaudi2": 1.25})
    assert prices["gaudi2"].usd_per_hour == 1.25
    assert prices["gaudi2"].source == "override"
    assert prices["cpu"] == load_prices()["cpu"]


def test_unknown_device_errors_list_the_known_ones():
    with pytest.raises(UnknownDeviceError, match=r"'tpu'.*known device types: cpu, cuda-a100"):
        load_prices(overrides={"tpu": 1.0})
    with pytest.raises(UnknownDeviceError, match="gaudi3"):
        price_for(load_prices(), "gaudi4")


def test_bad_price_file_names_the_device(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("gaudi2:\n  usd_per_hour: -1\n  as_of: 2026-01-01\n  source: contract\n")
    with pytest.raises(ValueError, match="'gaudi2'"):
        load_prices(path)
    assert DEFAULT_PRICES_PATH.exists()


@pytest.mark.parametrize("item", ["gaudi2", "gaudi2=abc", "=1.0", "cpu=-2"])
def test_price_flag_parsing_rejects_malformed_items(item):
    with pytest.raises(ValueError, match="DEVICE=USD_PER_HOUR"):
        parse_price_overrides([item])


def test_price_flag_parsing():
    assert parse_price_overrides(["gaudi2=1.5", " cpu =0"]) == {"gaudi2": 1.5, "cpu": 0.0}
