"""The producing libraries' own packing and dequantization code for AWQ and GPTQ, kept here to
write test checkpoints and to cross-check sitsd's converters.

Neither library installs on the CPU test machines: AutoAWQ (deprecated; its package needs
`datasets` and pins nothing it runs with here) and GPTQModel (it requires torch >= 2.14). Their
functions below are copied from the released sources, with only what the copy needs changed:

* AutoAWQ 0.2.9 (MIT licence): `awq/utils/packing_utils.py` (`unpack_awq`, `reverse_awq_order`,
  `dequantize_gemm`, verbatim) and the packing loops of `WQLinear_GEMM.from_linear`
  (`awq/modules/linear/gemm.py`), taking the integer codes instead of a float weight.
* AutoGPTQ's `QuantLinear.pack` loops (the format GPTQModel still writes with
  `checkpoint_format: gptq`), taking integer codes and masking each code to 4 bits (the original
  ORs `zeros - 1` unmasked, so a zero point of 0 corrupts its whole word: tests avoid it), and
  GPTQModel 7.7.0's `dequantize_weight` arithmetic (Apache-2.0 licence) for 4 bits:
  `scales[g_idx] * (weight - zeros[g_idx])` on its internal "v2" zeros (stored + 1 for v1).
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


# --- AutoAWQ 0.2.9, awq/utils/packing_utils.py (verbatim) ------------------------------------


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int):
    shifts = torch.arange(0, 32, bits, device=qzeros.device)

    # unpacking columnwise
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(
        torch.int8  # smallest dtype available
    )
    iweights = iweights.view(iweights.shape[0], -1)

    # unpacking columnwise
    if qzeros is not None:
        izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(
            torch.int8  # smallest dtype available
        )
        izeros = izeros.view(izeros.shape[0], -1)
    else:
        izeros = qzeros

    return iweights, izeros


def reverse_awq_order(iweights: torch.Tensor, izeros: torch.Tensor, bits: int):
    reverse_order_tensor = torch.arange(
        iweights.shape[-1],
        dtype=torch.int32,
        device=izeros.device,
    )
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, AWQ_REVERSE_ORDER]
    reverse_order_tensor = reverse_order_tensor.view(-1)

    if izeros is not None:
        izeros = izeros[:, reverse_order_tensor]
    iweights = iweights[:, reverse_order_tensor]

    return iweights, izeros


def dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    # Unpack the qweight and qzeros tensors
    iweight, izeros = unpack_awq(qweight, qzeros, bits)
    # Reverse the order of the iweight and izeros tensors
    iweight, izeros = reverse_awq_order(iweight, izeros, bits)

    # overflow checks
    iweight = torch.bitwise_and(iweight, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)

    # fp16 weights
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    iweight = (iweight - izeros) * scales

    return iweight


# --- AutoAWQ 0.2.9, WQLinear_GEMM.from_linear's packing loops --------------------------------


def awq_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight [K, N / 8] and qzeros [G, N / 8] from codes [K, N] and zero points [G, N]."""
    w_bit, pack_num = 4, 8
    intweight = intweight.to(dtype=torch.int32)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * w_bit), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)
    zeros = zeros.to(dtype=torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * w_bit), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    return qweight, qzeros


# --- AutoGPTQ QuantLinear.pack loops (4 bits) -------------------------------------------------


def gptq_pack(
    intweight: torch.Tensor, zeros: torch.Tensor, *, minus_one: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight [K / 8, N] and qzeros [G, N / 8] from codes [K, N] and zero points [G, N]; the
    original format stores `zeros - 1` (`minus_one`), gptq_v2 the zero points themselves."""
    bits = 4
    intweight = intweight.numpy().astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = 0
    row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = (zeros - 1 if minus_one else zeros).numpy().astype(np.int64) & 0xF
    zeros = zeros.astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


# --- GPTQModel 7.7.0 dequantize_weight (4 bits) ------------------------------------------------


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    minus_one: bool,
) -> torch.Tensor:  # [K, N] in scales' dtype (GPTQModel returns W transposed, as stored)
    bits, pack_factor, maxq = 4, 8, 15
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, pack_factor), wf.unsqueeze(0)
    ).to(torch.int16)
    zeros = torch.bitwise_and(zeros, maxq).reshape(qzeros.shape[0], -1)
    if minus_one:  # GPTQModel converts v1 checkpoints to v2 at load: every zero point + 1
        zeros = zeros + 1
    weight = torch.bitwise_and(
        torch.bitwise_right_shift(
            torch.unsqueeze(qweight, 1).expand(-1, pack_factor, -1), wf.unsqueeze(-1)
        ).to(torch.int16),
        maxq,
    )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])
