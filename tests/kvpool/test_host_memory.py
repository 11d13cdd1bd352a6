"""The arena is registered with CUDA slab by slab (strided copies rely on it: one may not
span two registrations), and every registration is undone."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from kvshare.kvpool.host_memory import HostRegistration, mapped_in_slabs

MIB = 1 << 20


ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class StandInRuntime:
    """cudaHostRegister / cudaHostUnregister that record their calls; the registration
    numbered `refuse` (from 0) fails, and, as in the driver, so does one of an address
    still registered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.refuse: int | None = None
        self.registered: set[int] = set()

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        if pointer in self.registered:
            self.calls.append(("refused", pointer, nbytes))
            return ALREADY_REGISTERED
        refused = len(self.calls) == self.refuse
        self.calls.append(("refused" if refused else "register", pointer, nbytes))
        if not refused:
            self.registered.add(pointer)
        return 1 if refused else 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer, 0))
        self.registered.discard(pointer)
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


def test_a_registration_dropped_without_unregistering_is_undone_when_collected(
    runtime: StandInRuntime,
) -> None:
    """A replica's LLM dropped without close (a notebook, a test): its registrations must
    not outlive it. The driver keeps them past munmap, refuses the next mapping at those
    addresses and copies from there read the dead mapping's pages."""
    host = torch.frombuffer(mmap.mmap(-1, 3 * MIB), dtype=torch.uint8)
    slabs = [host.data_ptr() + k * MIB for k in range(3)]
    dropped = HostRegistration(torch.device("cuda", 0))
    dropped.register_slabs(host, MIB, 3)
    dropped.wait()
    del dropped
    gc.collect()
    assert runtime.calls[3:] == [("unregister", p, 0) for p in slabs]
    again = HostRegistration(torch.device("cuda", 0))
    again.register_slabs(host, MIB, 3)
    again.wait()
    assert again.registered_bytes == 3 * MIB
    again.unregister()
    assert not runtime.registered


@pytest.mark.cuda
def test_cuda_takes_a_collected_registrations_memory_again() -> None:
    """The same on the driver itself: after the first registration is collected, the
    memory registers again (without the finalizer CUDA refuses it as already registered)."""
    host = torch.frombuffer(mmap.mmap(-1, 2 * MIB), dtype=torch.uint8)
    device = torch.device("cuda", torch.cuda.current_device())
    first = HostRegistration(device)
    first.register_slabs(host, MIB, 2)
    first.wait()
    assert first.registered_bytes == 2 * MIB
    del first
    gc.collect()
    again = HostRegistration(device)
    again.register_slabs(host, MIB, 2)
    again.wait()
    try:
        assert again.registered_bytes == 2 * MIB
    finally:
        again.unregister()
