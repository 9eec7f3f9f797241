"""NF4 quantisation (nn/nf4.h) against bitsandbytes' `quantize_4bit(..., quant_type="nf4")` on the
CPU, for fp32, bf16 and fp16 weights, block sizes 64 and 128, sizes that leave a partial block and
an odd count of values, blocks of zeros and outliers:
- the packed 4-bit codes, the fp32 absmax constants, the offset and the second-level fp32 scales
  of double quantisation: bit for bit;
- the 8-bit codes of the double-quantised constants: bit for bit against the published algorithm
  (round to the nearest value of the signed dynamic map: midpoint bounds, as bitsandbytes' own
  CUDA and reference kernels do), written out below; bitsandbytes' CPU library searches the map
  with a binary search that can return the neighbour of the nearest value (1 constant in 240 on
  the first weight), so against it every difference must be one step to a value strictly farther
  from the input than ours;
- the dynamic map itself: bit for bit;
- the dequantised weights: level x constant (the published dequantisation) of the verified codes
  and constants, bit for bit. (bitsandbytes' CPU dequantize_4bit does not serve as the oracle
  here: for weights whose rows are not a multiple of the block it scales later blocks with other
  blocks' constants, disagreeing with its own quantizer's state.)
"""
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
TOOL = os.path.join(BUILD, "tests", "nn", "nf4_tool")
import bitsandbytes.functional as F  # noqa: E402  (pinned in scripts/requirements.txt)


def weights():
    g = torch.Generator().manual_seed(0)
    w = {"normal": torch.randn(96, 160, generator=g) * 0.02,
         "tail": torch.randn(7, 37, generator=g),          # 259 values: a partial block, odd count
         "outliers": torch.randn(64, 64, generator=g).index_put_((torch.tensor([3, 9]), torch.tensor([5, 7])),
                                                                torch.tensor([40.0, -55.0])),
         "zeros": torch.cat([torch.zeros(128), torch.randn(128, generator=g)]).view(4, 64),
         "many_blocks": torch.randn(300, 256, generator=g) * 0.05}  # 1200 blocks: 5 second-level blocks
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blocksize,double", [(64, True), (64, False), (128, True)])
def test_codes_and_scales_equal_bitsandbytes(tmp_path, dtype, blocksize, double):
    w = {k: v.to(dtype) for k, v in weights().items()}
    save_file(w, str(tmp_path / "in.safetensors"))
    r = subprocess.run([TOOL, str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), str(blocksize),
                        "1" if double else "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ours = load_file(str(tmp_path / "out.safetensors"))
    for name, x in w.items():
        q, st = F.quantize_4bit(x, blocksize=blocksize, quant_type="nf4", compress_statistics=double)
        assert torch.equal(ours[name + ".codes"], q.reshape(-1)), name
        if double:
            assert torch.equal(ours[name + ".absmax2"], st.state2.absmax), name
            assert ours[name + ".offset"].item() == st.offset.item(), name
            # The published rounding: the nearest dynamic-map value of each centred constant.
            code = st.state2.code
            a1 = x.float().reshape(-1)
            n = a1.numel() // blocksize * blocksize
            absmax1 = a1[:n].reshape(-1, blocksize).abs().amax(1)
            if n < a1.numel():
                absmax1 = torch.cat([absmax1, a1[n:].abs().amax().unsqueeze(0)])
            c = absmax1 - st.offset
            m = c.numel() // 256 * 256
            scale = st.state2.absmax.clamp(min=1e-38)
            v = torch.cat([(c[:m].reshape(-1, 256) * (1.0 / scale[:m // 256]).unsqueeze(1)).reshape(-1),
                           c[m:] / scale[-1]]).clamp(-1, 1)
            ref = torch.bucketize(v, (code[:-1] + code[1:]) / 2).to(torch.uint8)
            mine = ours[name + ".absmax"]
            assert torch.equal(mine, ref), name
            diff = (mine != st.absmax).nonzero().flatten()
            assert diff.numel() <= max(1, c.numel() // 50), (name, diff.numel())
            for i in diff.tolist():
                a, b = int(mine[i]), int(st.absmax[i])
                assert abs(a - b) == 1 and abs(v[i] - code[a]) < abs(v[i] - code[b]), (name, i, a, b)
            assert torch.equal(ours["dynamic_map"], code)
            absmax = code[mine.long()] * st.state2.absmax.repeat_interleave(256)[:mine.numel()] + st.offset
        else:
            assert torch.equal(ours[name + ".absmax"], st.absmax), name
            absmax = st.absmax
        c = q.reshape(-1)
        idx = torch.stack([c >> 4, c & 15], 1).reshape(-1)[:x.numel()].long()
        levels = F.get_4bit_type("nf4", device="cpu")
        ref = (levels[idx] * absmax.repeat_interleave(blocksize)[:x.numel()]).to(dtype).view(x.shape)
        assert ours[name + ".dequant"].dtype == dtype
        assert torch.equal(ours[name + ".dequant"], ref), (name, (ours[name + ".dequant"].float() - ref.float()).abs().max())


def test_bad_input_is_named(tmp_path):
    save_file({"ints": torch.arange(10, dtype=torch.int32)}, str(tmp_path / "in.safetensors"))
    r = subprocess.run([TOOL, str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"), "64", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a floating dtype" in r.stderr, r.stderr
    save_file({"w": torch.randn(10)}, str(tmp_path / "in.safetensors"))
    r = subprocess.run([TOOL, str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"), "63", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "blocksize must be positive and even" in r.stderr, r.stderr
