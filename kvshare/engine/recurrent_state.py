"""Per-sequence state of linear-attention (Gated DeltaNet) layers, beside the paged KV.

A hybrid model's sequence has, besides its KV blocks, one state slot: the conv state and
the float32 recurrent state of every linear layer. A slot is one contiguous row of bytes
(`rows[slot]`), so copying a whole state to or from a pool page is one memcpy; typed,
strided views give the model its per-layer tensors.

Slots are either held by a running sequence or by a *snapshot*: the state at a chunk
boundary of some prefix, kept so that another request with that prefix can resume there
(the GPU-local counterpart of the pool's state pages). Snapshots are found by the block
hash of the boundary and evicted least recently used. A state can also be copied aside
(`copy_aside`): a snapshot slot that is found only once `keep` names its boundary (a
restored state, kept only once the restore is verified). Snapshots and copies aside
together hold at most `num_snapshots` slots, so every sequence slot stays available.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvshare.models.config import ModelConfig


class RecurrentStates:
    def __init__(
        self,
        config: ModelConfig,
        num_sequence_slots: int,
        num_snapshots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = config.linear_layers
        self.linear_index = {layer: i for i, layer in enumerate(self.layers)}
        item = torch.empty((), dtype=dtype).element_size()
        self.conv_shape = config.conv_state_shape
        self.rec_shape = config.recurrent_state_shape
        self.conv_bytes = item * self.conv_shape[0] * self.conv_shape[1]
        self.rec_bytes = 4 * self.rec_shape[0] * self.rec_shape[1] * self.rec_shape[2]
        self.slot_bytes = len(self.layers) * (self.conv_bytes + self.rec_bytes)
        num_slots = num_sequence_slots + num_snapshots
        self.rows = torch.zeros((num_slots, self.slot_bytes), dtype=torch.uint8, device=device)
        self.dtype = dtype
        self.free = list(range(num_slots - 1, -1, -1))
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # boundary hash -> slot
        self.pins: dict[int, int] = {}  # snapshot slot -> copies still reading it
        self.aside: set[int] = set()  # slots copied aside, not yet kept or dropped
        self.max_snapshots = num_snapshots

    def _views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = self.linear_index[layer] * (self.conv_bytes + self.rec_bytes)
        conv = (
            self.rows[:, base : base + self.conv_bytes]
            .view(self.dtype)
            .unflatten(1, self.conv_shape)
        )
        rec = self.rows[:, base + self.conv_bytes : base + self.conv_bytes + self.rec_bytes]
        return conv, rec.view(torch.float32).unflatten(1, self.rec_shape)

    def load(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conv, rec = self._views(layer)
        return conv.index_select(0, slots), rec.index_select(0, slots)

    def save(
        self, layer: int, slots: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor
    ) -> None:
        conv, rec = self._views(layer)
        conv.index_copy_(0, slots, conv_state.to(conv.dtype))
        rec.index_copy_(0, slots, rec_state.float())

    # ------------------------------------------------------------------ slots

    def allocate(self) -> int:
        """A zeroed slot for a sequence starting fresh; evicts a snapshot when none is free."""
        if not self.free and not self._evict_snapshot():
            raise RuntimeError("no free recurrent-state slot: every slot is held")
        slot = self.free.pop()
        self.rows[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def _evict_snapshot(self) -> bool:
        """Free the least recently used unpinned snapshot; False when every one is pinned."""
        for key, slot in self.snapshots.items():
            if not self.pins.get(slot):
                del self.snapshots[key]
                self.free.append(slot)
                return True
        return False

    # ------------------------------------------------------------------ snapshots

    def find(self, boundary_hash: bytes) -> int | None:
        slot = self.snapshots.get(boundary_hash)
        if slot is not None:
            self.snapshots.move_to_end(boundary_hash)
        return slot

    def snapshot(self, boundary_hash: bytes, source_slot: int) -> int | None:
        """Copy a sequence's state (on the current stream, in order with the step that
        produced it) into a snapshot slot kept under boundary_hash. None when snapshots are
        disabled or none can be made room for."""
        if boundary_hash in self.snapshots:
            return self.find(boundary_hash)
        slot = self.copy_aside(source_slot)
        if slot is not None:
            self.keep(boundary_hash, slot)
        return slot

    def copy_aside(self, source_slot: int) -> int | None:
        """Copy a sequence's state (on the current stream) into a snapshot slot that is not
        found until `keep`. None when snapshots are disabled or none can be made room for."""
        while len(self.snapshots) + len(self.aside) >= self.max_snapshots or not self.free:
            if not self._evict_snapshot():
                return None
        slot = self.free.pop()
        self.rows[slot].copy_(self.rows[source_slot])
        self.aside.add(slot)
        return slot

    def keep(self, boundary_hash: bytes, slot: int) -> None:
        """Make a slot copied aside the snapshot of boundary_hash (freed if one exists)."""
        self.aside.remove(slot)
        if boundary_hash in self.snapshots:
            self.free.append(slot)
            return
        self.snapshots[boundary_hash] = slot

    def drop_aside(self, slot: int) -> None:
        self.aside.remove(slot)
        self.free.append(slot)

    def restore(self, snapshot_slot: int, target_slot: int) -> None:
        self.rows[target_slot].copy_(self.rows[snapshot_slot])

    def pin(self, slot: int) -> None:
        self.pins[slot] = self.pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1

    def reset_snapshots(self) -> None:
        for key, slot in list(self.snapshots.items()):
            if not self.pins.get(slot):
                del self.snapshots[key]
                self.free.append(slot)
