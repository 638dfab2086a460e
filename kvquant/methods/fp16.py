"""fp16: the baseline every method is measured against — K/V stored and read as IEEE half."""

from __future__ import annotations

import torch

from kvquant.cache import KVLayer, to_fp16_checked
from kvquant.methods.base import KVMethod, register_method


class Fp16Layer(KVLayer):
    """A dynamic layer that stores K/V in float16 whatever the compute dtype.

    On a CPU the model runs in fp32; storing fp16 keeps the baseline's 16 bits real there too.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]), dtype=torch.float16)
            self.values = value_states.new_empty(
                (*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=torch.float16
            )
        self.keys = torch.cat([self.keys, to_fp16_checked(key_states, self.layer_idx, "key")], dim=-2)
        self.values = torch.cat([self.values, to_fp16_checked(value_states, self.layer_idx, "value")], dim=-2)
        return self.read(key_states.dtype)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention gets: the whole history, read at 16 bits."""
        self.count_read({16: self.keys.numel()}, {16: self.values.numel()})
        return self.keys.to(dtype), self.values.to(dtype)


class Fp16Method(KVMethod):
    """Plain half-precision cache: 16 bits stored, 16 read."""

    def __init__(self) -> None:
        pass

    def new_layer(self, layer_idx: int, model_config) -> Fp16Layer:
        return Fp16Layer(layer_idx)

    def analytic_bits(self) -> float:
        return 16.0


register_method("fp16", Fp16Method)
