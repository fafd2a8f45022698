"""The README documents every configuration field and metric that exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lookahead_vllm.core.config import LookaheadConfig
from lookahead_vllm.core.request_options import KEYS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _table_keys() -> set[str]:
    return set(re.findall(r"^\| `([\w{}]+)", README, flags=re.M))


def test_every_config_field_in_the_configuration_table():
    missing = [f.name for f in dataclasses.fields(LookaheadConfig) if f.name not in _table_keys()]
    assert not missing, f"README configuration table lacks {missing}"


def test_every_per_request_key_documented():
    assert set(KEYS) <= _table_keys()


def test_every_lookahead_metric_documented():
    from lookahead_vllm.vllm import metrics

    source = Path(metrics.__file__).read_text()
    names = set(re.findall(r'"(lookahead_[a-z_]+)"', source))
    documented = {k.split("{")[0].removesuffix("_total") for k in _table_keys()}
    assert names and not names - documented, names - documented
