"""What the compiled sm_90a attention kernels do, read from their SASS (no GPU needed).

The overlapped forward schedules (`overlap`, `pingpong`) exist so that a warpgroup's softmax of
key tile i runs while its own P V GEMM of tile i - 1 computes. Whether it does is decided by
ptxas, not by the source: with the wait for that GEMM (wgmma.wait_group 0) after the softmax in
the PTX, ptxas of CUDA 13.0 still placed the wait (WARPGROUP.DEPBAR.LE gsb0, 0x0) at the top of
its basic block, above every exponential, and the kernels were correct and slower with nothing
to show it. So this test disassembles the kernels the build made (cuobjdump and nvdisasm from the
pinned nvidia-cuda-cuobjdump / -nvdisasm wheels) and checks, for every overlapped forward
kernel, that the loop's exponentials (MUFU.EX2) lie between the wait for S (DEPBAR.LE gsb0, 0x1)
and the wait for P V, and that none follow the latter before the next GEMM is issued.

The same compiler turned the backward's masks, written inside its exponentials' loop under a
per-step condition, into predicated code that every step ran (about 300 of a step's 1,100
instructions at head dim 64, most steps needing no mask). So a backward step that needs no mask
must run none of the masks' compares.
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

OBJECTS = [p for p in os.environ.get("COLOSSAL_SM90_OBJECTS", "").split(":") if p]
# Exponentials of one key tile in one thread: 64 query rows x 128 keys over 128 threads.
TILE_EXPS = 64 * 128 // 128


def _tool_dir():
    import nvidia  # the namespace package of NVIDIA's pip wheels

    for root in nvidia.__path__:
        d = Path(root) / "cu13" / "bin"
        if (d / "cuobjdump").exists() and (d / "nvdisasm").exists():
            return d
    pytest.fail("cuobjdump / nvdisasm not found under the nvidia wheels "
                "(scripts/requirements.txt pins nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")


def _sass(obj):
    tools = _tool_dir()
    env = dict(os.environ, PATH=f"{tools}:{os.environ.get('PATH', '')}")
    out = subprocess.run([str(tools / "cuobjdump"), "-sass", obj], env=env, check=True,
                         capture_output=True, text=True).stdout
    functions, name, body = {}, None, []
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                functions[name] = body
            name, body = m.group(1), []
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m and name:
            # Instructions are 16 bytes apart from address 0: the index is the address / 16.
            assert int(m.group(1), 16) == 16 * len(body), f"{name}: a gap in the listing"
            body.append(m.group(2))
    if name:
        functions[name] = body
    return functions


def _object(source):
    objs = [o for o in OBJECTS if o.endswith(source + ".o")]
    if not objs:
        pytest.skip("the sm_90a kernels are not built here (no CUTLASS headers)")
    return objs[0]


def _forward_kernels():
    kernels = {}
    for name, body in _sass(_object("attention_fwd.cu")).items():
        # attention_fwd_kernel<FwdTraits<D, BN, stages>, causal, overlap, pingpong, ...>
        m = re.search(r"attention_fwd_kernel.*?FwdTraitsILi(\d+)ELi\d+ELi\d+EEE"
                      r"Lb(\d)ELb(\d)ELb(\d)E", name)
        if m:
            d, causal, overlap, pingpong = (int(g) for g in m.groups())
            kernels[(d, causal, overlap, pingpong)] = body
    return kernels


def test_every_forward_variant_is_built():
    kernels = _forward_kernels()
    want = {(d, c, o, p) for d in (64, 128) for c in (0, 1) for o, p in ((0, 0), (1, 0), (1, 1))}
    assert set(kernels) == want


def test_overlapped_softmax_runs_under_the_pv_gemm():
    for (d, causal, overlap, pingpong), body in sorted(_forward_kernels().items()):
        if not overlap:
            continue
        what = f"head dim {d}, causal {causal}, pingpong {pingpong}"
        wait_s = [i for i, ins in enumerate(body)
                  if re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", ins)]
        assert len(wait_s) == 1, f"{what}: one wait for S in the loop, found {len(wait_s)}"
        start = wait_s[0]
        end = next((i for i in range(start + 1, len(body))
                    if re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", body[i])), None)
        assert end is not None, f"{what}: no wait for the P V GEMM after the wait for S"
        before = sum(1 for ins in body[start:end] if "MUFU.EX2" in ins)
        after = 0
        for ins in body[end + 1:]:
            if ins.startswith("HGMMA") or "BAR.SYNC" in ins:
                break
            after += "MUFU.EX2" in ins
        assert before >= TILE_EXPS and after == 0, (
            f"{what}: {before} exponentials between the wait for S and the wait for P V, "
            f"{after} after it (want all {TILE_EXPS} of the tile before it): ptxas moved the "
            "wait above the softmax, so the softmax no longer overlaps the GEMM")


def _backward_kernels():
    kernels = {}
    for name, body in _sass(_object("attention_bwd.cu")).items():
        # attention_bwd_kernel<BwdTraits<D, BM>, causal, deterministic, dq_tma, ...>
        m = re.search(r"attention_bwd_kernel.*?BwdTraitsILi(\d+)ELi(\d+)EEELb(\d)ELb(\d)ELb(\d)E",
                      name)
        if m:
            kernels[tuple(int(g) for g in m.groups())] = body
    return kernels


def _unskipped(body, start, end):
    """The instructions of body[start:end] that no forward branch taken inside it skips: what
    runs there when every such branch is taken (for the masks' branch: a tile needing none)."""
    skipped = set()
    for i in range(start, end):
        m = re.match(r"@!?U?P\d+ BRA (?:!?U?P\d+, )?0x([0-9a-f]+)$", body[i])
        if m and int(m.group(1), 16) // 16 > i + 1:
            skipped.update(range(i + 1, int(m.group(1), 16) // 16))
    return [body[i] for i in range(start, end) if i not in skipped]


def _first(body, pattern, after=-1):
    return next((i for i in range(after + 1, len(body)) if re.match(pattern, body[i])), None)


def test_masks_are_behind_a_branch():
    # The backward's scores: from the wait for S^T to the dV GEMM that takes P^T. The masks
    # compare each score's key and query (ISETP); a tile needing none should compare nothing
    # there but the branch's own condition (48-161 compares a step before the fix).
    kernels = _backward_kernels()
    assert len(kernels) == 12, sorted(kernels)
    for key, body in sorted(kernels.items()):
        start = _first(body, r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b")
        end = _first(body, r"HGMMA", start)
        assert start is not None and end is not None, f"backward {key}: no S^T wait / dV GEMM"
        compares = sum(1 for ins in _unskipped(body, start, end)
                       if re.match(r"(@!?P\d+ )?ISETP", ins))
        assert compares <= 4, (
            f"backward {key} (head dim, queries, causal, deterministic, dq_tma): {compares} "
            "compares run on a step that needs no mask: the masks became predicated code that "
            "every step runs")
