"""The one fault-injection object: checked at construction, absent unless asked for."""

from __future__ import annotations

import pytest

from kvshare.cli import build_parser
from kvshare.kvpool.faults import FaultInjection, breaks, faults_from_config, injected_delay
from kvshare.serve.cli import injected_faults


def test_bad_faults_are_refused() -> None:
    with pytest.raises(ValueError, match="break_order"):
        FaultInjection(break_order="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_delay"):
        FaultInjection(load_delay=-1.0)


def test_no_faults_break_nothing() -> None:
    assert not breaks(None, "load") and not breaks(None, "store") and injected_delay(None) == 0.0
    assert breaks(FaultInjection(break_order="load"), "load")
    assert not breaks(FaultInjection(break_order="load"), "store")


def test_kvshare_serve_injects_faults_only_when_an_unsafe_flag_asks() -> None:
    parser = build_parser({})
    assert injected_faults(parser.parse_args(["serve"])) is None
    args = parser.parse_args(
        [
            "serve",
            "--unsafe-break-stream-order",
            "load",
            "--unsafe-load-delay",
            "0.5",
            "--unsafe-skip-checksums",
        ]
    )
    assert injected_faults(args) == FaultInjection(
        break_order="load", load_delay=0.5, skip_checksums=True
    )


def test_a_config_entry_asks_only_for_faults_its_component_implements() -> None:
    honoured = frozenset({"skip_state_restore"})
    assert faults_from_config(None, honoured) is None
    assert faults_from_config({}, honoured) is None
    assert faults_from_config({"skip_state_restore": False}, honoured) is None
    assert faults_from_config({"skip_state_restore": True}, honoured) == FaultInjection(
        skip_state_restore=True
    )
    # A switch the component does not implement would leave the variant unbroken.
    with pytest.raises(ValueError, match=r"not implemented here \['skip_checksums'\]"):
        faults_from_config({"skip_checksums": True}, honoured)
    with pytest.raises(ValueError, match=r"unknown \['skip_state_load'\]"):
        faults_from_config({"skip_state_load": True}, honoured)
