"""Baseline for LoRA speed (issue 21): Hugging Face transformers Llama + PEFT LoRA + PyTorch, as a
user would run it: the base in bf16, PEFT's adapters (fp32, PEFT's autocast_adapter_dtype
default) on the chosen projections, bf16 autocast, fused AdamW over the adapters, SDPA attention.

python3 hf_peft_lora_baseline.py --model 7b --bs 1 --seq 4096 --r 16 [--ckpt]
Prints one line: RESULT {json} with the median step, tokens/s and the peak device memory.
"""
import argparse, json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
}
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="7b", choices=sorted(CONFIGS))
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", default=TARGETS)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=a.seq, **CONFIGS[a.model])
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if a.ckpt:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=a.targets.split(","),
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(1234))
    times = []
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    r = dict(model=a.model, bs=a.bs, seq=a.seq, r=a.r, targets=a.targets, ckpt=a.ckpt, step_s=round(med, 4),
             tok_s=round(a.bs * a.seq / med), trainable=sum(q.numel() for q in params),
             peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1), loss=round(float(loss), 4))
    print("RESULT", json.dumps(r))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
