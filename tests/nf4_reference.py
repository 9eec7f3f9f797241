"""NF4 with double quantisation by the published algorithm (QLoRA, Dettmers et al. 2023), on top of
bitsandbytes' CPU quantize_4bit: its 4-bit codes, first-level constants' offset and second-level
scales are the published ones (tests/nn/test_nf4_bnb.py checks ours against them bit for bit); the
8-bit codes of the constants are rounded to the nearest dynamic-map value here (bitsandbytes' CPU
library may pick a neighbour), and the weight is level x constant in fp32. Used as the oracle of
the QLoRA tests."""
import torch


def nf4_dequantized(x, blocksize=64):
    import bitsandbytes.functional as F
    a1 = x.float().reshape(-1)
    q, st = F.quantize_4bit(a1, blocksize=blocksize, quant_type="nf4", compress_statistics=True)
    n = a1.numel() // blocksize * blocksize
    absmax1 = a1[:n].reshape(-1, blocksize).abs().amax(1)
    if n < a1.numel():
        absmax1 = torch.cat([absmax1, a1[n:].abs().amax().unsqueeze(0)])
    code = st.state2.code
    c = absmax1 - st.offset
    m = c.numel() // 256 * 256
    scale = st.state2.absmax.clamp(min=1e-38)
    v = torch.cat([(c[:m].reshape(-1, 256) * (1.0 / scale[:m // 256]).unsqueeze(1)).reshape(-1),
                   c[m:] / scale[-1]]).clamp(-1, 1)
    a8 = torch.bucketize(v, (code[:-1] + code[1:]) / 2)
    absmax = code[a8] * st.state2.absmax.repeat_interleave(256)[:a8.numel()] + st.offset
    codes = q.reshape(-1)
    idx = torch.stack([codes >> 4, codes & 15], 1).reshape(-1)[:a1.numel()].long()
    levels = F.get_4bit_type("nf4", device="cpu")
    return (levels[idx] * absmax.repeat_interleave(blocksize)[:a1.numel()]).view(x.shape).contiguous()
