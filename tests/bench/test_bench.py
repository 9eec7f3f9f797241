"""`colossal bench` on CPU: the report is complete, its JSON has every field, the FLOP figures
equal an independent computation (N counted by HF transformers from the same config.json),
recompute (-g) leaves the loss unchanged and is counted by ColossalAI's formula, two ranks divide
per-GPU figures by the world size, and bad flags are errors."""
import json
import os
import subprocess

import pytest

BIN = os.environ["COLOSSAL_BIN"]

FIELDS = ["config", "step_seconds", "median_step_s", "mean_step_s", "tokens_per_s", "tokens_per_s_per_gpu",
          "samples_per_s", "model_flops_per_token", "model_tflops_per_gpu", "mfu_989",
          "colossalai_flops_per_rank_step", "colossalai_tflops_per_gpu", "megatron_flops_per_rank_step",
          "megatron_tflops_per_gpu", "peak_memory_mib", "peak_memory_kind", "final_loss"]
CONFIG_FIELDS = ["model", "plugin", "precision", "device", "grad_checkpoint", "flash_attention", "fused_ce",
                 "batch_per_dp_rank", "seq_len", "steps", "ignored_steps", "seed", "world_size", "dp_size",
                 "n_params", "num_layers", "hidden_size", "vocab_size"]

HF_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=257, hidden_size=48,
                 intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                 hidden_act="silu", initializer_range=0.02, bos_token_id=1, eos_token_id=2)


def bench(args, tmp_path, name="out.json", launcher=None, expect_ok=True):
    out = tmp_path / name
    cmd = (launcher or []) + [BIN, "bench", "--device", "cpu", "--json", str(out)] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if not expect_ok:
        return p
    assert p.returncode == 0, p.stdout + p.stderr
    return p, json.loads(out.read_text())


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def check_flops(r, n, layers, hidden, vocab, b, s, g):
    c = r["config"]
    world, dp = c["world_size"], c["dp_size"]
    med = r["median_step_s"]
    steps = sorted(r["step_seconds"])
    k = len(steps)
    assert close(med, steps[k // 2] if k % 2 else 0.5 * (steps[k // 2 - 1] + steps[k // 2]))
    assert k == c["steps"] - c["ignored_steps"]
    per_token = 6 * n + 12 * layers * hidden * s
    assert close(r["model_flops_per_token"], per_token)
    tok = b * dp * s / med
    assert close(r["tokens_per_s"], tok)
    assert close(r["tokens_per_s_per_gpu"], tok / world)
    assert close(r["samples_per_s"], b * dp / med)
    assert close(r["model_tflops_per_gpu"], tok / world * per_token / 1e12)
    assert close(r["mfu_989"], tok / world * per_token / 1e12 / 989)
    colossal = 2 * n * b * s * (3 + g)
    assert close(r["colossalai_flops_per_rank_step"], colossal)
    assert close(r["colossalai_tflops_per_gpu"], colossal / 1e12 / med / (world / dp))
    megatron = 24 * (3 + g) * b * s * layers * hidden ** 2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))
    assert close(r["megatron_flops_per_rank_step"], megatron)


def test_tiny_report_complete(tmp_path):
    p, r = bench(["-c", "tiny", "-s", "3", "-i", "1", "-b", "2", "-l", "64"], tmp_path)
    for f in FIELDS:
        assert f in r, f
    for f in CONFIG_FIELDS:
        assert f in r["config"], f
    c = r["config"]
    assert (c["model"], c["plugin"], c["precision"], c["device"], c["grad_checkpoint"]) == \
        ("tiny", "ddp", "fp32", "cpu", "none")
    assert (c["batch_per_dp_rank"], c["seq_len"], c["steps"], c["ignored_steps"]) == (2, 64, 3, 1)
    assert r["peak_memory_kind"] == "cpu peak RSS (process)" and r["peak_memory_mib"] > 0
    assert all(t > 0 for t in r["step_seconds"])
    for line in ["tokens/s/GPU", "samples/s", "model TFLOPS/GPU", "MFU vs 989 TFLOPS", "ColossalAI TFLOPS/GPU",
                 "peak memory", "median step"]:
        assert line in p.stdout, line
    result = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(result) == 1 and json.loads(result[0][7:]) == r
    check_flops(r, c["n_params"], c["num_layers"], c["hidden_size"], c["vocab_size"], 2, 64, 0)


