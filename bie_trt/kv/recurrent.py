"""The recurrent cache group: a fixed state slot per sequence for linear-attention layers (Qwen3.5's Gated
DeltaNet), however long the sequence grows.

A slot holds, for every such layer, the causal conv's last W-1 inputs (activation dtype) and the delta-rule
state [H_v, K, V] in fp32 (it accumulates over the whole context: rounding it to fp16 each token would
compound). A sequence takes a slot when it starts and gives it back when it finishes or is preempted; a
slot is handed out zeroed and never to two sequences at once. `snapshot` / `restore` copy a slot's state
out and back (a preempted sequence); a speculative verify's step is logged per layer (`StepLog`) so that the
model can roll the state back to the accepted rows.

Snapshot slots (`num_snapshots`, after the sequences' slots in the same tensors) hold states saved at block
boundaries of a prompt, for a returning prompt to resume from (cache_tiers/state_snapshots.py decides which
key each holds; `copy` moves a state between any two slots).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig

FP32 = 4


def conv_channels(model: ModelConfig) -> int:
    """Channels of a DeltaNet layer's causal conv: its q, k and v projections together."""
    return 2 * model.linear_num_key_heads * model.linear_key_head_dim + \
        model.linear_num_value_heads * model.linear_value_head_dim


def recurrent_bytes_per_seq(model: ModelConfig, act_bytes: int = 2) -> int:
    """One sequence's state over every linear-attention layer: conv inputs in the activation dtype, the delta
    state in fp32. 0 for a model without such layers."""
    conv = conv_channels(model) * (model.linear_conv_kernel - 1) * act_bytes
    delta = model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * FP32
    return len(model.linear_layers) * (conv + delta)


@dataclass
class RecurrentSnapshot:
    conv: torch.Tensor    # [L, C, W-1]
    delta: torch.Tensor   # [L, H_v, K, V]


@dataclass
class StepLog:
    """One layer's state before a logged step, and the step's rows as the layer took them (conv inputs, log
    decays, write strengths): enough to replay any first part of the step."""
    conv: torch.Tensor     # [C, W-1]
    delta: torch.Tensor    # [H_v, K, V]
    inputs: torch.Tensor   # [T, C]
    g: torch.Tensor        # [T, H_v]
    beta: torch.Tensor     # [T, H_v]


@dataclass
class RecurrentStates:
    conv: torch.Tensor    # [L, slots, C, W-1], activation dtype
    delta: torch.Tensor   # [L, slots, H_v, K, V], fp32
    num_snapshots: int = 0   # the last slots: saved states, never a running sequence's
    free: list[int] = field(init=False)
    logs: dict[int, dict[int, StepLog]] = field(init=False)   # slot -> layer -> its logged step

    def __post_init__(self) -> None:
        self.free = list(range(self.num_slots))
        self.logs = {}

    def log(self, slot: int, layer: int, entry: StepLog) -> None:
        """Keep `entry`; a sequence whose logged step is cut into several inputs logs each in turn, and their
        rows extend the first one's log (the state before the step)."""
        first = self.logs.setdefault(slot, {}).get(layer)
        self.logs[slot][layer] = entry if first is None else StepLog(
            first.conv, first.delta, torch.cat([first.inputs, entry.inputs]), torch.cat([first.g, entry.g]),
            torch.cat([first.beta, entry.beta]))

    def logged_rows(self, slot: int) -> int:
        """Rows of `slot`'s logged step (0: none logged)."""
        layers = self.logs.get(slot)
        return next(iter(layers.values())).inputs.shape[0] if layers else 0

    def drop_log(self, slot: int) -> None:
        """Every row of the logged step was kept: nothing to roll back."""
        self.logs.pop(slot, None)

    @property
    def num_slots(self) -> int:
        """Slots for running sequences."""
        return self.conv.shape[1] - self.num_snapshots

    @property
    def snapshot_slots(self) -> list[int]:
        return list(range(self.num_slots, self.num_slots + self.num_snapshots))

    def allocate(self) -> int:
        """A free slot, zeroed: a new sequence's state."""
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} recurrent state slots are in use; free one first")
        slot = self.free.pop(0)
        self.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give a finished (or preempted) sequence's slot back."""
        if slot in self.free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"recurrent state slot {slot} is not in use")
        self.free.append(slot)
        self.logs.pop(slot, None)

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.delta[:, slot].zero_()

    def snapshot(self, slot: int) -> RecurrentSnapshot:
        return RecurrentSnapshot(self.conv[:, slot].clone(), self.delta[:, slot].clone())

    def restore(self, slot: int, snap: RecurrentSnapshot) -> None:
        self.conv[:, slot].copy_(snap.conv)
        self.delta[:, slot].copy_(snap.delta)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst`'s state (every layer's) becomes slot `src`'s."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.delta[:, dst].copy_(self.delta[:, src])

    def nbytes(self) -> int:
        return self.conv.nbytes + self.delta.nbytes


def allocate_recurrent(model: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float16,
                       device: torch.device | str = "cpu", num_snapshots: int = 0) -> RecurrentStates:
    """Every linear-attention layer's states for `num_slots` sequences and `num_snapshots` saved states,
    allocated once."""
    layers, num_slots = len(model.linear_layers), num_slots + num_snapshots
    conv = torch.zeros(layers, num_slots, conv_channels(model), model.linear_conv_kernel - 1, dtype=dtype,
                       device=device)
    delta = torch.zeros(layers, num_slots, model.linear_num_value_heads, model.linear_key_head_dim,
                        model.linear_value_head_dim, dtype=torch.float32, device=device)
    return RecurrentStates(conv, delta, num_snapshots)
