"""The arena is registered with CUDA slab by slab (strided copies rely on it: one may not
span two registrations), and every registration is undone."""

from __future__ import annotations

import pytest
import torch

from kvshare.kvpool.host_memory import mapped_in_slabs

MIB = 1 << 20


class StandInRuntime:
    """cudaHostRegister / cudaHostUnregister that record their calls; the registration
    numbered `refuse` (from 0) fails."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.refuse: int | None = None

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        refused = len(self.calls) == self.refuse
        self.calls.append(("refused" if refused else "register", pointer, nbytes))
        return 1 if refused else 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer, 0))
        return 0


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> StandInRuntime:
    stand_in = StandInRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: stand_in)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return stand_in


def test_each_slab_is_registered_on_its_own_and_unregistered_on_exit(
    runtime: StandInRuntime,
) -> None:
    with mapped_in_slabs(3, MIB) as host:
        slabs = [host.data_ptr() + k * MIB for k in range(3)]
        assert runtime.calls == [("register", p, MIB) for p in slabs]
    assert runtime.calls[3:] == [("unregister", p, 0) for p in slabs]


def test_a_refused_slab_is_an_error_and_the_others_are_undone(runtime: StandInRuntime) -> None:
    """A check that copies from such memory must not run on a partly registered one."""
    runtime.refuse = 1
    with pytest.raises(RuntimeError, match="refused a slab"), mapped_in_slabs(3, MIB):
        pass
    registered = [p for what, p, _ in runtime.calls if what == "register"]
    assert len(registered) == 2
    assert [p for what, p, _ in runtime.calls if what == "unregister"] == registered