def test_profile_writes_a_trace_and_a_table(tmp_path):
    d = tmp_path / "prof"
    p, r = bench(["-c", "tiny", "-s", "3", "-i", "1", "-b", "1", "-l", "32", "--profile", "--profile_dir", str(d)],
                 tmp_path)
    # The profiled step is extra: the timed steps are unchanged.
    assert len(r["step_seconds"]) == 2
    prof = r["profile"]
    assert prof["step_ms"] > 0 and prof["trace"] == str(d / "rank0.json")
    trace = json.loads((d / "rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), "no operators in the trace"
    assert "profile of one step" in p.stdout and "Chrome trace: " + str(d / "rank0.json") in p.stdout
    # A CPU run records no device activity and says so (no empty table pretending to be one).
    assert "no device activity recorded" in p.stdout


def hf_param_count(path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig.from_pretrained(str(path))
    model = transformers.LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture
def hf_config(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    return d


def test_flops_match_independent_count_and_recompute_is_exact(tmp_path, hf_config):
    n = hf_param_count(hf_config)
    args = ["-c", str(hf_config / "config.json"), "-s", "3", "-i", "1", "-b", "2", "-l", "32", "--seed", "5"]
    _, plain = bench(args, tmp_path, "plain.json")
    assert plain["config"]["n_params"] == n
    check_flops(plain, n, 3, 48, 257, 2, 32, 0)
    _, full = bench(args + ["-g"], tmp_path, "full.json")
    assert full["config"]["grad_checkpoint"] == "full"
    check_flops(full, n, 3, 48, 257, 2, 32, 1)
    _, attn = bench(args + ["--ckpt_mode", "attention"], tmp_path, "attn.json")
    assert attn["config"]["grad_checkpoint"] == "attention"
    check_flops(attn, n, 3, 48, 257, 2, 32, 0)
    # Recompute changes memory and time, not the training: after 3 optimizer steps the loss is
    # the same (gradients agree to ~1e-7 relative; the loss of step 3 sees them through AdamW).
    # The full-logits loss (--fused_ce false) trains the same as the default chunked fused one.
    _, logits = bench(args + ["--fused_ce", "false"], tmp_path, "logits.json")
    assert plain["config"]["fused_ce"] is True and logits["config"]["fused_ce"] is False
    # Per-layer selective recompute (first layer of 3): ColossalAI's formula counts 1/3 of a
    # recompute. The ATen composites instead of the fused kernels (fp32: the fused RMSNorm,
    # rotary and SwiGLU equal them to ~1e-6 relative) and the math SDPA backend train the same.
    _, one = bench(args + ["-g", "--ckpt_layers", "1"], tmp_path, "one.json")
    assert one["config"]["ckpt_layers"] == 1
    check_flops(one, n, 3, 48, 257, 2, 32, 1.0 / 3.0)
    _, unfused = bench(args + ["--fused_kernels", "false"], tmp_path, "unfused.json")
    assert plain["config"]["fused_kernels"] is True and unfused["config"]["fused_kernels"] is False
    _, math = bench(args + ["--attn_backend", "math"], tmp_path, "math.json")
    assert plain["config"]["attn_backend"] == "auto" and math["config"]["attn_backend"] == "math"
    # Gemini (ZeRO-3 chunks; half the optimizer chunks on the host) trains as ddp in fp32.
    _, gem = bench(args + ["-p", "gemini", "--offload_optim_frac", "0.5", "--prefetch_num", "1"],
                   tmp_path, "gemini.json")
    assert gem["config"]["plugin"] == "gemini" and gem["config"]["offload_optim_frac"] == 0.5
    # Full offload with the host chunks' CPU Adam in step() instead of beside the next forward.
    _, sync = bench(args + ["-p", "gemini", "--offload_optim_frac", "1", "--offload_param_frac", "1",
                            "--overlap_cpu_adam", "false"], tmp_path, "gemini_sync.json")
    assert gem["config"]["overlap_cpu_adam"] is True and sync["config"]["overlap_cpu_adam"] is False
    for r in (full, attn, logits, one, unfused, math, gem, sync):
        assert abs(r["final_loss"] - plain["final_loss"]) <= 1e-5 * abs(plain["final_loss"])


def test_two_ranks_per_gpu_figures(tmp_path, hf_config):
    launcher = [BIN, "run", "--nproc_per_node", "2", "--master_port", "0"]
    _, r = bench(["-c", str(hf_config / "config.json"), "-s", "3", "-i", "1", "-b", "2", "-l", "32"], tmp_path,
                 launcher=launcher)
    c = r["config"]
    assert (c["world_size"], c["dp_size"]) == (2, 2)
    check_flops(r, hf_param_count(hf_config), 3, 48, 257, 2, 32, 0)
    # Recompute under ZeRO-2 (gradient hooks fire from the recomputed graph): same training.
    _, z = bench(["-c", str(hf_config / "config.json"), "-s", "3", "-i", "1", "-b", "2", "-l", "32", "-p", "zero2",
                  "-g"], tmp_path, "zero2.json", launcher=launcher)
    assert z["config"]["plugin"] == "zero2" and z["config"]["grad_checkpoint"] == "full"
    check_flops(z, hf_param_count(hf_config), 3, 48, 257, 2, 32, 1)
    assert abs(z["final_loss"] - r["final_loss"]) <= 1e-5 * abs(r["final_loss"])


@pytest.mark.parametrize("args,message", [
    (["-p", "fsdp"], "not available"),
    (["-p", "gemini", "--offload_optim_frac", "1.5"], "fractions must be in [0, 1]"),
    (["-p", "zero2", "--prefetch_num", "2"], "apply to -p gemini only"),
    (["-p", "ddp", "--overlap_cpu_adam", "false"], "apply to -p gemini only"),
    (["-p", "gemini", "--overlap_cpu_adam", "no"], "--overlap_cpu_adam takes true or false"),
    (["-p", "3d_cpu"], "not available"),
    (["-p", "bogus"], "not a plugin"),
    (["--tp", "2"], "apply to --plugin hybrid (3d) only"),
    (["--pp", "2"], "apply to --plugin hybrid (3d) only"),
    (["--zero", "1"], "apply to --plugin hybrid (3d) only"),
    (["-p", "3d", "--pp", "2"], "is not divisible by tp_size * pp_size * sp_size"),
    (["-p", "3d", "--sp_mode", "bogus"], "unknown sequence parallelism mode"),
    (["--pp_style", "zbv"], "apply to --plugin hybrid (3d) only"),
    (["--shard_param_frac", "0.5"], "shard_param_frac"),
    (["-p", "3d", "--use_fp8_comm"], "--fp8_communication is available with --plugin ddp"),
    (["--use_fp8", "--fp8_recipe", "blockwise"], "blockwise"),
    (["-s", "2", "-i", "2"], "at least one step is timed"),
    (["-b", "0"], "batch_size"),
    (["--precision", "fp8"], "fp8"),
    (["--ckpt_mode", "selective"], "selective"),
    (["-l", "100000"], "max_position_embeddings"),
    (["--no_such_flag"], "unknown option"),
    (["--fused_ce", "maybe"], "--fused_ce"),
    (["--ce_chunk_tokens", "0"], "ce_chunk_tokens"),
    (["--fused_kernels", "maybe"], "--fused_kernels"),
    (["--cuda_graph"], "--cuda_graph needs --device cuda"),
    (["--attn_backend", "fa9"], "--attn_backend must be"),
    (["--profile_dir", "x"], "--profile_dir needs --profile"),
    (["--ckpt_layers", "1"], "--ckpt_layers needs -g"),
    (["-g", "--ckpt_layers", "9"], "owns only 4 decoder layers"),
    (["-g", "--ckpt_layers", "-2"], "--ckpt_layers must be"),
])
def test_bad_flags(tmp_path, args, message):
    p = bench(["-c", "tiny", "-s", "2", "-i", "1", "-b", "1", "-l", "16"] + args, tmp_path, expect_ok=False)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr


@pytest.mark.parametrize("plugin,nproc", [("none", 1), ("zero2", 2)])
def test_checkpoint_test(tmp_path, plugin, nproc):
    # --checkpoint_test: one save after the timed steps, timed with its peak memory; "discard"
    # writes nothing anywhere, a folder gets a checkpoint that loads (into the same run, timed)
    # and that Python's safetensors reads with the full shapes.
    launcher = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] if nproc > 1 else None
    args = ["-c", "tiny", "-p", plugin, "-s", "2", "-i", "1", "-b", "1", "-l", "32"]
    tmp_before = set(os.listdir("/tmp"))
    _, r = bench(args + ["--checkpoint_test", "discard"], tmp_path, "d.json", launcher)
    ck = r["checkpoint"]
    assert ck["where"] == "discard" and ck["save_s"] > 0 and "load_s" not in ck
    assert ck["save_peak_host_mib"] > 0 and ck["train_peak_host_mib"] > 0 and ck["bytes"] > 0
    assert not [n for n in set(os.listdir("/tmp")) - tmp_before if n.startswith("colossal-bench-ckpt")]
    folder = tmp_path / "ck"
    p, r = bench(args + ["--checkpoint_test", str(folder)], tmp_path, "f.json", launcher)
    ck = r["checkpoint"]
    assert ck["load_s"] > 0 and ck["load_peak_host_mib"] > 0
    assert "checkpoint (" in p.stdout + p.stderr
    files = sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())
    assert "optimizer.safetensors" in files and "model/model.safetensors" in files, files
    assert ck["bytes"] == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    from safetensors.numpy import load_file
    opt = load_file(str(folder / "optimizer.safetensors"))
    model = load_file(str(folder / "model" / "model.safetensors"))
    name = "model.embed_tokens.weight"
    states = [v for k, v in opt.items() if name in k]  # full shape under ZeRO too
    assert states and all(v.shape == model[name].shape for v in states), list(opt)[:5]
