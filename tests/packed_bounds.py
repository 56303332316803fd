"""How far the packed C kernels (tessera_kernels.quant_cpu) may put an output from the float product of the
same weight: they quantize the activations to int8 per block, which moves each output by at most
sum_i |w_i| * max|x| of i's block / 254 (half a step of the activation's quantization)."""

from __future__ import annotations

import torch

from tessera_kernels import quant_cpu


def activation_bound(weight: torch.Tensor, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[m, rows]: the most the int8 activations can move each output of x @ weight.T."""
    step = x.float().reshape(x.shape[0], -1, block).abs().amax(-1).repeat_interleave(block, -1) / 254
    return step @ weight.abs().float().T


def layer_activation_bound(layer, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """activation_bound per segment of a packed layer, each with its kernel's activation block, over the
    inputs in the order the layer takes them (an act-order GPTQ layer's sorted by group)."""
    order = getattr(layer, "input_order", None)
    if order is not None:
        weight, x = weight[:, order], x[:, order]
    bound = torch.zeros(x.shape[0], weight.shape[0])
    for seg in layer.segments:
        block = 32 if seg.kind == "dense" else quant_cpu.activation_block(seg.kind, layer.in_features)
        columns = slice(seg.start, seg.start + seg.rows)
        bound[:, columns] = activation_bound(weight[columns], x, block)
    return bound
